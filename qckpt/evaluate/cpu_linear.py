"""BF16 / FP16 linears on the CPU computed in float32, their outputs rounded once to the dtype.

A CPU without BF16 matrix instructions (AVX512-BF16, AMX) runs a BF16 GEMM several times slower
than a float32 one: on a 2-core EPYC, the shared Llama's 64 windows took 139 s in BF16 and 28 s
this way. The values are those of a GPU's BF16 GEMM (exact BF16 products, float32 accumulation,
one rounding of the output), up to the order of the sums. The source and the export go through
the same mode, so a figure's ratio compares like with like.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_HALF = (torch.bfloat16, torch.float16)


def _plain_half_cpu(t: Any) -> bool:
    # a tensor subclass (a quantized weight) keeps its own op handlers
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.dtype in _HALF
        and t.device.type == "cpu"
    )


class _Float32Linears(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if _plain_half_cpu(x) and _plain_half_cpu(w) and x.dtype == w.dtype:
                out = F.linear(x.float(), w.float(), None if b is None else b.float())
                return out.to(x.dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def half_linears_in_float32(device: torch.device) -> Iterator[None]:
    """Inside the block, on a CPU device, BF16 / FP16 ``F.linear`` runs in float32 (module doc);
    on any other device nothing changes."""
    if device.type != "cpu":
        yield
        return
    with _Float32Linears():
        yield
