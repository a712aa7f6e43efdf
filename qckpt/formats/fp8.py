"""FP8 with a float scale: ``fp8`` (current scaling) and ``fp8_delayed`` (amax history).

Layout
------
``qdata``: float8_e4m3fn (default) or float8_e5m2, the nominal shape, contiguous.
``scale``: float32, the dequantization multiplier (``x ~= qdata.float() * scale``):

* ``granularity="tensor"``: shape ``()``.
* ``granularity="channel"``: one scale per output row (axis 0), shape ``(rows, 1, ..., 1)``
  so that it broadcasts against ``qdata`` (a 2-D weight's scale is ``(out, 1)``, the
  compressed-tensors channel layout). A 0-d input has one channel.

Scale rule: ``scale = amax / fp8_max`` (448 for E4M3, 57344 for E5M2), the correctly rounded
float32 quotient with the same bits on CPU and CUDA, eager or compiled: it is computed in float64
and rounded once, because CUDA torch would multiply by ``fl32(1/448)`` instead, one ulp off for
about half of all amaxes (``numerics.div_f32``). ``amax=`` replaces the computed amax; values
beyond it saturate. An all-zero tensor (or row) gets ``scale = 1.0`` and zero codes; a non-zero
amax never yields a scale below float32's smallest normal. Codes are ``clamp(x / scale, -fp8_max, fp8_max)`` rounded to nearest-even by
the cast, so values beyond the range *saturate* to +-fp8_max (never Inf/NaN); results below the
FP8 normal range become FP8 subnormals, and below half the smallest subnormal, zero.

``pow2_scale=True`` uses the OCP MX shared-exponent rule instead:
``scale = 2**(floor(log2(amax)) - emax)`` with emax = 8 (E4M3) / 15 (E5M2), clamped to
``[2**-126, 2**127]`` (an all-zero tensor/row: 1.0). Then ``amax / scale`` lies in ``[256, 512)`` (E4M3): the top of that range
above 448 saturates to 448, at most 12.5% error for the largest elements. The rounding-up rule
(``2**ceil(log2(amax / fp8_max))``) would avoid that saturation but is *not* idempotent: an amax
that rounds to code 224 re-quantizes with half the scale. With the floor rule
``quantize(dequantize(q)) == q`` bit for bit, through bfloat16 as well (every code times a power
of two is exact in bfloat16 unless it falls below bfloat16's smallest subnormal, 2**-133: only
for tensors/rows with amax < 2**-116).

Round trips with the default (non power-of-two) scale: through float32 the *codes* come back
identical, but the recomputed scale ``fl(fl(448 * s) / 448)`` can differ from ``s`` in the last
bit; through bfloat16 the dequantized values are rounded to 8 bits of mantissa, so the amax and
the scale move by up to 2**-9 relative and the codes may move by one step. Not idempotent; use
``pow2_scale=True`` where that matters.

fp8_delayed
-----------
Per-tensor FP8 whose scale comes from a history of amaxes, as delayed-scaling training recipes
(Transformer Engine's ``DelayedScaling``) keep it. Fields: ``qdata``, ``scale`` (the
dequantization scale *of the codes held now*), ``amax_history`` (float32, ``(history_len,)``,
newest first) and ``quant_scale`` (float32 ``()``, the quantizer's scale that the *next*
``quantize_`` will use; TE keeps these two apart as ``_scale_inv`` and ``quantizer.scale``).
Options: ``history_len`` (16), ``amax_compute`` (``"max"`` or ``"most_recent"``), ``margin`` (0):
``quant_scale = amax_h * 2**margin / fp8_max`` with amax_h the max (or newest) entry of the
history; a zero amax_h keeps the previous ``quant_scale``.

* ``quantize(x, "fp8_delayed")`` starts a history with ``amax(x)`` (or ``amax=``) and quantizes
  ``x`` with the scale computed from it (``scale == quant_scale``).
* ``q.quantize_(x)`` quantizes with the current ``quant_scale`` (values beyond it saturate) and
  sets ``scale = quant_scale``; then, with ``update_state=True`` (also what ``copy_`` does), it
  pushes ``amax(x)`` into the history and recomputes ``quant_scale`` for the next call.
  ``update_state=False`` leaves ``amax_history`` and ``quant_scale`` bit-identical (what a loader
  uses); ``quant_state()`` / ``load_quant_state()`` snapshot and restore those two.
* A *fresh* tensor (``formats.empty``, or one whose history holds no non-zero amax) has no scale
  to keep: its first ``quantize_`` takes the scale from its own amax and starts the history, as
  ``quantize`` does, whatever ``update_state`` says (``quant_state()`` of a fresh tensor is
  empty). So a model built on meta and filled by a checkpoint holds ``quantize(value)``.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any

import torch

from qckpt.errors import FormatError
from qckpt.formats import kernels, numerics
from qckpt.formats._base import FieldSpec, Format, register, squeeze_map
from qckpt.formats.kernels import run_kernel, tensor_amax
from qckpt.formats.numerics import (
    FP8_EMAX,
    FP8_MAX,
    UnsupportedOpError,
    as_amax,
    check_finite_amax,
    check_input,
    chunk_ranges,
    exp2_int,
    float_scale,
    fp8_dtype,
    pow2_exponent,
    rows_per_chunk,
)

if TYPE_CHECKING:
    from qckpt.formats.tensor import QuantizedTensor


def _scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    if pow2:
        # floor at 2**-126: a normal float32, so no flush-to-zero surprise on GPUs
        s = exp2_int(pow2_exponent(amax, FP8_EMAX[dtype], emin=-126))
        return torch.where(amax > 0, s, torch.ones_like(s))
    return float_scale(amax, FP8_MAX[dtype])


def _cast_kernel(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, check: bool
) -> torch.Tensor:
    """out <- fp8(clamp(x / scale)); returns max|x| of the chunk when ``check`` (else 0)."""
    m = FP8_MAX[out.dtype]
    xf = x.to(torch.float32)
    # divide in float32 (x / scale, not x * (1/scale)): the same rounding as the usual
    # compressed-tensors / ModelOpt reference code, exact for power-of-two scales
    out.copy_((xf / scale).clamp_(-m, m).to(out.dtype))
    if check:
        return xf.abs().amax()
    return xf.new_zeros(())


def _cast_chunk(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, check: bool
) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    return run_kernel(_cast_kernel, x, scale, out, check)


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    # (rows, rest) view for per-channel work; a 0-d / 1-d tensor has one element per row
    if x.dim() == 0:
        return x.reshape(1, 1)
    rest = 1
    for d in x.shape[1:]:
        rest *= d
    return x.reshape(x.shape[0], rest)


def _quantize_tensorwise(
    x: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    fmt: str,
    check: bool,
    guard: torch.Tensor | None = None,
) -> None:
    """out (fp8, contiguous, same numel) <- x / scale, chunk by chunk (or one Triton kernel).

    ``guard``: the amax of ``x`` not yet checked for NaN/Inf. The Triton kernel reads it and
    writes nothing when it is not finite, so the check (a host sync) comes once, after the
    cast, instead of stalling the device between the amax and the cast."""
    if (check or guard is not None) and kernels.use_triton(x, "fp8", out, scale):
        from qckpt.formats import triton_kernels

        a = triton_kernels.fp8_cast(x, out, scale=scale, amax=guard, check=check)
        if a is not None:
            check_finite_amax(a, fmt)
            return
    if guard is not None:
        check_finite_amax(guard, fmt)
    flat = x.reshape(-1)
    oflat = out.view(-1)
    bad = torch.zeros((), device=x.device)
    for s, e in chunk_ranges(flat.numel(), kernels.quant_chunk(x.device, _cast_kernel)):
        # with amax= given no reduction has seen the values yet: the kernel checks them
        bad = torch.maximum(bad, _cast_chunk(flat[s:e], scale, oflat[s:e], check))
    if check:
        check_finite_amax(bad, fmt)


def _quantize_rowwise(
    x: torch.Tensor, scale_rows: torch.Tensor, out: torch.Tensor, fmt: str, check: bool
) -> None:
    x2 = _rows2d(x)
    o2 = out.view(x2.shape)
    s2 = scale_rows.reshape(-1, 1)
    bad = torch.zeros((), device=x.device)
    step = rows_per_chunk(x2.shape[1], kernels.quant_chunk(x.device, _cast_kernel))
    for s, e in chunk_ranges(x2.shape[0], step):
        bad = torch.maximum(bad, _cast_chunk(x2[s:e], s2[s:e], o2[s:e], check))
    if check:
        check_finite_amax(bad, fmt)


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-row (axis 0) amax as float32 ``(rows,)``, chunked over rows."""
    x2 = _rows2d(x)
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[1] == 0:
        return out.zero_()
    step = rows_per_chunk(x2.shape[1])
    for s, e in chunk_ranges(x2.shape[0], step):
        out[s:e] = torch.linalg.vector_norm(x2[s:e], ord=float("inf"), dim=1).float()
    return out


