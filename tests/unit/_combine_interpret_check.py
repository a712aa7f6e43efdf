"""Run by test_calib_overhead.py under TRITON_INTERPRET=1: the MoE combine's Triton kernel,
executed by Triton's CPU interpreter, against the torch loop, bit for bit (NaN as NaN).

Prints one JSON object: per dtype, the number of output elements that differ.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

import torch  # noqa: E402

from qckpt.calib.moe_combine import torch_combine, triton_combine  # noqa: E402

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def data(dtype: torch.dtype, t: int, k: int, h: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(t * k + 3, h, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-30, 30, x.shape, generator=g).double())
    x = x.to(dtype)
    tiny = torch.finfo(dtype).tiny
    x[0, :8] = torch.tensor([-0.0, 0.0, tiny / 4, -tiny / 8, float("inf"), float("nan"), 1, -1])
    x[1, :4] = torch.tensor([-0.0, -tiny / 4, float("-inf"), torch.finfo(dtype).max])
    x[2, :4] = torch.tensor([-0.0, tiny / 2, 1.0, torch.finfo(dtype).max])
    return x


def main() -> None:
    g = torch.Generator().manual_seed(0)
    res = {}
    for dtype in INT:
        for t, k, h in ((5, 4, 40), (3, 8, 1500), (2, 1, 9)):
            out = data(dtype, t, k, h, g)
            rows = torch.randperm(out.shape[0], generator=g)[: t * k]
            rows[:2] = torch.tensor([0, 1])  # token 0 adds the -0 / subnormal / inf rows
            a, b = torch_combine(out, rows, k), triton_combine(out, rows, k)
            same = (a.view(INT[dtype]) == b.view(INT[dtype])) | (a.isnan() & b.isnan())
            res[f"{dtype}-{t}x{k}x{h}"] = int((~same).sum())
    print(json.dumps(res))


main()
