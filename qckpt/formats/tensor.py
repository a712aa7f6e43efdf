"""``QuantizedTensor``: a wrapper tensor subclass holding one format's codes and scales.

Its nominal ``shape``/``dtype`` are those of the high-precision tensor it stands for (e.g.
bfloat16), so it can sit in a model as ``nn.Parameter(q, requires_grad=False)``. Every aten op
that reaches it goes through a class-level table of named handlers (``@implements``); an op with
no handler raises ``UnsupportedOpError`` (a ``NotImplementedError``) naming the op and the format,
so nothing ever dequantizes behind the caller's back. ``F.linear`` is intercepted one level up
(``__torch_function__``) so a Linear holding a quantized weight runs as one op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from qckpt.errors import FormatError
from qckpt.formats._base import FORMATS, Format, infer_shape
from qckpt.formats.numerics import UnsupportedOpError

aten = torch.ops.aten

Handler = Callable[[Any, tuple, dict], Any]


class QuantizedTensor(torch.Tensor):
    """A quantized tensor: fields ``qdata``, ``scale`` (+ format extras), ``fmt``, ``opts``.

    Build one with ``qckpt.formats.quantize(x, fmt, **opts)``.
    """

    _OPS: dict[Any, Handler] = {}
    _TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {}

    qdata: torch.Tensor
    scale: torch.Tensor
    fmt: str
    opts: dict[str, Any]

    @staticmethod
    def __new__(
        cls,
        fields: dict[str, torch.Tensor],
        fmt: str,
        opts: dict[str, Any],
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        requires_grad: bool = False,
    ) -> QuantizedTensor:
        qdata = fields["qdata"]
        # same strides as qdata when the codes have the nominal shape (fp8 formats), so a
        # transposed view reports itself as non-contiguous like a real tensor would
        strides = qdata.stride() if tuple(qdata.shape) == tuple(shape) else None
        return torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=strides,
            dtype=dtype,
            device=qdata.device,
            requires_grad=requires_grad,
        )

    def __init__(
        self,
        fields: dict[str, torch.Tensor],
        fmt: str,
        opts: dict[str, Any],
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        requires_grad: bool = False,
    ) -> None:
        spec = FORMATS[fmt]
        missing = set(spec.tensor_fields) - set(fields)
        if missing:
            raise ValueError(f"{fmt}: missing fields {sorted(missing)}")
        for name in spec.tensor_fields:
            setattr(self, name, fields[name])
        self.fmt = fmt
        self.opts = dict(opts)

    # ---- public API -----------------------------------------------------------------------

    @property
    def spec(self) -> Format:
        return FORMATS[self.fmt]

    def fields(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self.spec.tensor_fields}

    def dequantize(self, dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:  # type: ignore[override]
        """The high-precision value as a plain tensor of ``dtype`` (None: the nominal dtype)."""
        with torch.no_grad():
            return self.spec.dequantize(self, self.dtype if dtype is None else dtype)

    def quantize_(
        self,
        src: torch.Tensor,
        update_state: bool = True,
        *,
        amax: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Quantize high-precision ``src`` (same nominal shape) into this tensor in place.

        Current-scaling formats recompute their scales; ``fp8_delayed`` quantizes with its
        current scale and, if ``update_state``, records the amax and updates the scale.
        ``amax`` replaces the amax computed from ``src`` where the format takes one (``fp8``:
        per tensor or per row; ``nvfp4``: the global amax): a rank holding one block of a
        tensor passes the whole tensor's, so its scale is the one an unsharded quantize makes.
        """
        if isinstance(src, QuantizedTensor):
            src = src.dequantize(torch.float32)
        if tuple(src.shape) != tuple(self.shape):
            raise UnsupportedOpError(
                f"{self.fmt}: quantize_ source shape {tuple(src.shape)} != {tuple(self.shape)}"
            )
        with torch.no_grad():
            src = src.to(self.device)
            self.spec.quantize_into(self, src, update_state, amax=amax)
        return self

    def quantized_nbytes(self) -> int:
        """Bytes actually held (codes, scales, state), not the nominal ``numel * itemsize``."""
        return sum(t.numel() * t.element_size() for t in self.fields().values())

    def quant_state(self) -> dict[str, torch.Tensor]:
        """Cloned state beyond qdata/scale that a load must leave untouched (none for a
        fresh fp8_delayed tensor: it has seen no amax yet, its first quantize starts it)."""
        return self.spec.quant_state(self)

    def load_quant_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k in self.spec.state_fields:
                if k in state:
                    getattr(self, k).copy_(state[k])

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"QuantizedTensor(fmt={self.fmt!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, opts={self.opts})"
        )

    # ---- tensor-subclass protocol (torch.compile, FSDP-style flatten) --------------------------

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return list(self.spec.tensor_fields), (self.fmt, self.opts, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):  # noqa: ANN001, ANN205
        fmt, opts, dtype = ctx
        return QuantizedTensor(dict(inner), fmt, opts, outer_size, dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        handler = cls._TORCH_FUNCTIONS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        # everything else goes down to aten (and so to __torch_dispatch__) without wrapping
        # plain results into the subclass
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        handler = cls._OPS.get(func)
        if handler is None:
            fmts = sorted({a.fmt for a in _flat_args(args, kwargs) if isinstance(a, cls)})
            raise UnsupportedOpError(
                f"op {func} is not implemented for QuantizedTensor (format "
                f"{', '.join(fmts) or '?'}); call .dequantize() first if you mean to"
            )
        return handler(func, args, kwargs)


def _flat_args(args: tuple, kwargs: dict) -> list[Any]:
    out: list[Any] = []

    def walk(a: Any) -> None:
        if isinstance(a, (list, tuple)):
            for b in a:
                walk(b)
        else:
            out.append(a)

    walk(args)
    walk(tuple(kwargs.values()))
    return out


def _register_in(table: dict, keys: list[Any]) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        for k in keys:
            table[k] = fn
        return fn

    return deco


def implements(ops: list[Any]) -> Callable[[Handler], Handler]:
    """Register an aten op handler in QuantizedTensor's table (torchao style)."""
    return _register_in(QuantizedTensor._OPS, ops)


def implements_torch_function(funcs: list[Any]) -> Callable[[Callable], Callable]:
    """Register a ``__torch_function__`` handler (ops that must not reach dispatch)."""
    return _register_in(QuantizedTensor._TORCH_FUNCTIONS, funcs)


def is_quantized(t: Any) -> bool:
    """True for a QuantizedTensor (a Parameter wrapping one included)."""
    return isinstance(t, QuantizedTensor)


def select_dequantized(t: torch.Tensor, index: int, dtype: torch.dtype | None = None) -> Any:
    """``t[index]`` along dim 0 as a plain tensor (``dtype``, default the nominal one).

    For a QuantizedTensor only that entry's codes are dequantized where the format allows it
    (:meth:`Format.select_fields`: one expert of a fused experts weight); otherwise the whole
    tensor is dequantized, the entry copied out and the whole copy dropped before returning.
    A plain tensor gives ``t[index]`` (a view, no copy).
    """
    if not isinstance(t, QuantizedTensor):
        return t[index] if dtype is None else t[index].to(dtype)
    dtype = t.dtype if dtype is None else dtype
    fields = t.spec.select_fields(t, index)
    if fields is None:
        return t.dequantize(dtype)[index].clone()
    part = QuantizedTensor(fields, t.fmt, t.opts, tuple(t.shape[1:]), t.dtype)
    return part.dequantize(dtype)


# False inside dequantized_compute(): linears dequantize their weight instead of running
# torch._scaled_mm on a quantized copy of their input
_SCALED_MM: ContextVar[bool] = ContextVar("qckpt_scaled_mm", default=True)


@contextmanager
def dequantized_compute() -> Iterator[None]:
    """Inside the block a linear with a quantized weight computes with the dequantized weight
    and the input as it is (never an FP8 copy of the input): what calibration needs, since
    its input amaxes must see the activations a high-precision model would produce."""
    token = _SCALED_MM.set(False)
    try:
        yield
    finally:
        _SCALED_MM.reset(token)


def _like(
    q: QuantizedTensor,
    fields: dict[str, torch.Tensor],
    shape: Any = None,
    dtype: torch.dtype | None = None,
) -> QuantizedTensor:
    return QuantizedTensor(
        fields,
        q.fmt,
        q.opts,
        tuple(q.shape) if shape is None else tuple(shape),
        q.dtype if dtype is None else dtype,
    )


# ---- handlers: aliasing, copies, devices ------------------------------------------------------


@implements([aten.detach.default, aten.alias.default])
def _detach(func: Any, args: tuple, kwargs: dict) -> Any:
    q = args[0]
    return _like(q, {k: func(v) for k, v in q.fields().items()})


@implements([aten.clone.default])
def _clone(func: Any, args: tuple, kwargs: dict) -> Any:
    q = args[0]
    if kwargs.get("memory_format") == torch.contiguous_format:
        # .contiguous() of a transposed view: make the codes (and scales) row-major too, so the
        # nominal strides (taken from qdata) say contiguous; the scales still broadcast/tile
        fields = {k: v.clone(memory_format=torch.contiguous_format) for k, v in q.fields().items()}
    else:
        fields = {k: v.clone() for k, v in q.fields().items()}
    return _like(q, fields)


@implements([aten._to_copy.default])
def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    q = args[0]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None) or q.dtype
    device = kwargs.pop("device", None)
    non_blocking = kwargs.pop("non_blocking", False)
    kwargs.pop("layout", None)
    kwargs.pop("memory_format", None)
    kwargs.pop("pin_memory", None)
    if kwargs:
        raise UnsupportedOpError(f"{q.fmt}: {func} with {sorted(kwargs)} is not supported")
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise UnsupportedOpError(
            f"{q.fmt}: cannot change the nominal dtype to {dtype}; use .dequantize() or .qdata"
        )
    # a dtype change only changes the nominal (dequantized) dtype: the codes stay as they are
    fields = {
        k: v.to(device=device, non_blocking=non_blocking) if device is not None else v.clone()
        for k, v in q.fields().items()
    }
    return _like(q, fields, dtype=dtype)


