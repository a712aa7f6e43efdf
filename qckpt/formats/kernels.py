"""Which kernels a quantize runs: compiled or eager torch, or the hand-written Triton ones.

Every choice gives the same bits; the choice is the :class:`~qckpt.kernel_policy.KernelPolicy`
in scope (only the CLI reads the environment). On CUDA a compiled (fused) chunk kernel reads the
input once and writes codes and scales once (``run_kernel`` / ``run_block_kernel``; any compile
failure falls back to eager for good, with one warning, and is remembered in
``compile_failed``); ``use_triton`` says whether a Triton kernel of :mod:`triton_kernels
<qckpt.formats.triton_kernels>` takes a tensor (contiguous bfloat16 / float32 on CUDA), and
``tensor_amax`` is the per-tensor amax through whichever applies. The numbers themselves are
:mod:`qckpt.formats.numerics`'.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from qckpt.formats import numerics
from qckpt.kernel_policy import current_policy

# Chunk size for the compiled (fused) kernels: their FP32 math stays in registers, so bigger
# chunks cost little memory and pay the per-call Python/guard/launch overhead fewer times. Measured
# on an H200 (docs/BENCHMARKS.md): 1 << 28 doubled mxfp8's throughput but quadrupled nvfp4's
# compiled temporaries (80 -> 320 MiB on a 512 MiB input) and did not help fp8; we keep 1 << 26.
CHUNK_ELEMS_COMPILED: int = 1 << 26


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Chunked per-tensor amax (float32 scalar); the Triton kernel where it applies (exact
    either way: a max does not round)."""
    if use_triton(x, "amax"):
        from qckpt.formats import triton_kernels

        a = triton_kernels.amax(x)
        if a is not None:
            return a
    flat = numerics.flat_view(x)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    # the inf-norm reduction makes no temporaries on CUDA: there the larger chunk saves calls
    ce = max(numerics.CHUNK_ELEMS, CHUNK_ELEMS_COMPILED) if x.is_cuda else numerics.CHUNK_ELEMS
    for s, e in numerics.chunk_ranges(flat.numel(), ce):
        amax = torch.maximum(amax, numerics.abs_amax(flat[s:e]))
    return amax


# ---- optional torch.compile of the per-chunk kernels -------------------------------------------
# Eager torch runs each chunk as several kernels with FP32 temporaries; on CUDA a compiled
# (fused) chunk kernel reads the input once and writes codes and scales once. Whether to compile
# is the KernelPolicy's (qckpt/kernel_policy.py); any compile failure falls back to eager for
# good, with one warning.
_compiled: dict[Callable, Callable] = {}


compile_failed: set[Callable] = set()


def run_block_kernel(
    into: Callable,
    compute: Callable,
    padded: bool,
    x: torch.Tensor,
    outs: tuple[torch.Tensor, ...],
    args: tuple,
    compute_extra: tuple = (),
) -> torch.Tensor:
    """Quantize one chunk of a block format into ``outs``; returns the chunk's amax.

    Without padding, ``into(x, *outs, *args)`` writes the outputs inside the (compiled) kernel.
    With a partial last block, ``compute(x, *args, *compute_extra)`` returns the outputs and
    they are copied here: torch 2.13's inductor miscompiles a padded, re-viewed and sliced
    result written into a kernel argument (found by tests/unit/test_formats_compile.py).
    """
    if not padded:
        return run_kernel(into, x, *outs, *args)
    res = run_kernel(compute, x, *args, *compute_extra)
    for o, r in zip(outs, res[:-1], strict=True):
        o.copy_(r)
    return res[-1]


def compile_options() -> dict[str, Any]:
    """Inductor options that keep compiled kernels bit-exact with eager torch: Triton's ``/``
    is an approximate division by default (codes at FP8 rounding ties would differ) and
    subnormal inputs may be flushed to zero. The option names moved between torch versions."""
    from torch._inductor import config as ic

    opts: dict[str, Any] = {}
    en = getattr(ic, "eager_numerics", None)
    if en is not None and hasattr(en, "division_rounding"):
        opts["eager_numerics.division_rounding"] = True
        if hasattr(en, "disable_ftz"):
            opts["eager_numerics.disable_ftz"] = True
    elif hasattr(ic, "emulate_divison_rounding"):
        opts["emulate_divison_rounding"] = True
    return opts


def quant_chunk(device: torch.device, kernel: Callable) -> int:
    """Chunk size (elements) for quantizing with ``kernel`` on ``device``: the compiled size
    where the kernel will run compiled, else ``numerics.CHUNK_ELEMS``. (If compiling fails on
    its first chunk, that one chunk runs eager at the compiled size; later calls use
    ``numerics.CHUNK_ELEMS``.)"""
    if _want_compile(device) and kernel not in compile_failed:
        return max(numerics.CHUNK_ELEMS, CHUNK_ELEMS_COMPILED)
    return numerics.CHUNK_ELEMS


def _want_compile(device: torch.device) -> bool:
    return current_policy().compiles(device)


def run_kernel(fn: Callable, x: torch.Tensor, *args: Any) -> Any:
    """Run the chunk kernel ``fn(x, *args)``, compiled where wanted and working."""
    if _want_compile(x.device) and fn not in compile_failed:
        c = _compiled.get(fn)
        if c is None:
            c = _compiled[fn] = torch.compile(fn, dynamic=None, options=compile_options())
        try:
            return c(x, *args)
        except Exception as e:  # noqa: BLE001  (any inductor/triton failure -> eager)
            compile_failed.add(fn)
            warnings.warn(
                f"qckpt.formats: torch.compile of {fn.__name__} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); using eager torch",
                stacklevel=2,
            )
    return fn(x, *args)


# ---- optional hand-written Triton kernels (qckpt/formats/triton_kernels.py) ------------------
# On by default on CUDA where triton imports (KernelPolicy.triton). Bit-identical to the torch
# path (tests/gpu/test_formats_triton.py); used for contiguous bfloat16/float32 input only.
TRITON_DTYPES = (torch.bfloat16, torch.float32)


def use_triton(x: torch.Tensor, kind: str, *outs: torch.Tensor) -> bool:
    """Whether the Triton ``kind`` kernel ("amax", "fp8", "mxfp8") takes ``x`` -> ``outs``."""
    if not (
        x.is_cuda and current_policy().triton and x.dtype in TRITON_DTYPES and x.is_contiguous()
    ):
        return False
    # plain tensors only (a subclass, e.g. a DTensor, may not be its own storage)
    if type(x) is not torch.Tensor or not all(
        type(o) is torch.Tensor and o.is_cuda and o.is_contiguous() for o in outs
    ):
        return False
    from qckpt.formats import triton_kernels  # imports triton: only ever on CUDA

    return triton_kernels.usable(kind)
