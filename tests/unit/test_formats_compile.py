"""The torch.compile'd chunk kernels give the same bits as eager (CPU inductor).

Opt-in (inductor's first CPU compile takes tens of seconds per kernel):
    QCKPT_TEST_COMPILE=1 pytest -q tests/unit/test_formats_compile.py
On CUDA the same comparison runs in tests/gpu/test_formats_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from qckpt.formats import KernelPolicy, kernels, quantize
from tests._bits import bits

pytestmark = pytest.mark.skipif(
    os.environ.get("QCKPT_TEST_COMPILE") != "1", reason="set QCKPT_TEST_COMPILE=1"
)

CASES = [
    ("fp8", {}),
    ("fp8", {"granularity": "channel", "pow2_scale": True}),
    ("fp8", {"amax": 1.0}),
    ("fp8_delayed", {}),
    ("mxfp8", {}),
    ("mxfp8", {"scale_rounding": "rceil", "dtype": torch.float8_e5m2}),
    ("fp8_block", {}),
    ("fp8_block", {"block_size": (1, 32)}),
    ("nvfp4", {}),
    ("nvfp4", {"amax": 2.0}),
]


@pytest.mark.parametrize("cols", [100, 128])  # partial last block (padded) / whole blocks
@pytest.mark.parametrize("fmt,opts", CASES)
def test_compiled_equals_eager(fmt: str, opts: dict, cols: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, cols, generator=g) * torch.logspace(-3, 3, 64).view(-1, 1)).to(
        torch.bfloat16
    )
    ref = quantize(x, fmt, policy=KernelPolicy(compile="never"), **opts)
    q = quantize(x, fmt, policy=KernelPolicy(compile="always"), **opts)
    assert not kernels.compile_failed
    for k in q.spec.tensor_fields:
        assert torch.equal(bits(getattr(q, k)), bits(getattr(ref, k))), k