@implements([aten.copy_.default])
def _copy_(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if isinstance(dst, QuantizedTensor):
        if isinstance(src, QuantizedTensor) and src.fmt == dst.fmt and src.shape == dst.shape:
            if src.opts != dst.opts:
                raise UnsupportedOpError(
                    f"{dst.fmt}: copy_ between different options {src.opts} -> {dst.opts}"
                )
            for k in dst.spec.tensor_fields:
                getattr(dst, k).copy_(getattr(src, k))
            return dst
        # a plain (or other-format) source: quantize into the destination in place
        dst.quantize_(src)
        return dst
    # plain destination, quantized source: write the dequantized value
    dst.copy_(src.dequantize(dst.dtype if dst.dtype.is_floating_point else torch.float32))
    return dst


@implements([aten.empty_like.default])
def _empty_like(func: Any, args: tuple, kwargs: dict) -> Any:
    """A fresh tensor of the same format, options and nominal shape (``Module.to_empty`` of a
    model whose quantized parameters were made on meta): fields hold their defined initial
    values (``Format.field_specs``), never uninitialized memory a quantize would read."""
    q = args[0]
    dtype = kwargs.get("dtype") or q.dtype
    device = kwargs.get("device") or q.device
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise UnsupportedOpError(f"{q.fmt}: empty_like with nominal dtype {dtype}")
    fields = q.spec.empty_fields(tuple(q.shape), q.opts, device)
    return QuantizedTensor(fields, q.fmt, q.opts, tuple(q.shape), dtype)


# ---- views ------------------------------------------------------------------------------------


def _view(q: QuantizedTensor, shape: Any) -> QuantizedTensor:
    shape = infer_shape(tuple(shape), q.numel())
    if shape == tuple(q.shape):
        return _like(q, {k: aten.alias.default(v) for k, v in q.fields().items()})
    return _like(q, q.spec.view_fields(q, shape), shape=shape)


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view_op(func: Any, args: tuple, kwargs: dict) -> Any:
    return _view(args[0], args[1])


@implements([aten.unsqueeze.default])
def _unsqueeze(func: Any, args: tuple, kwargs: dict) -> Any:
    q, dim = args[0], args[1]
    shape = list(q.shape)
    dim = dim if dim >= 0 else dim + len(shape) + 1
    shape.insert(dim, 1)
    return _view(q, shape)


@implements([aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default])
def _squeeze(func: Any, args: tuple, kwargs: dict) -> Any:
    q = args[0]
    nd = q.dim()
    if func is aten.squeeze.default:
        dims = set(range(nd))
    elif func is aten.squeeze.dim:
        dims = {args[1] % max(nd, 1)}
    else:
        dims = {d % max(nd, 1) for d in args[1]}
    shape = [s for i, s in enumerate(q.shape) if not (i in dims and s == 1)]
    return _view(q, shape)


@implements([aten.select.int])
def _select(func: Any, args: tuple, kwargs: dict) -> Any:
    q, dim, index = args[0], args[1], args[2]
    dim = dim % q.dim()
    if q.shape[dim] != 1 or index not in (0, -1):
        raise UnsupportedOpError(
            f"{q.fmt}: select(dim={dim}, index={index}) of shape {tuple(q.shape)} is a partial "
            "slice; only size-1 dims can be selected without dequantizing (use .view)"
        )
    shape = [s for i, s in enumerate(q.shape) if i != dim]
    return _view(q, shape)


@implements([aten.slice.Tensor])
def _slice(func: Any, args: tuple, kwargs: dict) -> Any:
    q = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % q.dim()
    start = args[2] if len(args) > 2 else kwargs.get("start", None)
    end = args[3] if len(args) > 3 else kwargs.get("end", None)
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    n = q.shape[dim]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else min(end + n if end < 0 else end, n)
    if start == 0 and end >= n and step == 1:
        return _like(q, {k: aten.alias.default(v) for k, v in q.fields().items()})
    # a partial slice of a scaled tensor would share (or need) a scale with the rest of the
    # tensor: writing into it would corrupt it, reading it needs a dequantize. Refuse.
    raise UnsupportedOpError(
        f"{q.fmt}: slice [{start}:{end}:{step}] on dim {dim} of shape {tuple(q.shape)} is "
        "partial; quantized tensors support only full slices"
    )


@implements([aten.t.default])
def _t(func: Any, args: tuple, kwargs: dict) -> Any:
    q = args[0]
    if q.dim() < 2:
        return _like(q, {k: aten.alias.default(v) for k, v in q.fields().items()})
    res = q.spec.transpose_fields(q)
    fields, opts = res if isinstance(res, tuple) else (res, q.opts)
    return QuantizedTensor(fields, q.fmt, opts, tuple(reversed(q.shape)), q.dtype)


@implements([aten.transpose.int])
def _transpose(func: Any, args: tuple, kwargs: dict) -> Any:
    q, d0, d1 = args[0], args[1] % args[0].dim(), args[2] % args[0].dim()
    if d0 == d1:
        return _like(q, {k: aten.alias.default(v) for k, v in q.fields().items()})
    if q.dim() != 2:
        raise UnsupportedOpError(f"{q.fmt}: transpose is supported on 2-D tensors only")
    return _t(aten.t.default, (q,), {})


# ---- compute: dequantize then compute (CPU), scaled_mm for per-tensor FP8 on CUDA ---------------


def _hp(t: Any, dtype: torch.dtype) -> Any:
    return t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t


def _compute_dtype(*ts: Any) -> torch.dtype:
    for t in ts:
        if isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor):
            if t.dtype.is_floating_point:
                return t.dtype
    for t in ts:
        if isinstance(t, QuantizedTensor):
            return t.dtype
    return torch.float32


