"""Run by test_triton_interpreter.py under TRITON_INTERPRET=1: every Triton kernel of
qckpt/formats/triton_kernels.py, executed by Triton's CPU interpreter, against the torch path.

Prints one JSON object: mismatch counts per case, and the kernels that failed to run.
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import torch  # noqa: E402

from qckpt.formats import KernelPolicy, kernel_policy, numerics, quantize, triton_kernels  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def case(x: torch.Tensor, fp8: torch.dtype, pow2: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    ref = quantize(x, "fp8", dtype=fp8, pow2_scale=pow2)
    a = triton_kernels.amax(x)
    out["amax"] = int(a.item() != x.float().abs().max().item())
    # the scale made in the kernel from the amax, and the codes
    q, s = torch.empty(x.shape, dtype=fp8), torch.full((1,), -1.0)
    triton_kernels.fp8_cast(x, q, amax=a, scale_out=s, pow2=pow2)
    out["fp8 codes"] = int((u8(q) != u8(ref.qdata)).sum())
    out["fp8 scale"] = int(s.view(torch.int32).item() != ref.scale.view(torch.int32).item())
    # a given scale, with the kernel's own amax for the NaN/Inf check
    q2 = torch.empty(x.shape, dtype=fp8)
    m = triton_kernels.fp8_cast(x, q2, scale=ref.scale, check=True)
    out["fp8 given scale"] = int((u8(q2) != u8(ref.qdata)).sum())
    out["fp8 check amax"] = int(m.item() != a.item())
    # a NaN / Inf amax: nothing written, scale untouched
    for bad in (float("nan"), float("inf")):
        q3, s3 = torch.zeros(x.shape, dtype=fp8), torch.full((1,), -1.0)
        triton_kernels.fp8_cast(x, q3, amax=torch.tensor(bad), scale_out=s3)
        out[f"{bad} guard"] = int((u8(q3) != 0).any()) + int(s3.item() != -1.0)
    if not pow2:
        refm = quantize(x, "mxfp8", dtype=fp8)
        x2 = x.reshape(-1, x.shape[-1])
        q4 = torch.empty(x2.shape, dtype=fp8)
        s4 = torch.empty(x2.shape[0], -(-x2.shape[1] // 32), dtype=torch.uint8)
        mm = triton_kernels.mx_quantize(x2, q4, s4, numerics.FP8_EMAX[fp8])
        out["mx codes"] = int((u8(q4) != u8(refm.qdata)).sum())
        out["mx scales"] = int((u8(s4) != u8(refm.scale)).sum())
        out["mx amax"] = int(mm.item() != a.item())
    return out


def main() -> None:
    g = torch.Generator().manual_seed(0)
    edge = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e-39, -448 * 3, 2.0**-130, 2.0**-149])
    results = {}
    # 37x33: masked tails; 64x256: the cast's unmasked path; scales: normal (fast paths),
    # 2**-100 (the exact paths: scale < 2**-60, tiny MX blocks), all-zero
    for shape in ((37, 33), (64, 256)):
        for sc in (1.0, 2.0**-100, 0.0):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(shape, generator=g) * sc
                if sc == 1.0:
                    x.view(-1)[: len(edge)] = edge
                x = x.to(dtype)
                for fp8 in (E4M3, E5M2):
                    for pow2 in (False, True):
                        key = f"{shape} {sc:g} {dtype} {fp8} pow2={pow2}"
                        results[key] = case(x, fp8, pow2)
    json.dump({"results": results, "failed": triton_kernels.failed}, sys.stdout)


if __name__ == "__main__":
    # the interpreter's own fp8 cast drops mantissa carries: the kernels' integer rounding
    with kernel_policy(KernelPolicy(soft_fp8_cast=True)):
        main()
