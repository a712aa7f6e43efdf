"""Models for ``qckpt eval``: a BF16 source dir as transformers builds it, and an export dir as a
serving stack runs it (every quantized linear an :class:`EmulatedLinear`, fused MoE experts with
an emulating forward, FP8 KV-cache scales applied).

The architecture comes from the dir's ``config.json`` through transformers (no remote code: a
dir that ships its own Python is refused); the ``quantization_config`` is dropped from the
config, so transformers builds plain modules that this module fills from the files itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from qckpt.checkpoint.hf_reader import hf_source
from qckpt.checkpoint.quantized_sources import SafetensorsFetch, dequantize, dequantize_into
from qckpt.errors import CheckpointError, UsageError
from qckpt.evaluate.act_quant import InputQuant
from qckpt.evaluate.emulated import EmulatedLinear, emulated_experts_forward, register_kv_attention
from qckpt.evaluate.scheme import ExportScheme
from qckpt.models import naming
from qckpt.models.build import materialize
from qckpt.models.remote_code import refuse_custom_code


def model_config(path: Path) -> Any:
    """The transformers config of a model dir, its quantization_config removed."""
    if not (path / "config.json").is_file():
        raise UsageError(f"{path}: no config.json (not a Hugging Face model dir)")
    refuse_custom_code(path, what=str(path))
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise CheckpointError(f"{path}: cannot read config.json: {exc}") from None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def _empty_model(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = model_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=False)
    materialize(model, device)
    return model.eval()


def _fill(model: nn.Module, path: Path, mtype: str) -> tuple[Any, SafetensorsFetch]:
    """Every state-dict tensor from the dir (quantized weights dequantized in the model dtype)."""
    sd = model.state_dict()
    expected = {k: v.shape for k, v in sd.items()}
    layout, source, raw = hf_source(path, model_type=mtype, expected=expected)
    fetch = SafetensorsFetch(path, raw)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        for name, dst in sd.items():
            entry = layout.get(name)
            if entry is None:
                if tied and name.endswith("lm_head.weight"):
                    continue
                raise CheckpointError(f"{path}: {name} is missing from the checkpoint")
            if tuple(entry.shape) != tuple(dst.shape):
                raise CheckpointError(
                    f"{path}: {name} has shape {tuple(entry.shape)}, the model {tuple(dst.shape)}"
                )
            for piece in entry.pieces:
                at = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))
                region = dst[at][(0,) * piece.lead]
                if piece.quant is not None:
                    dequantize_into(region, piece.quant, fetch)
                else:
                    region.copy_(fetch(piece.key, None, None).reshape(region.shape))
    return source, fetch


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A model dir's model with its weights (a quantized dir: dequantized, as transformers'
    weight-only dequantization gives them)."""
    model = _empty_model(path, dtype, device)
    _fill(model, path, getattr(model.config, "model_type", ""))
    return model


def _weight32(scheme: ExportScheme, fetch: SafetensorsFetch, name: str, like: torch.Tensor):
    w = scheme.weights.get(name)
    if w is None:
        return like.detach().to(torch.float32), None
    return dequantize(w, fetch, torch.float32).to(like.device), w


def _emulate_linears(model: nn.Module, scheme: ExportScheme, fetch: SafetensorsFetch) -> int:
    count = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or f"{name}.weight" not in scheme.weights:
            continue
        w32, _ = _weight32(scheme, fetch, f"{name}.weight", mod.weight)
        new = EmulatedLinear(w32, mod.bias, scheme.inputs.get(name, InputQuant("none")))
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
        count += 1
    return count


def _emulate_experts(model: nn.Module, scheme: ExportScheme, fetch: SafetensorsFetch) -> int:
    mtype = getattr(model.config, "model_type", "")
    count = 0
    for name, mod in list(model.named_modules()):
        if not naming.is_fused_experts(mod):
            continue
        slices = naming.expert_slices(name, mtype, mod.gate_up_proj.shape, mod.down_proj.shape)
        if not any(f"{s.hf_module}.weight" in scheme.weights for s in slices):
            continue
        w13 = torch.empty(
            mod.gate_up_proj.shape, dtype=torch.float32, device=mod.gate_up_proj.device
        )
        w2 = torch.empty(mod.down_proj.shape, dtype=torch.float32, device=mod.down_proj.device)
        num = w13.shape[0]
        in13: list[InputQuant] = [InputQuant("none")] * num
        in2: list[InputQuant] = [InputQuant("none")] * num
        for s in slices:
            fused = mod.gate_up_proj if s.param_name.endswith("gate_up_proj") else mod.down_proj
            dst = w13 if fused is mod.gate_up_proj else w2
            w32, _ = _weight32(scheme, fetch, f"{s.hf_module}.weight", s.take(fused))
            s.take(dst).copy_(w32)
            q = scheme.inputs.get(s.hf_module, InputQuant("none"))
            (in2 if s.role == "down" else in13)[s.expert] = q
        mod.forward = emulated_experts_forward(mod, w13, w2, in13, in2)
        # the fused BF16 parameters are no longer read: free them
        mod.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        mod.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        count += num
    return count


def _apply_kv(model: nn.Module, scheme: ExportScheme) -> int:
    if not scheme.kv:
        return 0
    hit = 0
    for name, mod in model.named_modules():
        if name in scheme.kv:
            mod.qckpt_kv_scales = scheme.kv[name]
            hit += 1
    if hit:
        model.set_attn_implementation(register_kv_attention())
    return hit


def load_emulated(
    scheme: ExportScheme, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, dict[str, int]]:
    """The export's model as a serving stack computes it; with counts of what was emulated."""
    model = _empty_model(scheme.path, dtype, device)
    _, fetch = _fill(model, scheme.path, getattr(model.config, "model_type", ""))
    counts = {
        "linears": _emulate_linears(model, scheme, fetch),
        "experts": _emulate_experts(model, scheme, fetch),
        "kv_cache_layers": _apply_kv(model, scheme),
    }
    fetch.close()
    if counts["linears"] + counts["experts"] == 0:
        raise CheckpointError(f"{scheme.path}: no quantized linear of the export is in the model")
    return model, counts
