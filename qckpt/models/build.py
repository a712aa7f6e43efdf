"""Building models: built-in tiny configs, or any local Hugging Face model dir.

No downloads ever: a built-in name gives a transformers config made here, a path gives the
``config.json`` (and, for ``load_weights=True``, the safetensors) found there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qckpt.errors import UsageError
from qckpt.models.remote_code import refuse_custom_code

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _tiny_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def _tiny_dense():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


BUILTIN = {"tiny-moe": _tiny_moe, "tiny-dense": _tiny_dense}


def load_config(source: str):
    """The transformers config of a built-in name or a local HF model dir."""
    if source in BUILTIN:
        return BUILTIN[source]()
    path = Path(source)
    if not (path / "config.json").is_file():
        known = ", ".join(BUILTIN)
        raise UsageError(
            f"model.source: {source!r} is neither a built-in model ({known}) "
            "nor a directory with a config.json"
        )
    refuse_custom_code(path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise UsageError(f"model.source: cannot read {path / 'config.json'}: {exc}") from None


def transformers_config(config: Any, model_type: str = "") -> Any:
    """A transformers config of ``config``: itself when it is one, else made from its dict (a
    config.json's content, as the calibration file records it; ``model_type`` when it names
    none)."""
    if not isinstance(config, dict):
        return config
    from transformers import AutoConfig

    d = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    return AutoConfig.for_model(config.get("model_type", model_type), **d)


def build_model(
    source: str,
    *,
    dtype: str | torch.dtype = "bfloat16",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """A causal LM with seeded random weights (the same on every rank for the same seed)."""
    cfg = load_config(source)  # first: it refuses a model dir with its own code
    from transformers import AutoModelForCausalLM

    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=torch_dtype, trust_remote_code=False
            )
    finally:
        torch.random.set_rng_state(gen_state)
    model.eval()
    return model


def model_type(model_or_config) -> str:
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "model_type", "")


def config_json(model: nn.Module) -> dict:
    return json.loads(model.config.to_json_string())


def materialize(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Allocate a model built on the meta device, for a checkpoint to fill.

    Parameters and persistent buffers get uninitialized memory (the load overwrites every one of
    them, and refuses a checkpoint that does not hold one); quantized parameters are allocated
    in their format with defined fields (``formats.empty``); non-persistent buffers, which no
    checkpoint holds (rotary ``inv_freq``), are rebuilt by constructing their module again from
    its config on the real device. Tied parameters stay tied (``to_empty`` alone would give each
    name its own tensor: a tied ``lm_head`` would then be left uninitialized).
    """
    device = torch.device(device)
    ties = _tied_params(model)
    model.to_empty(device=device)
    for slots in ties:
        first_mod, first_name = slots[0]
        shared = first_mod._parameters[first_name]
        for mod, name in slots[1:]:
            mod._parameters[name] = shared
    for name, mod in list(model.named_modules()):
        transient = getattr(mod, "_non_persistent_buffers_set", set())
        if not transient:
            continue
        cfg = getattr(mod, "config", None)
        if cfg is None:
            raise UsageError(
                f"{name}: cannot rebuild its non-persistent buffers {sorted(transient)}"
            )
        with torch.device(device):
            fresh = type(mod)(cfg)
        for b in transient:
            getattr(mod, b).copy_(getattr(fresh, b))
    return model


def _tied_params(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter held under more than one (module, name) slot: its slots, in order."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, name))
    return [s for s in slots.values() if len(s) > 1]