@implements([aten.mm.default, aten.bmm.default, aten.matmul.default])
def _mm(func: Any, args: tuple, kwargs: dict) -> Any:
    dt = _compute_dtype(*args)
    return func(_hp(args[0], dt), _hp(args[1], dt), **kwargs)


@implements([aten.addmm.default])
def _addmm(func: Any, args: tuple, kwargs: dict) -> Any:
    dt = _compute_dtype(*args)
    return func(*[_hp(a, dt) for a in args], **kwargs)


@implements([aten.linear.default])
def _linear_aten(func: Any, args: tuple, kwargs: dict) -> Any:
    return _linear(*args, **kwargs)


@implements_torch_function([F.linear, torch.nn.functional.linear])
def _linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(weight, QuantizedTensor) and not isinstance(input, QuantizedTensor):
        out = _scaled_mm_linear(input, weight, bias)
        if out is not None:
            return out
    dt = _compute_dtype(input, weight, bias)
    with torch._C.DisableTorchFunctionSubclass():
        return F.linear(
            _hp(input, dt), _hp(weight, dt), _hp(bias, dt) if bias is not None else None
        )


def _scaled_mm_linear(
    x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """torch._scaled_mm for a per-tensor FP8 E4M3 weight on CUDA; None where it does not apply
    (CPU, other formats, shapes not multiples of 16, ...), and the caller dequantizes instead."""
    if not (x.is_cuda and w.fmt in ("fp8", "fp8_delayed") and w.dim() == 2):
        return None
    if not _SCALED_MM.get():
        return None
    if w.qdata.dtype != torch.float8_e4m3fn or w.scale.numel() != 1:
        return None
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    n_out, k = w.shape
    x2 = x.reshape(-1, x.shape[-1])
    if k % 16 or n_out % 16 or x2.shape[0] == 0:
        return None
    if not hasattr(torch, "_scaled_mm"):
        return None
    # the activations quantized as ``qckpt.formats.quantize(x2, "fp8")`` does, through the
    # format itself: this module sits under the package's functions (no import back up)
    from qckpt.formats.fp8 import FP8

    try:
        with torch.no_grad():
            xq = FP8.quantize(x2.detach(), FP8.parse_opts({}), None)
    except FormatError:
        # non-finite activations: let the dequantized matmul propagate them as torch would
        return None
    try:
        out = torch._scaled_mm(
            xq["qdata"],
            w.qdata.t() if w.qdata.is_contiguous() else w.qdata.contiguous().t(),
            scale_a=xq["scale"].reshape(()).float(),
            scale_b=w.scale.reshape(()).float(),
            bias=bias.to(x.dtype) if bias is not None and x.dtype != torch.float32 else None,
            out_dtype=x.dtype,
        )
    except (RuntimeError, NotImplementedError):
        return None
    if bias is not None and x.dtype == torch.float32:
        out = out + bias
    return out.reshape(*x.shape[:-1], n_out)


# ---- small metadata ops that tools call on any tensor --------------------------------------------


@implements([aten.is_pinned.default])
def _is_pinned(func: Any, args: tuple, kwargs: dict) -> Any:
    return args[0].qdata.is_pinned()


@implements([aten._has_compatible_shallow_copy_type.default])
def _compat(func: Any, args: tuple, kwargs: dict) -> Any:
    return isinstance(args[0], QuantizedTensor) and isinstance(args[1], QuantizedTensor)


torch.serialization.add_safe_globals([QuantizedTensor])
# every format registered wherever a QuantizedTensor exists (one unpickled from a file looks its
# format up by name), in the order FORMATS lists them
from qckpt.formats import fp8 as _fp8  # noqa: E402,F401
from qckpt.formats import fp8_block as _fp8_block  # noqa: E402,F401
from qckpt.formats import mxfp8 as _mxfp8  # noqa: E402,F401
from qckpt.formats import nvfp4 as _nvfp4  # noqa: E402,F401
