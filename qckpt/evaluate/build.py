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

from qckpt.errors import CheckpointError, UsageError
from qckpt.evaluate.emulated import EmulatedLinear, emulated_experts_forward, register_kv_attention
from qckpt.evaluate.fused import GlobalScaleFetch, requantized
from qckpt.evaluate.scheme import ExportScheme
from qckpt.formats.act_quant import InputQuant
from qckpt.layouts.dequantize import dequantize, dequantize_into
from qckpt.models import naming
from qckpt.models.build import materialize
from qckpt.models.remote_code import refuse_custom_code
from qckpt.read.hf_reader import hf_source
from qckpt.storage.slices import SafetensorsFetch


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


def empty_meta(path: Path, dtype: torch.dtype) -> nn.Module:
    """The dir's model on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=False)
    return model.eval()


def _empty_model(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    model = empty_meta(path, dtype)
    materialize(model, device)
    return model


class DirTensors:
    """A model dir's tensors under the model's state-dict names (fused experts assembled,
    quantized weights dequantized in the model dtype), filled into a module or a part of it."""

    def __init__(self, path: Path, model: nn.Module) -> None:
        self.path = path
        expected = {k: v.shape for k, v in model.state_dict().items()}
        mtype = getattr(model.config, "model_type", "")
        self.layout, self.source, raw = hf_source(path, model_type=mtype, expected=expected)
        self.fetch = SafetensorsFetch(path, raw)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def fill(self, module: nn.Module, prefix: str = "") -> None:
        """Every tensor of ``module`` (named ``prefix + name`` in the model) from the dir."""
        with torch.no_grad():
            for name, dst in module.state_dict().items():
                self._fill_one(prefix + name, dst)

    def _fill_one(self, name: str, dst: torch.Tensor) -> None:
        entry = self.layout.get(name)
        if entry is None:
            if self.tied and name.endswith("lm_head.weight"):
                return
            raise CheckpointError(f"{self.path}: {name} is missing from the checkpoint")
        if tuple(entry.shape) != tuple(dst.shape):
            raise CheckpointError(
                f"{self.path}: {name} has shape {tuple(entry.shape)}, the model {tuple(dst.shape)}"
            )
        for piece in entry.pieces:
            at = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))
            region = dst[at][(0,) * piece.lead]
            if piece.quant is not None:
                dequantize_into(region, piece.quant, self.fetch)
            else:
                region.copy_(self.fetch(piece.key, None, None).reshape(region.shape))


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A model dir's model with its weights (a quantized dir: dequantized, as transformers'
    weight-only dequantization gives them)."""
    model = _empty_model(path, dtype, device)
    DirTensors(path, model).fill(model)
    return model


def _weight32(scheme: ExportScheme, fetch: SafetensorsFetch, name: str, like: torch.Tensor):
    """A linear's weight as the client holds it, float32 (fused shards as vLLM fuses them)."""
    w = scheme.weights.get(name)
    if w is None or scheme.weights_from_model:
        return like.detach().to(torch.float32), None
    module = name[: -len(".weight")]
    if module in scheme.requant:
        return requantized(w, fetch, scheme.requant[module]).to(like.device), w
    if module in scheme.nvfp4_global:
        fetch = GlobalScaleFetch(fetch, {w.global_scale: scheme.nvfp4_global[module]})
    return dequantize(w, fetch, torch.float32).to(like.device), w


def _emulate_linears(
    root: nn.Module, scheme: ExportScheme, fetch: SafetensorsFetch, prefix: str = ""
) -> int:
    count = 0
    for local, mod in list(root.named_modules()):
        name = prefix + local
        if not isinstance(mod, nn.Linear) or f"{name}.weight" not in scheme.weights:
            continue
        w32, _ = _weight32(scheme, fetch, f"{name}.weight", mod.weight)
        new = EmulatedLinear(w32, mod.bias, scheme.inputs.get(name, InputQuant("none")))
        parent_name, _, leaf = local.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, leaf, new)
        count += 1
    return count


def _emulate_experts(
    root: nn.Module, scheme: ExportScheme, fetch: SafetensorsFetch, mtype: str, prefix: str = ""
) -> int:
    count = 0
    for local, mod in list(root.named_modules()):
        name = prefix + local
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


def _apply_kv(root: nn.Module, scheme: ExportScheme, prefix: str = "") -> int:
    hit = 0
    for local, mod in root.named_modules():
        if prefix + local in scheme.kv:
            mod.qckpt_kv_scales = scheme.kv[prefix + local]
            hit += 1
    return hit


def emulate(
    root: nn.Module, scheme: ExportScheme, fetch: SafetensorsFetch, mtype: str, prefix: str = ""
) -> dict[str, int]:
    """Replace the quantized linears / experts of ``root`` (named ``prefix + name`` in the
    model) by emulating ones and attach its KV-cache scales; what was emulated, counted."""
    return {
        "linears": _emulate_linears(root, scheme, fetch, prefix),
        "experts": _emulate_experts(root, scheme, fetch, mtype, prefix),
        "kv_cache_layers": _apply_kv(root, scheme, prefix),
    }


def use_kv_attention(model: nn.Module, scheme: ExportScheme) -> None:
    """The model's attention through the FP8 KV cache where the export has KV scales."""
    if scheme.kv:
        model.set_attn_implementation(register_kv_attention())


def load_emulated(
    scheme: ExportScheme, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, dict[str, int]]:
    """The export's model as a serving stack computes it; with counts of what was emulated."""
    model = _empty_model(scheme.path, dtype, device)
    tensors = DirTensors(scheme.path, model)
    tensors.fill(model)
    counts = emulate(model, scheme, tensors.fetch, getattr(model.config, "model_type", ""))
    use_kv_attention(model, scheme)
    tensors.fetch.close()
    if counts["linears"] + counts["experts"] == 0:
        raise CheckpointError(f"{scheme.path}: no quantized linear of the export is in the model")
    return model, counts
