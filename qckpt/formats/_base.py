"""The format interface that every quantization format implements, and the registry."""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from qckpt.errors import FormatError
from qckpt.formats.numerics import UnsupportedOpError, check_input

if TYPE_CHECKING:
    from qckpt.formats.tensor import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field of a fresh quantized tensor: its shape, dtype and initial value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float = 0.0


def _fill(t: torch.Tensor, value: float) -> None:
    """``t.fill_(value)``; a 1-byte float (FP8 codes or scales) is filled through a uint8 view
    with the value's bit pattern, which every device's fill kernel takes."""
    if t.element_size() == 1 and t.dtype.is_floating_point:
        byte = torch.tensor(value, dtype=torch.float32).to(t.dtype).view(torch.uint8)
        t.view(torch.uint8).fill_(int(byte.item()))
    else:
        t.fill_(value)


class Format:
    """One quantization format. Stateless: everything about a tensor lives in the
    QuantizedTensor's fields (tensors) and ``opts`` (plain Python values)."""

    name: str = ""
    # tensor fields of a QuantizedTensor of this format, in a fixed order (flatten / copy_)
    tensor_fields: tuple[str, ...] = ("qdata", "scale")
    # fields that quant_state() snapshots: state that a load must leave untouched
    state_fields: tuple[str, ...] = ()

    # the format's options: a frozen dataclass whose defaults are the format's and whose
    # ``__post_init__`` normalizes and checks them (raising FormatError)
    Options: ClassVar[type]
    # options every caller may pass and this format ignores (its layout fixes them)
    ignored_opts: ClassVar[tuple[str, ...]] = ()
    # keeps delayed-scaling state: it quantizes with the scale it holds (from an amax history),
    # not with one made from the value it is given
    delayed_state: ClassVar[bool] = False

    # -- what the scales span (sharded loads and same-layout copies ask, not the name) ----------
    def scale_block(self, opts: dict[str, Any], dim: int, ndim: int) -> int:
        """The length of the blocks ``dim`` (of ``ndim``) is cut into, one scale each (1: the
        scales do not block ``dim``; a scale spanning the whole dim is :meth:`whole_scale`'s)."""
        return 1

    def whole_scale(self, opts: dict[str, Any]) -> str | None:
        """Which scale is made from more than one block of the tensor: ``"tensor"`` (one for
        the whole tensor, or a global second-level one), ``"rows"`` (one per row, over all
        columns), None (every scale is local to its block)."""
        return None

    def stored_scheme(self, opts: dict[str, Any]) -> Any:
        """The :class:`qckpt.formats.scheme.Scheme` whose codes and scales this format stores
        bit for bit with ``opts`` (what a checkpoint of that scheme can be copied into without
        a dequantize), or None."""
        return None

    def parse_opts(self, opts: dict[str, Any]) -> dict[str, Any]:
        """Validate and default the format options through :attr:`Options`; an unknown key is a
        FormatError naming it (and the known ones). Stored as a plain dict on the tensor, so
        that it flattens and pickles as before."""
        opts = {k: v for k, v in opts.items() if k not in self.ignored_opts}
        known = list(self.Options.__dataclass_fields__)  # with InitVars: checked, not stored
        unknown = sorted(set(opts) - set(known))
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise FormatError(
                f"{self.name}: unknown options {unknown}{hint} (known: {', '.join(known)})"
            )
        parsed = self.Options(**opts)
        return {f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed)}

    def quantize(
        self, x: torch.Tensor, opts: dict[str, Any], amax: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Quantize high-precision ``x`` into fresh field tensors."""
        raise NotImplementedError

    def field_specs(self, shape: tuple[int, ...], opts: dict[str, Any]) -> dict[str, FieldSpec]:
        """Shape, dtype and initial value of every field of a tensor of nominal ``shape``.

        The initial values are what quantizing an all-zero tensor gives (zero codes, the
        all-zero scale, an empty history), so a fresh tensor is defined, never garbage.
        """
        raise NotImplementedError

    def empty_fields(
        self, shape: tuple[int, ...], opts: dict[str, Any], device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """Fields of a fresh tensor of nominal ``shape`` on ``device`` (on meta: shapes only),
        each filled with its :meth:`field_specs` value: nothing is read or quantized."""
        out = {}
        for name, spec in self.field_specs(tuple(shape), opts).items():
            t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            if t.device.type != "meta":
                _fill(t, spec.fill)
            out[name] = t
        return out

    def quant_state(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        """Cloned state beyond qdata/scale that a load must leave untouched."""
        return {k: getattr(q, k).clone() for k in self.state_fields}

    def quantize_into(
        self,
        q: QuantizedTensor,
        x: torch.Tensor,
        update_state: bool = True,
        *,
        amax: torch.Tensor | None = None,
    ) -> None:
        """Quantize ``x`` into ``q``'s existing field tensors (their identity is kept).

        Straight into them where :meth:`write_into` can (no second output-size buffer); else
        into fresh contiguous fields, copied over. ``amax`` replaces the amax the format would
        compute from ``x`` (a sharded load passes the whole tensor's, reduced over the ranks
        that hold its blocks); formats whose scales are per block refuse it.
        """
        check_input(x, self.name)
        if self.write_into(q, x, amax):
            return
        for k, v in self.quantize(x, q.opts, amax).items():
            dst = getattr(q, k)
            dst.copy_(v.reshape(dst.shape))

    def write_into(
        self, q: QuantizedTensor, x: torch.Tensor, amax: torch.Tensor | None = None
    ) -> bool:
        """Quantize ``x`` straight into ``q``'s fields if their layout allows (True), or do
        nothing (False: :meth:`quantize_into` quantizes and copies)."""
        return False

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def view_fields(self, q: QuantizedTensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Fields of ``q`` viewed as nominal ``shape`` keeping the quantized layout, or raise."""
        raise UnsupportedOpError(
            f"{self.name}: cannot view a tensor of shape {tuple(q.shape)} as {shape} "
            "without dequantizing"
        )

    def select_fields(self, q: QuantizedTensor, index: int) -> dict[str, torch.Tensor] | None:
        """Fields of ``q[index]`` (along dim 0) for READING, when dim 0 is a leading dim that
        no block spans (one expert of a fused experts weight); None where the layout ties
        dim 0 to the others. Per-tensor fields are shared with ``q``: never write through it."""
        return None

    def transpose_fields(
        self, q: QuantizedTensor
    ) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Fields of ``q.t()`` (2-D), optionally with changed options, or raise."""
        raise UnsupportedOpError(
            f"{self.name}: cannot transpose without dequantizing; the block layout runs "
            "along the last dim. Call .dequantize() first."
        )


FORMATS: dict[str, Format] = {}
# the order ``FORMATS`` lists them in (messages name them so) whichever module is imported first
_ORDER = ("fp8", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4")


def register(fmt: Format) -> Format:
    FORMATS[fmt.name] = fmt
    rank = {n: i for i, n in enumerate(_ORDER)}
    ordered = sorted(FORMATS.items(), key=lambda kv: rank.get(kv[0], len(_ORDER)))
    FORMATS.clear()
    FORMATS.update(ordered)
    return fmt


def squeeze_map(old: tuple[int, ...], new: tuple[int, ...]) -> list[int | None] | None:
    """If ``new`` is ``old`` with size-1 dims inserted/removed, map each dim of ``new`` to the
    dim of ``old`` it comes from (None for an inserted size-1 dim); otherwise None."""
    old_ns = [i for i, s in enumerate(old) if s != 1]
    new_ns = [i for i, s in enumerate(new) if s != 1]
    if [old[i] for i in old_ns] != [new[i] for i in new_ns]:
        return None
    mapping: list[int | None] = [None] * len(new)
    for a, b in zip(new_ns, old_ns, strict=True):
        mapping[a] = b
    return mapping


def infer_shape(shape: tuple[int, ...] | list[int], numel: int) -> tuple[int, ...]:
    """Resolve one -1 in a view shape."""
    shape = list(shape)
    if shape.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        idx = shape.index(-1)
        if known == 0 or numel % known:
            raise RuntimeError(f"shape {tuple(shape)} is invalid for input of size {numel}")
        shape[idx] = numel // known
    total = 1
    for s in shape:
        total *= s
    if total != numel:
        raise RuntimeError(f"shape {tuple(shape)} is invalid for input of size {numel}")
    return tuple(shape)
