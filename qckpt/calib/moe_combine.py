"""The grouped experts forward's combine: each token's k expert outputs added in ascending
expert order, rounded after every addition, as the eager loop's ``index_add_`` calls add them.

A sum in float32 would round once and differ from the eager forward in the last bits, which
then reach every later layer's amaxes; so the additions stay k separate roundings. With torch
that is k ``add_`` kernels over ``[tokens, hidden]`` plus a gather of every row (a GPU forward
pays both in launches and memory traffic). On CUDA one Triton kernel does the same additions:
per token and column block it loads the k rows and adds them in order in float32, rounding to
the output dtype after each addition: what torch's ``add_`` computes for bfloat16/float16
(float opmath, one round-to-nearest-even) and float32, so the bits are the same
(tests/unit/test_calib_overhead.py runs the kernel in Triton's CPU interpreter). bfloat16 is
widened and rounded on its bits with integer operations (the interpreter's own bfloat16 cast
truncates), which is the hardware's rounding, so the interpreter checks the code the GPU runs. Other dtypes,
no Triton, ``KernelPolicy(triton=False)``, or a kernel that fails once: the torch loop.
"""

from __future__ import annotations

import warnings

import torch

from qckpt.kernel_policy import current_policy

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (no triton, or a broken one: the torch loop is used)
    triton = None
    tl = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
kernel_failed = False  # the kernel failed once in this process: the torch loop from then on


def combine(out: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """``final[t] = (((0 + out[rows[t, 0]]) + out[rows[t, 1]]) + ...)`` for ``rows`` [t * k]
    (token-major: each token's rows of ``out`` in the order they are added)."""
    global kernel_failed
    if (
        out.is_cuda
        and triton is not None
        and not kernel_failed
        and out.dtype in _DTYPES
        and current_policy().triton
    ):
        try:
            return triton_combine(out, rows, k)
        except Exception as exc:  # noqa: BLE001 - any failure: the torch loop, same bits
            kernel_failed = True
            warnings.warn(f"Triton MoE combine failed ({exc}); using torch", stacklevel=2)
    return torch_combine(out, rows, k)


def torch_combine(out: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    picked = out[rows.view(-1, k).t()]  # [k, t, hidden]: one gather for every addition
    final = out.new_zeros(picked.shape[1:])
    for row in picked.unbind(0):
        final.add_(row)
    return final


def triton_combine(out: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    t, h = rows.numel() // k, out.shape[1]
    out, rows = out.contiguous(), rows.contiguous()
    final = out.new_empty((t, h))
    if t and h:
        block = min(1024, triton.next_power_of_2(h))
        bf16 = out.dtype == torch.bfloat16
        _combine_kernel[(t, triton.cdiv(h, block))](
            out, rows, final, h, K=k, BLOCK=block, BF16=bf16
        )
    return final


if triton is not None:

    @triton.jit
    def _to_f32(x, BF16: tl.constexpr):
        if BF16:  # exact: a bfloat16's bits are the float32's top half
            bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            return (bits << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def _round(y, dtype: tl.constexpr, BF16: tl.constexpr):
        if BF16:  # round to nearest even on the bits (a NaN stays a NaN)
            bits = y.to(tl.int32, bitcast=True)
            lsb = (bits >> 16) & 1
            r = ((bits + 0x7FFF + lsb) >> 16) & 0xFFFF
            r = tl.where(y != y, 0x7FC0, r)
            return r.to(tl.int16).to(dtype, bitcast=True)
        return y.to(dtype)

    @triton.jit
    def _combine_kernel(
        out_ptr, rows_ptr, final_ptr, h, K: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr
    ):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < h
        dtype = final_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK,), dtype=tl.float32)  # +0, as torch's zeros
        for j in tl.static_range(K):
            row = tl.load(rows_ptr + t * K + j).to(tl.int64)
            x = tl.load(out_ptr + row * h + cols, mask=mask, other=0.0)
            # one addition in float32, rounded to the output dtype after it: torch's add_
            acc = _to_f32(_round(acc + _to_f32(x, BF16), dtype, BF16), BF16)
        tl.store(final_ptr + t * h + cols, _round(acc, dtype, BF16), mask=mask)
