"""What every export layout is: its tensors' specs, its quantize, its config; and the shared math.

:class:`ExportLayout` is the interface of one recipe's layout (each family's module implements
it: :mod:`qckpt.layouts.compressed_tensors`, :mod:`qckpt.layouts.modelopt`); every shape is
known before any tensor is read (:class:`OutSpec`). The FP8 quantize with a given scale
(:func:`fp8_quantize`, and :func:`fp8_quantize_stack` for the export's bulk path) lives here
because compressed-tensors stores its scales in the model dtype and quantizes with the rounded
scale, which :mod:`qckpt.formats` (a float32 scale from the amax) has no option for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qckpt.errors import ExportError
from qckpt.formats.numerics import div_f32, f64_const
from qckpt.formats.scheme import FP8_MAX, scheme_of
from qckpt.layouts.source_layout import FP8
from qckpt.recipe import QuantConfig

# rows are quantized in chunks of about this many elements, so the float32 temporaries of the
# quantize math stay small next to the tensor itself (peak memory ~ the largest tensor)
CHUNK_ELEMS = 1 << 22


# a zero amax (an all-zero weight, an input never seen non-zero) would give a zero scale, and
# clients divide by the scale: keep it positive, the quantized values are zero either way
MIN_AMAX = 1e-12


# a per-expert linear in checkpoint naming: {...}.experts.{e}.{proj}
EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)$")


@dataclass(frozen=True)
class OutSpec:
    """One tensor the export writes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BlockScales:
    """Where an export's NVFP4 block scales come from, as the calibration's algorithm says; a
    layout is built with it (nothing sets it on a layout afterwards)."""

    # searched per block (a calibration made with calibrate.algorithm mse:
    # :func:`qckpt.formats.nvfp4_search.nvfp4_mse_quantize`) instead of the max rule
    search: bool = False
    # module -> the E4M3 block scales to write (a gptq calibration's), or None: the rule above
    given: Callable[[str], torch.Tensor | None] | None = None
    # module -> the int8 zero points beside given asymmetric INT4 group scales (gptq's)
    given_zero_points: Callable[[str], torch.Tensor | None] | None = None
    # module -> the per-column weights the search weighs its squared errors with (an mse
    # calibration with mse_weighting hessian: the file's ``{module}.hessian_diag``), or None
    weights: Callable[[str], torch.Tensor | None] | None = None

    def weights_of(self, module: str, cols: int) -> torch.Tensor | None:
        """The search's column weights for ``module``'s ``cols`` columns (None: unweighted);
        a stored diagonal of another length or not finite: one line."""
        h = None if self.weights is None else self.weights(module)
        if h is not None and (h.numel() != cols or not bool(torch.isfinite(h).all())):
            raise ExportError(
                f"{module}.hessian_diag has {h.numel()} values for {cols} columns or is not finite"
            )
        return h

    def zero_points(self, module: str) -> torch.Tensor | None:
        """The given zero points of ``module`` (None: none given)."""
        f = self.given_zero_points
        return None if f is None else f(module)


