"""What a model dir holds, read from its ``config.json`` and safetensors headers alone (no torch,
no model code): dense or MoE, how many experts, whether the checkpoint stores the experts fused
(``experts.gate_up_proj``) or one linear per expert (``experts.3.gate_proj``), and the modules
serving stacks expect left in high precision for that model type."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qckpt.errors import UsageError

# model_type -> the router (gate) modules' patterns: vLLM and ModelOpt keep routers in BF16
_ROUTERS = {
    "mixtral": ["*.block_sparse_moe.gate"],
    "qwen2_moe": ["*.mlp.gate", "*.mlp.shared_expert_gate"],
    "gpt_oss": ["*.mlp.router"],
    "llama4": ["*.feed_forward.router"],
}
_DEFAULT_ROUTER = ["*.mlp.gate"]
# DeepSeek's MLA: vLLM fuses q_a_proj and kv_a_proj_with_mqa into one linear (quantized
# together or not at all) and ships them in BF16 (the published FP8 checkpoints do the same)
_MODEL_TYPE_IGNORE = {
    "deepseek_v2": ["*.kv_a_proj_with_mqa", "*.q_a_proj"],
    "deepseek_v3": ["*.kv_a_proj_with_mqa", "*.q_a_proj"],
    "kimi_k2": ["*.kv_a_proj_with_mqa", "*.q_a_proj"],
}
# a multimodal model's towers and projector stay in high precision
_VISION_IGNORE = ["*visual*", "*vision_tower*", "*multi_modal_projector*"]
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


@dataclass
class Architecture:
    model_type: str
    layers: int
    hidden: int
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_layout: str = "none"  # fused | per-expert | unknown (no weights) | none (dense)
    has_weights: bool = False
    tied_embeddings: bool = False
    max_positions: int | None = None
    chat_template: bool = False
    ignore: list[str] = field(default_factory=list)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def describe(self) -> str:
        if not self.moe:
            return f"{self.model_type}: dense, {self.layers} layers, hidden {self.hidden}"
        shared = f", {self.shared_experts} shared" if self.shared_experts else ""
        return (
            f"{self.model_type}: MoE, {self.layers} layers, hidden {self.hidden}, "
            f"{self.experts} experts (top-{self.experts_per_token}{shared}), expert weights "
            f"{self.expert_layout}"
        )


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model part (its ``text_config``), else the config."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def tensor_names(model_dir: Path) -> list[str]:
    """The tensor names of a safetensors dir, from its index or the files' headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    names: list[str] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        names += [k for k in header if k != "__metadata__"]
    return names


def _expert_layout(names: list[str]) -> str:
    if not names:
        return "unknown (no weights)"
    if any(".experts.gate_up_proj" in n or n.endswith(".experts.w1") for n in names):
        return "fused"
    if any(".experts.0." in n for n in names):
        return "per-expert"
    return "unknown"


def ignore_list(model_type: str, moe: bool, multimodal: bool) -> list[str]:
    out = ["lm_head"]
    if moe:
        out += _ROUTERS.get(model_type, _DEFAULT_ROUTER)
    out += _MODEL_TYPE_IGNORE.get(model_type, [])
    if multimodal:
        out += _VISION_IGNORE
    return out


def detect(model_dir: str | Path) -> Architecture:
    """The architecture of ``model_dir`` (a dir with a config.json)."""
    d = Path(model_dir)
    try:
        raw = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"MODEL_DIR: {d / 'config.json'}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"MODEL_DIR: cannot read {d / 'config.json'}: {exc}") from None
    cfg = _text_config(raw)
    model_type = str(raw.get("model_type") or cfg.get("model_type") or "unknown")
    experts = next((int(cfg[k]) for k in _EXPERT_KEYS if cfg.get(k)), 0)
    try:
        names = tensor_names(d)
    except (OSError, ValueError, struct.error) as exc:
        raise UsageError(f"MODEL_DIR: cannot read the safetensors headers in {d}: {exc}") from None
    tok = d / "tokenizer_config.json"
    chat = (d / "chat_template.jinja").is_file() or (
        tok.is_file() and "chat_template" in json.loads(tok.read_text())
    )
    return Architecture(
        model_type=model_type,
        layers=int(cfg.get("num_hidden_layers", 0)),
        hidden=int(cfg.get("hidden_size", 0)),
        experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok", 0) or 0),
        shared_experts=int(cfg.get("n_shared_experts", 0) or 0),
        expert_layout=_expert_layout(names) if experts else "none",
        has_weights=bool(names),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=cfg.get("max_position_embeddings"),
        chat_template=chat,
        ignore=ignore_list(model_type, experts > 0, "vision_config" in raw),
    )
