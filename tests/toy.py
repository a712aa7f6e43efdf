"""A small model for the load and planner tests: two linears, a norm, a fused-experts block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qckpt import formats
from qckpt.models.quantize_params import quantize_model_params
from tests._bits import bits

ALL_FORMATS = ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]


def fmt_param(name: str):
    return pytest.param(
        name,
        marks=pytest.mark.skipif(
            name not in formats.FORMATS, reason=f"format {name} not built yet"
        ),
    )


FMTS = [fmt_param(f) for f in ALL_FORMATS]


class Toy(nn.Module):
    """Two linears, a norm and a fused-experts block, with magnitudes that differ by rows and
    experts, so a per-slice scale would differ from the whole tensor's."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1 = nn.Linear(64, 96, bias=False, dtype=dtype)
        self.l2 = nn.Linear(96, 64, bias=True, dtype=dtype)
        self.norm = nn.LayerNorm(64, dtype=dtype)
        self.moe = nn.Module()
        self.moe.experts = nn.Module()
        self.moe.experts.gate_up_proj = nn.Parameter(torch.empty(4, 64, 32, dtype=dtype))
        self.moe.experts.down_proj = nn.Parameter(torch.empty(4, 32, 32, dtype=dtype))
        with torch.no_grad():
            for p in self.parameters():
                v = torch.randn(p.shape, generator=g)
                if p.dim() >= 2:
                    # row (or expert) blocks of very different magnitude
                    ramp = 4.0 ** torch.arange(p.shape[0], dtype=torch.float32) / 4.0 ** p.shape[0]
                    if p.dim() == 2:
                        ramp = 2.0 ** (torch.arange(p.shape[0]) // 16).float()
                    v = v * ramp.view(-1, *([1] * (p.dim() - 1)))
                p.copy_(v.to(dtype))


def toy_quantized(fmt: str, seed: int = 99) -> Toy:
    m = Toy(seed=seed)
    quantize_model_params(m, fmt)
    return m


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if formats.is_quantized(a) or formats.is_quantized(b):
        fa, fb = a.fields(), b.fields()
        return fa.keys() == fb.keys() and all(
            fa[k].shape == fb[k].shape and torch.equal(bits(fa[k]), bits(fb[k])) for k in fa
        )
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert sa.keys() == sb.keys()
    bad = [k for k in sa if not same_tensor(sa[k], sb[k])]
    assert not bad, f"differ: {bad}"