class ExportLayout:
    """The export layout of one recipe; every shape is known before any tensor is read."""

    name: str = ""

    def nvfp4(self, w: torch.Tensor, amax: torch.Tensor, module: str = ""):
        """(packed codes, E4M3 block scales, float32 global scale) of ``w`` with global amax
        ``amax``, the block scales given or searched as :attr:`block_scales` says."""
        bs = self.block_scales
        given = None if bs.given is None else bs.given(module)
        if given is not None:
            from qckpt.formats.nvfp4_search import nvfp4_with_scales

            return nvfp4_with_scales(w, amax, given)
        if bs.search:
            from qckpt.formats.nvfp4_search import nvfp4_mse_quantize

            h = bs.weights_of(module, w.shape[-1])
            qdata, scale, gs, *_ = nvfp4_mse_quantize(w, amax, h)
            return qdata, scale, gs
        from qckpt.formats import quantize

        q = quantize(w, "nvfp4", amax=amax)
        return q.qdata, q.scale, q.global_scale

    def __init__(
        self,
        quant: QuantConfig,
        model_dtype: torch.dtype,
        block_scales: BlockScales | None = None,
    ) -> None:
        self.quant = quant
        self.model_dtype = model_dtype
        self.block_scales = block_scales or BlockScales()

    def quant_of(self, module: str) -> QuantConfig:
        """The one-scheme quant config ``module`` is written with."""
        return self.quant

    # -- planning -----------------------------------------------------------------------------
    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        raise NotImplementedError

    def needed_amax(self, module: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """Calibration keys a linear needs, with the amax shape each must have."""
        w = scheme_of(self.quant.weights, "weight")
        out = [(f"{module}.weight_amax", w.amax_shape("weight", shape))]
        if scheme_of(self.quant.inputs, "input").calibrates("input"):
            out.append((f"{module}.input_amax", ()))
        return out

    def kv_specs(self, attn: str) -> list[OutSpec]:
        raise NotImplementedError

    def guard_amax(self, module: str, amax: torch.Tensor) -> torch.Tensor:
        """The amax ``module``'s source weight must stay within (the export's guard): the
        calibrated one, unless this layout writes it under scales given with the weight."""
        return amax

    def stacks(self) -> bool:
        """Whether :meth:`quantize_stack` can quantize several linears of one shape at once."""
        return False

    def stacks_module(self, module: str) -> bool:
        """Whether ``module`` may go in a stack (:meth:`stacks` for the layout it is written in)."""
        return self.stacks()

    def stack_key(self, module: str) -> int:
        """Linears of one stack have one key (the scheme they are written with)."""
        return 0

    # -- writing ------------------------------------------------------------------------------
    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def kv_tensors(
        self, attn: str, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def quantize_stack(
        self, modules: list[str], w: torch.Tensor, amax: dict[str, torch.Tensor], chunk_elems: int
    ) -> list[torch.Tensor]:
        """:meth:`quantize_linear` of ``k`` linears of one shape (``w`` ``[k, rows, cols]``,
        ``modules`` their names) at once, where :meth:`stacks` says so: one tensor per output
        of :meth:`linear_specs`, in its order, each ``[k, *spec.shape]``; ``out[j][i]`` has the
        bytes ``quantize_linear(modules[i], w[i], amax)``'s ``j``-th output has. The quantized
        weights are on ``w``'s device, the scales on the host (made there from the amaxes)."""
        raise NotImplementedError

    def quantization_config(self, ignored: list[str]) -> dict:
        raise NotImplementedError

    def extra_files(self, ignored: list[str]) -> dict[str, dict]:
        return {}

    def ignore_entries(self, ignored: list[str], embeddings: list[str]) -> list[str]:
        """The config's ignore list from the ignored linears (and the model's embeddings)."""
        return sorted(ignored)

    def warnings(self, modules: list[str]) -> list[str]:
        """What the known clients cannot serve in this export (see docs/CLIENTS.md)."""
        return []

    def shard_metadata(self) -> dict[str, str]:
        raise NotImplementedError


def amax_scalar(a: torch.Tensor) -> torch.Tensor:
    return a.detach().to(torch.float32).reshape(()).clamp_min(MIN_AMAX)


def amax_over(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 ``amax / qmax``, correctly rounded on every device: CUDA torch turns a division
    by a Python number into a multiplication by its reciprocal, one ulp off for about half of
    all values (see ``qckpt.formats.numerics.div_f32``)."""
    return div_f32(amax.to(torch.float32), f64_const(qmax, amax.device))


def row_chunks(rows: int, cols: int, align: int = 1) -> Iterator[tuple[int, int]]:
    step = max(align, (CHUNK_ELEMS // max(cols, 1)) // align * align)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def fp8_quantize(
    w: torch.Tensor, scale: torch.Tensor, granularity: str, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``w / scale`` saturated to E4M3, chunk by chunk (scale: float32, tensor/channel/block).

    Each chunk is converted into one reused float32 buffer, divided and clamped in place, and
    converted into the output by the copy: no full-size temporaries. (A single mixed-dtype
    ``torch.div(bf16, f32, out=f32)`` would save a pass but runs ~3x slower on CPU.)
    """
    rows, cols = w.shape
    out = torch.empty((rows, cols), dtype=FP8, device=w.device)
    b0, b1 = block
    # on w's device: a CPU 0-d divisor would make CUDA torch multiply by its reciprocal instead
    # of dividing (one ulp off for many values), and the GPU result would differ from the CPU's;
    # non-blocking: a blocking copy waits for every kernel queued before it (a CPU source's
    # bytes are staged by the time the call returns)
    scale = scale.to(device=w.device, dtype=torch.float32, non_blocking=True)
    buf = torch.empty(0, dtype=torch.float32, device=w.device)
    for r0, r1 in row_chunks(rows, cols, b0 if granularity == "block" else 1):
        n = r1 - r0
        if buf.numel() < n * cols:
            buf = torch.empty(n * cols, dtype=torch.float32, device=w.device)
        x = buf[: n * cols].view(n, cols)
        x.copy_(w[r0:r1])
        if granularity == "tensor":
            x.div_(scale.reshape(()))
        elif granularity == "channel":
            x.div_(scale.reshape(-1, 1)[r0:r1])
        else:
            s = scale[r0 // b0 : math.ceil(r1 / b0)]
            if n % b0 == 0 and cols % b1 == 0:
                # whole blocks: broadcast each block's scale over a 4-D view, no expanded copy
                x.view(n // b0, b0, cols // b1, b1).div_(s.view(n // b0, 1, cols // b1, 1))
            else:  # a partial last block: expand the scales over the chunk
                x.div_(s.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :cols])
        x.clamp_(-FP8_MAX, FP8_MAX)
        out[r0:r1].copy_(x)
    return out


def fp8_quantize_stack(w: torch.Tensor, scale: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """:func:`fp8_quantize` of ``k`` weights at once: ``w`` ``[k, rows, cols]`` (any strides),
    ``scale`` float32 ``[k]`` (per tensor) or ``[k, rows]`` (per channel). The element-wise math
    is :func:`fp8_quantize`'s (float32 copy, true division by a tensor on ``w``'s device,
    clamp, cast), so each ``out[i]`` has the bytes of ``fp8_quantize(w[i], scale[i], ...)``;
    whole weights at a time, as many as fit in ``chunk_elems`` (at least one)."""
    k, rows, cols = w.shape
    out = torch.empty((k, rows, cols), dtype=FP8, device=w.device)
    s = scale.to(device=w.device, dtype=torch.float32, non_blocking=True).reshape(k, -1, 1)
    step = max(1, chunk_elems // max(rows * cols, 1))
    buf = torch.empty(min(k, step) * rows * cols, dtype=torch.float32, device=w.device)
    for i0 in range(0, k, step):
        i1 = min(k, i0 + step)
        x = buf[: (i1 - i0) * rows * cols].view(i1 - i0, rows, cols)
        x.copy_(w[i0:i1])
        x.div_(s[i0:i1])
        x.clamp_(-FP8_MAX, FP8_MAX)
        out[i0:i1].copy_(x)
    return out


def stack_f32(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[k, n]`` float32 of ``k`` host tensors of ``n`` elements each: one stack and one
    conversion (element-wise, so each row is its tensor's own conversion); tensors of one
    shape (the usual case: every amax of a stack alike) are stacked as they are."""
    k = len(tensors)
    if len({t.shape for t in tensors}) != 1:
        tensors = [t.reshape(-1) for t in tensors]
    return torch.stack(tensors).detach().reshape(k, -1).to(torch.float32)
