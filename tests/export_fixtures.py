"""Shared fixtures for the export tests: a saved tiny model and a calibration file built here.

The calibration is computed in the test, independently of qckpt's calibrator: weight amax from
the weights (per tensor / channel / block), input amax from forward hooks over a few batches.
Routed experts see the MoE block's whole input here (every token, not only the routed ones), an
upper bound of each expert's own amax, as a layer-shared expert input amax is in practice.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from qckpt.calib.state_file import CalibrationState, model_fingerprint, save_calibration
from qckpt.export.writer import export_checkpoint
from qckpt.models.build import build_model
from qckpt.models.naming import hf_tensors
from qckpt.recipe import ExportConfig, QuantConfig, TensorQuantConfig

VOCAB = 256


def quant_config(
    weights: str = "tensor",
    inputs: str = "static",
    block=(128, 128),
    fmt: str = "fp8",
    kv: bool = False,
    group: int = 32,
) -> QuantConfig:
    """weights: tensor|channel|block; inputs: static (per-tensor) | token | group (of ``group``)."""
    w = TensorQuantConfig(format=fmt, granularity=weights, block_size=list(block))
    if inputs == "static":
        i = TensorQuantConfig(format=fmt, granularity="tensor", dynamic=False)
    elif inputs == "token":
        i = TensorQuantConfig(format=fmt, granularity="tensor", dynamic=True)
    else:
        i = TensorQuantConfig(format=fmt, granularity="block", block_size=[1, group], dynamic=True)
    return QuantConfig(weights=w, inputs=i, kv_cache=kv)


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    mt = model.config.model_type
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        out.update(dict(hf_tensors(name, t, mt)))
    return out


def _weight_amax(w: torch.Tensor, q: QuantConfig) -> torch.Tensor:
    w = w.float().abs()
    if q.weights.format == "nvfp4" or q.weights.granularity == "tensor":
        return w.amax()
    if q.weights.granularity == "channel":
        return w.amax(1)
    b0, b1 = q.weights.block_size[0], q.weights.block_size[-1]
    r, c = w.shape
    R, C = math.ceil(r / b0), math.ceil(c / b1)
    wp = torch.nn.functional.pad(w, (0, C * b1 - c, 0, R * b0 - r))
    return wp.reshape(R, b0, C, b1).amax((1, 3))


def calib_inputs(seed: int = 1, batches: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(batches)]


def make_calibration(model: torch.nn.Module, q: QuantConfig) -> CalibrationState:
    mt = model.config.model_type
    state = hf_state(model)
    amax: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dim() == 2 and ("proj" in module or module == "lm_head"):
            amax[f"{module}.weight_amax"] = _weight_amax(t, q)
    seen: dict[str, float] = {}

    def hook(name):
        def fn(mod, args, out):
            x = args[0] if args else None
            if x is not None:
                seen[f"{name}.input"] = max(
                    seen.get(f"{name}.input", 0.0), x.float().abs().max().item()
                )
            o = out[0] if isinstance(out, tuple) else out
            seen[f"{name}.output"] = max(
                seen.get(f"{name}.output", 0.0), o.float().abs().max().item()
            )

        return fn

    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or name.endswith(".mlp.experts"):
            handles.append(mod.register_forward_hook(hook(name)))
    down_in: dict[str, float] = {}
    experts = {n: m for n, m in model.named_modules() if n.endswith(".mlp.experts")}

    def expert_hook(name):
        def fn(mod, args, out):
            x = args[0].float()
            for e in range(mod.gate_up_proj.shape[0]):
                gu = x @ mod.gate_up_proj[e].float().T
                g_, u = gu.chunk(2, dim=-1)
                h = torch.nn.functional.silu(g_) * u
                key = f"{name}.{e}"
                down_in[key] = max(down_in.get(key, 0.0), h.abs().max().item())

        return fn

    for n, m in experts.items():
        handles.append(m.register_forward_hook(expert_hook(n)))
    with torch.no_grad():
        for ids in calib_inputs():
            model(ids)
    for h in handles:
        h.remove()
    for key, v in seen.items():
        module, _, kind = key.rpartition(".")
        if module.endswith(".mlp.experts"):
            if kind != "input":
                continue
            for e in range(experts[module].gate_up_proj.shape[0]):
                for p in ("gate_proj", "up_proj"):
                    amax[f"{module}.{e}.{p}.input_amax"] = torch.tensor(v)
                amax[f"{module}.{e}.down_proj.input_amax"] = torch.tensor(down_in[f"{module}.{e}"])
        elif kind == "input":
            amax[f"{module}.input_amax"] = torch.tensor(v)
        elif kind == "output" and module.endswith((".k_proj", ".v_proj")):
            amax[f"{module}.output_amax"] = torch.tensor(v)
    from dataclasses import asdict

    return CalibrationState(
        amax=amax,
        model_type=mt,
        model_fingerprint=model_fingerprint((n, tuple(t.shape)) for n, t in state.items()),
        quant=asdict(q),
    )


def saved_model(root: Path, source: str) -> tuple[torch.nn.Module, Path]:
    model = build_model(source, dtype="bfloat16", seed=0)
    d = root / f"{source}-hf"
    if not d.exists():
        model.save_pretrained(d)
    return model, d


def write_calibration(
    root: Path, model: torch.nn.Module, q: QuantConfig, name: str = "calib.safetensors"
) -> Path:
    return save_calibration(make_calibration(model, q), root / name)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[:, -1].float()


def run_export(
    model, src, cal, out, q, fmt="compressed-tensors", source_dir=None, options=None, **export_kw
):
    return export_checkpoint(
        source=src,
        calibration=cal,
        output=out,
        model_type=model.config.model_type,
        model_config=model.config,
        quant=q,
        export=ExportConfig(format=fmt, output=str(out), **export_kw),
        source_dir=source_dir,
        options=options,
    )


def tampered(root: Path, hf_dir: Path, name: str, fn) -> Path:  # noqa: ANN001
    """A copy of the HF dir ``hf_dir`` as ``root/name`` whose model.safetensors went through
    ``fn(state_dict)`` (a bad value planted for a guard to find)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = root / name
    shutil.copytree(hf_dir, bad)
    sd = load_file(str(bad / "model.safetensors"))
    fn(sd)
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad
