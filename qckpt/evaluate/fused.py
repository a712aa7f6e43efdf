"""What vLLM does at load to linears it fuses into one weight (q/k/v, gate/up, and each MoE
expert's gate/up): one per-tensor scale for the fused weight, whatever the files hold.

* FP8 per-tensor weights (compressed-tensors and ModelOpt): ``requantize_with_max_scale``: each
  shard dequantized in float16 (``code.to(float16) * scale``, on the GPU: the scale rounded to
  float16 too), then quantized again with the group's largest scale (``e4m3(x * (1 / s_max))``).
  Static input scales: the group's max.
* NVFP4: no requantization: the shards' global scales are collapsed to one, ``max()`` of the
  stored ``weight_global_scale`` (compressed-tensors) or ``weight_scale_2`` (ModelOpt) for a
  dense fused linear, the first shard's (gate's) for a MoE expert's gate/up. A shard whose
  stored global scale differs is then computed off by the ratio: the report warns.
* per-channel and block scales stay per row / block: nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch

from qckpt.formats.scheme import FP8_MAX
from qckpt.layouts.source_layout import QuantWeight
from qckpt.models.fused import FUSED_GROUPS

FP8 = torch.float8_e4m3fn


def fused_groups(weights: dict[str, QuantWeight]) -> list[list[str]]:
    """The module names (two or more, in fused order) of each group vLLM fuses."""
    by_parent: dict[str, set[str]] = {}
    for name in weights:
        parent, _, leaf = name[: -len(".weight")].rpartition(".")
        by_parent.setdefault(parent, set()).add(leaf)
    out = []
    for parent, leaves in by_parent.items():
        for group in FUSED_GROUPS:
            members = [f"{parent}.{g}" for g in group if g in leaves]
            if len(members) > 1:
                out.append(members)
    return out


def _scalar(fetch: Any, key: str) -> torch.Tensor:
    return fetch(key, None, None).to(torch.float32).reshape(())


def plan_fused(weights: dict[str, QuantWeight], fetch: Any) -> tuple[dict, dict, list[str]]:
    """(fp8 module -> the scale it is requantized to, nvfp4 module -> the global scale it is
    computed with where that is not its own, warnings) for the export's fused groups."""
    requant: dict[str, torch.Tensor] = {}
    nvfp4: dict[str, torch.Tensor] = {}
    worst, groups = 1.0, 0
    for members in fused_groups(weights):
        ws = [weights[f"{m}.weight"] for m in members]
        # QuantWeight.scheme is a Scheme: FP8 per tensor stacks with one scale per shard
        if all(w.scheme.stacks() and w.granularity == "tensor" for w in ws):
            scales = [_scalar(fetch, w.scale) for w in ws]
            smax = torch.stack(scales).max()
            requant.update({m: smax for m, s in zip(members, scales, strict=True) if s != smax})
        elif all(w.scheme.packed_fp4 for w in ws):
            gs = [_scalar(fetch, w.global_scale) for w in ws]
            used = gs[0] if ".experts." in members[0] else torch.stack(gs).max()
            for m, g in zip(members, gs, strict=True):
                if g != used:
                    nvfp4[m] = used
                    worst = max(worst, float(max(g / used, used / g)))
            groups += any(g != used for g in gs)
    notes = []
    if groups:
        notes.append(
            f"{groups} fused group(s) (q/k/v, gate/up) hold different NVFP4 global scales; vLLM "
            f"computes each group with one of them, so shards are off by up to {worst:.2f}x: "
            "export one global scale per fused group"
        )
    return requant, nvfp4, notes


def requantized(w: QuantWeight, fetch: Any, smax: torch.Tensor) -> torch.Tensor:
    """An FP8 per-tensor shard as vLLM holds it after ``requantize_with_max_scale``, float32."""
    codes = fetch(w.codes, None, None)
    # vLLM's per_tensor_dequantize: code.to(float16) * scale, the scale a 0-dim CUDA tensor,
    # so the product is computed in float16 with the scale rounded to float16 as well
    dq = codes.to(torch.float16) * _scalar(fetch, w.scale).to(torch.float16)
    inv = torch.ones((), dtype=torch.float32) / smax
    q = (dq.to(torch.float32) * inv).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.to(torch.float32) * smax


class GlobalScaleFetch:
    """A fetch that serves replaced NVFP4 global scales and everything else from ``fetch``."""

    def __init__(self, fetch: Any, replaced: dict[str, torch.Tensor]) -> None:
        self.fetch, self.replaced = fetch, replaced

    def __call__(self, key: str, rows: Any, cols: Any) -> torch.Tensor:
        if key in self.replaced:
            return self.replaced[key].reshape(1)
        return self.fetch(key, rows, cols)
