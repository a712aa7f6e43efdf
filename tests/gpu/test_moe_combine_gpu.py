"""The grouped MoE forward's Triton combine on CUDA against the torch loop, bit for bit.

    CUDA_VISIBLE_DEVICES=0 pytest -q tests/gpu/test_moe_combine_gpu.py     # skipped without CUDA

The CPU suite runs the same kernel in Triton's interpreter (tests/unit/test_calib_overhead.py);
here the compiled kernel (hardware float32 adds, the integer bf16 rounding) meets torch's add_.
"""

from __future__ import annotations

import pytest
import torch

from qckpt.calib import moe_combine
from qckpt.calib.instrument import insert_quantizers, remove_quantizers, settle
from qckpt.kernel_policy import KernelPolicy, kernel_policy
from qckpt.models.build import build_model
from qckpt.recipe import QuantConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or moe_combine.triton is None, reason="needs CUDA and triton"
)
INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.mark.parametrize("dtype", list(INT))
@pytest.mark.parametrize(("t", "k", "h"), [(2048, 8, 2048), (37, 4, 1000), (3, 1, 9)])
def test_kernel_equals_the_torch_loop(dtype, t, k, h):
    g = torch.Generator(device="cuda").manual_seed(t + k + h)
    x = torch.randn(t * k, h, generator=g, device="cuda", dtype=torch.float32)
    x *= torch.exp2(torch.randint(-40, 40, x.shape, generator=g, device="cuda").float())
    out = x.to(dtype)
    tiny = torch.finfo(dtype).tiny
    edge = [-0.0, 0.0, tiny / 4, -tiny / 8, float("inf"), float("nan"), 1, torch.finfo(dtype).max]
    out[0, : len(edge)] = torch.tensor(edge, device="cuda")
    rows = torch.randperm(t * k, generator=g, device="cuda")
    rows[0] = 0
    a = moe_combine.torch_combine(out, rows, k)
    b = moe_combine.triton_combine(out, rows, k)
    same = (a.view(INT[dtype]) == b.view(INT[dtype])) | (a.isnan() & b.isnan())
    assert bool(same.all()), int((~same).sum())


def test_grouped_forward_amaxes_equal_with_and_without_the_kernel():
    model = build_model("tiny-moe", dtype="bfloat16").cuda()
    batch = torch.randint(0, 256, (4, 64), device="cuda")
    amax = {}
    for triton_on in (True, False):
        qs = insert_quantizers(model, QuantConfig(), moe_forward="grouped")
        with kernel_policy(KernelPolicy(triton=triton_on)), torch.no_grad():
            logits = model(input_ids=batch, use_cache=False).logits
        settle(model)
        amax[triton_on] = {k: q.amax for k, q in qs.items() if q.amax is not None}
        amax[triton_on]["logits"] = logits
        remove_quantizers(model)
    assert not moe_combine.kernel_failed
    assert amax[True].keys() == amax[False].keys()
    assert all(torch.equal(amax[True][k], amax[False][k]) for k in amax[True])