def _channel_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    return (shape[0],) + (1,) * (len(shape) - 1)


@dataclass(frozen=True, kw_only=True)
class Fp8Options:
    dtype: torch.dtype = torch.float8_e4m3fn  # or float8_e5m2 (or their short names)
    granularity: str = "tensor"  # or "channel": one scale per row
    pow2_scale: bool = False  # scales rounded to powers of two (bit-exact round trips)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", fp8_dtype(self.dtype))
        object.__setattr__(self, "pow2_scale", bool(self.pow2_scale))
        if self.granularity not in ("tensor", "channel"):
            raise FormatError(
                f"fp8: granularity must be 'tensor' or 'channel', got {self.granularity!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Fp8DelayedOptions:
    dtype: torch.dtype = torch.float8_e4m3fn
    history_len: int = 16  # amaxes kept; the next scale comes from them
    amax_compute: str = "max"  # or "most_recent"
    margin: int = 0  # the scale is multiplied by 2**margin
    granularity: InitVar[str] = "tensor"  # accepted for symmetry; per tensor only

    def __post_init__(self, granularity: str) -> None:
        object.__setattr__(self, "dtype", fp8_dtype(self.dtype))
        object.__setattr__(self, "history_len", int(self.history_len))
        object.__setattr__(self, "margin", int(self.margin))
        if granularity != "tensor":
            raise FormatError(
                f"fp8_delayed: only per-tensor scaling, got granularity={granularity!r}"
            )
        if self.history_len < 1:
            raise FormatError("fp8_delayed: history_len must be >= 1")
        if self.amax_compute not in ("max", "most_recent"):
            raise FormatError(
                f"fp8_delayed: amax_compute must be 'max' or 'most_recent', got "
                f"{self.amax_compute!r}"
            )


class Fp8Format(Format):
    name = "fp8"
    tensor_fields = ("qdata", "scale")

    Options = Fp8Options

    def whole_scale(self, opts: dict[str, Any]) -> str | None:
        return "tensor" if opts.get("granularity", "tensor") == "tensor" else "rows"

    def stored_scheme(self, opts: dict[str, Any]) -> Any:
        from qckpt.formats.scheme import Fp8Scheme

        if opts.get("dtype") != torch.float8_e4m3fn:
            return None
        return Fp8Scheme(granularity=opts.get("granularity", "tensor"))

    def _amax(
        self, x: torch.Tensor, opts: dict[str, Any], amax: Any
    ) -> tuple[torch.Tensor, bool, bool]:
        """(amax, whether the cast must check the input for NaN/Inf, whether the amax itself
        is still to be checked: a per-tensor amax computed here is checked after the cast)."""
        channel = opts["granularity"] == "channel"
        if amax is not None:
            a = as_amax(amax, x.device)
            if channel:
                rows = 1 if x.dim() == 0 else x.shape[0]
                if a.numel() == 1:
                    a = a.reshape(1).expand(rows).clone()
                elif a.numel() != rows:
                    raise FormatError(f"fp8 channel: amax has {a.numel()} values for {rows} rows")
                a = a.reshape(rows)
            elif a.numel() != 1:
                raise FormatError(f"fp8 tensor: amax must be a scalar, got {a.numel()} values")
            else:
                a = a.reshape(())
            return a, True, False
        if not channel:
            return tensor_amax(x), False, True
        a = row_amax(x)
        check_finite_amax(a, self.name)
        return a, False, False

    def _write(
        self,
        x: torch.Tensor,
        opts: dict[str, Any],
        amax: Any,
        qdata: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        if amax is None and opts["granularity"] == "tensor" and scale.dtype == torch.float32:
            if kernels.use_triton(x, "fp8", qdata, scale):
                # two kernels (amax, then the cast making the scale itself) and one host sync
                from qckpt.formats import triton_kernels

                a = triton_kernels.amax(x)
                if a is not None:
                    a = triton_kernels.fp8_cast(
                        x, qdata, amax=a, scale_out=scale.view(-1), pow2=opts["pow2_scale"]
                    )
                if a is not None:
                    check_finite_amax(a, self.name)
                    return
        a, check, unchecked = self._amax(x, opts, amax)
        s = _scale_from_amax(a, opts["dtype"], opts["pow2_scale"])
        if opts["granularity"] == "channel":
            _quantize_rowwise(x, s, qdata, self.name, check)
        else:
            _quantize_tensorwise(x, s, qdata, self.name, check, a if unchecked else None)
        scale.copy_(s.reshape(scale.shape))

    def quantize(self, x: torch.Tensor, opts: dict[str, Any], amax: Any) -> dict[str, torch.Tensor]:
        check_input(x, self.name)
        qdata = torch.empty(x.shape, dtype=opts["dtype"], device=x.device)
        shape = _channel_scale_shape(tuple(x.shape)) if opts["granularity"] == "channel" else ()
        scale = torch.empty(shape, dtype=torch.float32, device=x.device)
        self._write(x, opts, amax, qdata, scale)
        return {"qdata": qdata, "scale": scale}

    def field_specs(self, shape: tuple[int, ...], opts: dict[str, Any]) -> dict[str, FieldSpec]:
        channel = opts["granularity"] == "channel"
        return {
            "qdata": FieldSpec(shape, opts["dtype"]),
            "scale": FieldSpec(_channel_scale_shape(shape) if channel else (), torch.float32, 1.0),
        }

    def write_into(self, q: QuantizedTensor, x: torch.Tensor, amax: Any = None) -> bool:
        per_row = q.scale.numel() == 1 or tuple(q.scale.shape) == _channel_scale_shape(
            tuple(x.shape)
        )
        if not per_row:
            # a transposed per-channel tensor (scale (1, n)): its channels are the columns, so
            # quantize the source back in the original orientation and write it transposed
            f = self.quantize(x.t(), q.opts, amax)
            q.qdata.copy_(f["qdata"].t())
            q.scale.copy_(f["scale"].t())
            return True
        if not q.qdata.is_contiguous():
            return False  # a transposed per-tensor view
        self._write(x, q.opts, amax, q.qdata, q.scale)
        return True

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        qd = q.qdata
        out = torch.empty(qd.shape, dtype=dtype, device=qd.device)
        if qd.dim() == 0 or qd.numel() == 0:
            return out.copy_(qd.to(torch.float32) * q.scale)
        if q.scale.numel() == 1:
            s = q.scale.reshape(())
            if qd.is_contiguous():
                f, o = qd.view(-1), out.view(-1)
                for a, b in chunk_ranges(f.numel(), numerics.CHUNK_ELEMS):
                    o[a:b].copy_(f[a:b].to(torch.float32) * s)
                return out
            return out.copy_(qd.to(torch.float32) * s)
        # per-channel: the scale broadcasts against qdata, whatever view it is
        return out.copy_(qd.to(torch.float32) * q.scale)

    def view_fields(self, q: QuantizedTensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        if q.scale.numel() == 1 and q.opts["granularity"] == "tensor":
            # one scale: any view of the codes is a view of the value
            return {"qdata": q.qdata.reshape(shape), "scale": q.scale}
        # per-channel: views that only insert/remove size-1 dims move the scale along
        old = tuple(q.shape)
        m = squeeze_map(old, shape)
        if m is not None:
            sshape = tuple(1 if j is None else q.scale.shape[j] for j in m)
            return {"qdata": q.qdata.reshape(shape), "scale": q.scale.reshape(sshape)}
        # ... and views that keep the channel dim (dim 0) and merge/split the others
        if q.scale.dim() >= 1 and q.scale.shape[0] == old[0] and len(shape) >= 1:
            if shape[0] == old[0] and all(s == 1 for s in q.scale.shape[1:]):
                return {
                    "qdata": q.qdata.reshape(shape),
                    "scale": q.scale.reshape((old[0],) + (1,) * (len(shape) - 1)),
                }
        raise UnsupportedOpError(
            f"fp8 (per-channel): cannot view shape {old} as {shape} without dequantizing; "
            "a view must keep the channel dim"
        )

    def select_fields(self, q: QuantizedTensor, index: int) -> dict[str, torch.Tensor] | None:
        if q.dim() < 2:
            return None
        if q.scale.numel() == 1:
            return {"qdata": q.qdata[index], "scale": q.scale}
        if q.scale.dim() == q.dim() and q.scale.shape[0] == q.shape[0]:
            # per-channel over dim 0: the entry keeps its own row of scales
            return {"qdata": q.qdata[index], "scale": q.scale[index]}
        return None

    def transpose_fields(self, q: QuantizedTensor) -> Any:
        # the scale broadcasts against qdata, so transposing both keeps it per output row
        return {"qdata": q.qdata.t(), "scale": q.scale.t() if q.scale.dim() == 2 else q.scale}


class Fp8DelayedFormat(Format):
    name = "fp8_delayed"
    tensor_fields = ("qdata", "scale", "amax_history", "quant_scale")
    state_fields = ("amax_history", "quant_scale")

    Options = Fp8DelayedOptions
    delayed_state = True

    def whole_scale(self, opts: dict[str, Any]) -> str | None:
        # a tensor built without a scale (on meta) takes its first one from the amax of what
        # it is given; a built one keeps its own
        return "tensor"

    @staticmethod
    def scale_from_history(
        history: torch.Tensor, prev_scale: torch.Tensor, opts: dict[str, Any]
    ) -> torch.Tensor:
        a = history.max() if opts["amax_compute"] == "max" else history[0]
        # fl32(a * 2**margin / fp8_max) on every device: see numerics.div_f32
        fmax = numerics.f64_const(FP8_MAX[opts["dtype"]], a.device)
        s = numerics.div_f32(a * (2.0 ** opts["margin"]), fmax)
        s = s.clamp_min(numerics.F32_TINY)
        # no amax seen yet (or an all-zero tensor): keep the previous scale, like TE
        return torch.where(a > 0, s, prev_scale.reshape(()))

    def quantize(self, x: torch.Tensor, opts: dict[str, Any], amax: Any) -> dict[str, torch.Tensor]:
        check_input(x, self.name)
        if amax is not None:
            a = as_amax(amax, x.device).reshape(())
            check = True
        else:
            a = tensor_amax(x)
            check = False
        hist = torch.zeros(opts["history_len"], dtype=torch.float32, device=x.device)
        hist[0] = a
        scale = self.scale_from_history(hist, torch.ones((), device=x.device), opts)
        qdata = torch.empty(x.shape, dtype=opts["dtype"], device=x.device)
        _quantize_tensorwise(x, scale, qdata, self.name, check, None if check else a)
        return {"qdata": qdata, "scale": scale, "amax_history": hist, "quant_scale": scale.clone()}

    def field_specs(self, shape: tuple[int, ...], opts: dict[str, Any]) -> dict[str, FieldSpec]:
        return {
            "qdata": FieldSpec(shape, opts["dtype"]),
            "scale": FieldSpec((), torch.float32, 1.0),
            "amax_history": FieldSpec((opts["history_len"],), torch.float32, 0.0),
            "quant_scale": FieldSpec((), torch.float32, 1.0),
        }

    @staticmethod
    def is_fresh(q: QuantizedTensor) -> bool:
        """True while the history holds no non-zero amax (a tensor made empty, or only ever
        given zeros): there is no scale to keep yet. One host sync."""
        return not bool(q.amax_history.ne(0).any())

    def quant_state(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        # a fresh tensor has no state worth keeping: its first quantize starts the history
        return {} if self.is_fresh(q) else super().quant_state(q)

    def quantize_into(
        self, q: QuantizedTensor, x: torch.Tensor, update_state: bool = True, *, amax: Any = None
    ) -> None:
        """Quantize with the current ``quant_scale``. A fresh tensor takes its first scale from
        ``amax`` when given (a sharded load's whole-tensor amax, the same on every rank holding
        a block of it), else from ``x``; a built scale never comes from the value."""
        check_input(x, self.name)
        # the amax is needed for the NaN/Inf check even when the state is not updated
        a = tensor_amax(x)
        # what the history records: the whole tensor's amax when a sharded load gives it
        seen = a if amax is None else as_amax(amax, x.device).reshape(())
        h = q.amax_history
        if self.is_fresh(q):
            # no amax seen yet: quantize with the scale of this value (what quantize() gives)
            # and start the history from it, even for a load (update_state=False): a quant_scale
            # of 1.0 would crush weights into FP8's subnormals
            update_state = True
            first = torch.zeros_like(h)
            first[0] = seen
            qs = self.scale_from_history(first, q.quant_scale, q.opts)
        else:
            qs = q.quant_scale.reshape(())
        if q.qdata.is_contiguous():
            _quantize_tensorwise(x, qs, q.qdata, self.name, False, a)
        else:
            tmp = torch.empty(x.shape, dtype=q.qdata.dtype, device=x.device)
            _quantize_tensorwise(x, qs, tmp, self.name, False, a)
            q.qdata.copy_(tmp)
        q.scale.copy_(qs)
        if update_state:
            h.copy_(torch.roll(h, 1))
            h[0] = seen
            q.quant_scale.copy_(self.scale_from_history(h, qs, q.opts))

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        return FP8.dequantize(q, dtype)

    def view_fields(self, q: QuantizedTensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        return {
            "qdata": q.qdata.reshape(shape),
            "scale": q.scale,
            "amax_history": q.amax_history,
            "quant_scale": q.quant_scale,
        }

    def select_fields(self, q: QuantizedTensor, index: int) -> dict[str, torch.Tensor] | None:
        if q.dim() < 2:
            return None
        return {**q.fields(), "qdata": q.qdata[index]}

    def transpose_fields(self, q: QuantizedTensor) -> Any:
        return {
            "qdata": q.qdata.t(),
            "scale": q.scale,
            "amax_history": q.amax_history,
            "quant_scale": q.quant_scale,
        }


FP8 = register(Fp8Format())
FP8_DELAYED = register(Fp8DelayedFormat())
