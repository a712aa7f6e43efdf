"""Quantization schemes: what one side of a quantized linear (its weights, or its inputs) is.

A recipe's ``quant.weights`` / ``quant.inputs`` (and each ``quant.schemes[i]``'s) is a
``TensorQuantConfig``: a format name, a granularity, a block size, dynamic or not. Every stage
outside :mod:`qckpt.formats` turns it into a :class:`Scheme` with :func:`scheme_of` and asks
the scheme, never the name: what a quantizer calibrates, the amax's shape, the largest code, the
block scales made at quantize time, how clients quantize an input. Adding a format is adding a
``Scheme`` subclass registered here (and its layout encodings), not editing the stages.

Registered: ``fp8`` (E4M3, per tensor / channel / block; static or dynamic inputs), ``nvfp4``
(E2M1 under E4M3 scales per 16 and a float32 global scale), ``mxfp8`` (E4M3 under E8M0 scales
per 32), ``mxfp4`` (E2M1 under E8M0 scales per 32, weight-only), ``int4`` (integer weights under a scale
per group of 128 or per row; per group optionally with zero points),
``int8`` (symmetric integer weights per row or tensor; inputs per token, dynamic, or per tensor,
static) and ``none`` (left in the model dtype: an unquantized side, e.g. the inputs of a weight-only
linear).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from qckpt.errors import FormatError

# E4M3's largest finite value; E2M1's; the scale rule is amax / qmax
FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_GROUP = 16
MX_BLOCK = 32
# INT4's symmetric codes -8..7 and their scale rule amax / 7.5 (half the code range: GPTQ's and
# compressed-tensors')
INT4_RANGE = (-8, 7)
INT4_QMAX = 7.5
# INT8's: codes -128..127 under amax / 127.5 (compressed-tensors' rule for 8 bits too)
INT8_RANGE = (-128, 127)
INT8_QMAX = 127.5

# granularities whose calibrated amax is one number (NVFP4's block scales are made when
# quantizing; only its per-tensor global amax is calibrated)
SCALAR_GRANULARITIES = ("tensor", "dynamic_block")

SCHEMES: dict[str, type[Scheme]] = {}


def register(cls: type[Scheme]) -> type[Scheme]:
    """Class decorator: make ``cls`` the scheme of format ``cls.name``."""
    SCHEMES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Scheme:
    """One side of a quantized linear. Frozen and hashable: two sides that quantize alike are
    equal, whatever recipe entry they came from."""

    name: ClassVar[str] = ""
    # the granularities a recipe may ask of this scheme, for weights and for inputs
    weight_granularities: ClassVar[tuple[str, ...]] = ("tensor",)
    input_granularities: ClassVar[tuple[str, ...]] = ("tensor",)
    quantized: ClassVar[bool] = True
    # the largest code magnitude: a per-tensor / channel / block scale is amax / qmax
    qmax: ClassVar[float] = 1.0
    # block scales made per ``group`` values along the last dim when quantizing (0: none)
    group: ClassVar[int] = 0
    # codes of 4 bits, two per byte (the even column in the low nibble)
    packed_fp4: ClassVar[bool] = False
    # a per-tensor global scale over the block scales, one per weight a client fuses (it keeps
    # a single one for q/k/v or gate/up: the parts must be quantized under the same)
    fused_global: ClassVar[bool] = False
    # the qckpt.formats name of a parameter tensor of this scheme (None: none exists)
    param_format: ClassVar[str | None] = None
    # whether a Hopper (sm90) client has a GEMM on inputs quantized this way; where not, it
    # runs the linear weight-only (vLLM 0.26 serves NVFP4 as W4A16 with Marlin on H100 / H200)
    hopper_input_gemm: ClassVar[bool] = True
    # bits of one code as an export stores it; integer codes packed into int32 words
    code_bits: ClassVar[int] = 8
    # integer codes ``clamp(round(x / scale), *code_range)`` (scales amax / qmax in the
    # export's dtype); how a layout stores them (int8, or packed into int32 words) is its own
    integer: ClassVar[bool] = False
    # E2M1 codes two a byte under one E8M0 (power of two) scale per ``group``, no global scale
    # (MXFP4: :mod:`qckpt.formats.mx_codes`)
    mx: ClassVar[bool] = False

    # the granularities whose weights may take zero points (``symmetric: false``)
    asymmetric_granularities: ClassVar[tuple[str, ...]] = ()

    granularity: str = "tensor"
    block: tuple[int, int] = (128, 128)
    dynamic: bool = False
    # False: codes under a scale and a zero point per group (compressed-tensors' asymmetric
    # ``(max - min) / (2**bits - 1)``), the zero point stored beside the scale
    symmetric: bool = True

    # -- what is calibrated ---------------------------------------------------------------------
    @property
    def calib_granularity(self) -> str:
        """What a quantizer of this side calibrates (an amax per tensor, channel or block)."""
        return self.granularity

    @property
    def scalar_amax(self) -> bool:
        """Whether the calibrated amax of this side is one number."""
        return self.calib_granularity in SCALAR_GRANULARITIES

    def calibrates(self, kind: str) -> bool:
        """Whether a quantizer of ``kind`` ("weight" / "input") of this side records anything:
        an unquantized side and a dynamic input (scaled per batch at run time) do not."""
        return self.quantized and not (kind == "input" and self.dynamic)

    @property
    def block_scaled(self) -> bool:
        """Whether quantizing makes a scale per ``group`` values under a calibrated global
        scale (amax / qmax; NVFP4): GPTQ and the mse search make them group by group."""
        return bool(self.group) and self.calibrates("weight")

    @property
    def static_tensor_scale(self) -> bool:
        """Whether this side has one static stored scale per tensor (amax / qmax) and no block
        scales made when quantizing (FP8 per tensor): the scale a search may clip."""
        static = self.quantized and not self.dynamic and not self.group
        return static and self.granularity == "tensor"

    def amax_shape(self, kind: str, shape: Sequence[int]) -> tuple[int, ...]:
        """The calibrated amax of a ``kind`` tensor of ``shape`` (see :func:`amax_shape`)."""
        from qckpt.formats.shapes import amax_shape

        return amax_shape(self.calib_granularity, kind, shape, self.block)

    # -- what clients do ------------------------------------------------------------------------
    def input_mode(self) -> str:
        """How a client quantizes an input of this side (a :mod:`qckpt.formats.act_quant` mode)."""
        raise FormatError(f"{self.describe()}: no client quantizes inputs this way")

    def stacks(self) -> bool:
        """Whether weights of one shape quantize as one stack (per-tensor or per-row scales)."""
        return False

    def describe(self) -> str:
        extra = f" {self.block[0]}x{self.block[1]}" if self.granularity == "block" else ""
        return f"{self.name} {self.granularity}{extra}{' dynamic' if self.dynamic else ''}"

    def as_dict(self) -> dict[str, Any]:
        d = {
            "format": self.name,
            "granularity": self.granularity,
            "block_size": list(self.block),
            "dynamic": self.dynamic,
        }
        if not self.symmetric:  # a symmetric scheme's dict is what it was before zero points
            d["symmetric"] = False
        return d


@register
@dataclass(frozen=True)
class Fp8Scheme(Scheme):
    name: ClassVar[str] = "fp8"
    weight_granularities: ClassVar[tuple[str, ...]] = ("tensor", "channel", "block")
    input_granularities: ClassVar[tuple[str, ...]] = ("tensor", "block")
    qmax: ClassVar[float] = FP8_MAX
    param_format: ClassVar[str | None] = "fp8"

    def input_mode(self) -> str:
        if not self.dynamic:
            if self.granularity != "tensor":
                raise FormatError(f"{self.describe()}: static FP8 inputs are per tensor")
            return "fp8_static"
        return "fp8_token" if self.granularity == "tensor" else "fp8_group"

    def stacks(self) -> bool:
        return self.granularity in ("tensor", "channel")


@register
@dataclass(frozen=True)
class Nvfp4Scheme(Scheme):
    name: ClassVar[str] = "nvfp4"
    weight_granularities: ClassVar[tuple[str, ...]] = ("tensor",)
    input_granularities: ClassVar[tuple[str, ...]] = ("tensor",)
    qmax: ClassVar[float] = FP4_MAX * FP8_MAX
    group: ClassVar[int] = NVFP4_GROUP
    packed_fp4: ClassVar[bool] = True
    fused_global: ClassVar[bool] = True
    param_format: ClassVar[str | None] = "nvfp4"
    hopper_input_gemm: ClassVar[bool] = False
    code_bits: ClassVar[int] = 4

    @property
    def calib_granularity(self) -> str:
        return "dynamic_block"

    def input_mode(self) -> str:
        if self.dynamic:
            raise FormatError("nvfp4 inputs take a static global scale (dynamic: false)")
        return "nvfp4"


@register
@dataclass(frozen=True)
class Mxfp8Scheme(Scheme):
    """MXFP8: E4M3 under an E8M0 scale per 32 values of a row, made from the block itself
    (:mod:`qckpt.formats.mx_codes`); weights (the export, and the ``mxfp8`` parameter tensor of
    :mod:`qckpt.formats.mxfp8`) and inputs, always dynamic (scaled per 32 at run time). Hopper
    has no MX GEMM: vLLM 0.26 runs it weight-only there (Marlin)."""

    name: ClassVar[str] = "mxfp8"
    weight_granularities: ClassVar[tuple[str, ...]] = ("tensor", "group")
    input_granularities: ClassVar[tuple[str, ...]] = ("tensor", "group")
    qmax: ClassVar[float] = FP8_MAX
    group: ClassVar[int] = MX_BLOCK
    param_format: ClassVar[str | None] = "mxfp8"
    mx: ClassVar[bool] = True
    hopper_input_gemm: ClassVar[bool] = False

    @property
    def calib_granularity(self) -> str:
        return "dynamic_block"

    @property
    def block_scaled(self) -> bool:
        return False

    def calibrates(self, kind: str) -> bool:
        # every 32-block's E8M0 scale comes from the block itself; a weight's amax is kept for
        # the reports and the export's guard, as NVFP4's global one
        return kind != "input"

    def input_mode(self) -> str:
        return "mxfp8"

    def describe(self) -> str:
        return "mxfp8"


@register
@dataclass(frozen=True)
class Int4Scheme(Scheme):
    """INT4 weights under a scale per ``group`` columns of a row (``granularity: group``, the
    group ``block_size[-1]``, 128 by default) or per row (``channel``); codes -8..7
    (``round(w / scale)`` clamped), the scale ``amax / 7.5`` in the model dtype. Weight-only:
    its linears' inputs are ``none`` (W4A16, what Marlin / Machete run).

    ``symmetric: false`` (groups only): a scale and a zero point per group from its min and max
    as compressed-tensors makes them (:func:`qckpt.formats.intq.int_asym_qparams`): codes
    ``clamp(round(w / scale + zp), -8, 7)``, values ``(code - zp) * scale``."""

    name: ClassVar[str] = "int4"
    weight_granularities: ClassVar[tuple[str, ...]] = ("group", "channel")
    input_granularities: ClassVar[tuple[str, ...]] = ()
    qmax: ClassVar[float] = INT4_QMAX
    code_bits: ClassVar[int] = 4
    integer: ClassVar[bool] = True
    code_range: ClassVar[tuple[int, int]] = INT4_RANGE
    asymmetric_granularities: ClassVar[tuple[str, ...]] = ("group",)

    def __post_init__(self) -> None:
        if self.granularity == "group":
            # a group is a (1, g) block of the weight: the amax and scale machinery is FP8's
            object.__setattr__(self, "block", (1, int(self.block[-1])))

    @property
    def calib_granularity(self) -> str:
        return "block" if self.granularity == "group" else self.granularity

    def describe(self) -> str:
        asym = "" if self.symmetric else " asymmetric"
        if self.granularity == "group":
            return f"int4 group {self.block[1]}{asym}"
        return "int4 channel"


@register
@dataclass(frozen=True)
class Mxfp4Scheme(Scheme):
    """MXFP4 weights: E2M1 under an E8M0 scale per 32 values of a row, made from the block
    itself (:mod:`qckpt.formats.mx_codes`); nothing but a per-tensor amax is calibrated (kept
    as NVFP4's is, for the reports). Weight-only here (MXFP4A16: Hopper runs it with Marlin;
    AMD MI35x and gpt-oss ship it)."""

    name: ClassVar[str] = "mxfp4"
    weight_granularities: ClassVar[tuple[str, ...]] = ("tensor", "group")
    input_granularities: ClassVar[tuple[str, ...]] = ()
    qmax: ClassVar[float] = FP4_MAX
    group: ClassVar[int] = MX_BLOCK
    code_bits: ClassVar[int] = 4
    mx: ClassVar[bool] = True

    @property
    def calib_granularity(self) -> str:
        return "dynamic_block"

    @property
    def block_scaled(self) -> bool:
        return False  # no global scale: GPTQ makes each block's exponent as an MX group

    def describe(self) -> str:
        return "mxfp4"


@register
@dataclass(frozen=True)
class Int8Scheme(Scheme):
    """Symmetric INT8: weights per row (``channel``, what W8A8 ships) or per tensor, codes
    -128..127 under ``amax / 127.5`` in the model dtype; inputs per token at run time
    (``dynamic: true``: the scale ``amax_token / 127``, what vLLM's int8 kernels compute) or
    under one static calibrated scale (``amax / 127.5``). Ampere's fast 8-bit GEMM."""

    name: ClassVar[str] = "int8"
    weight_granularities: ClassVar[tuple[str, ...]] = ("channel", "tensor")
    input_granularities: ClassVar[tuple[str, ...]] = ("tensor",)
    qmax: ClassVar[float] = INT8_QMAX
    integer: ClassVar[bool] = True
    code_range: ClassVar[tuple[int, int]] = INT8_RANGE

    def input_mode(self) -> str:
        return "int8_token" if self.dynamic else "int8_static"

    def describe(self) -> str:
        return f"int8 {self.granularity}{' dynamic' if self.dynamic else ''}"


@register
@dataclass(frozen=True)
class NoScheme(Scheme):
    """A side left in the model dtype (``inputs: {format: none}``: weight-only quantization)."""

    name: ClassVar[str] = "none"
    quantized: ClassVar[bool] = False

    def input_mode(self) -> str:
        return "none"

    def describe(self) -> str:
        return "unquantized"


def weight_only_on_hopper() -> frozenset[str]:
    """The input modes (:meth:`Scheme.input_mode`) a Hopper client leaves unquantized."""
    return frozenset(
        cls(granularity=cls.input_granularities[0]).input_mode()
        for cls in SCHEMES.values()
        if cls.quantized and not cls.hopper_input_gemm
    )


def scheme_of(cfg: Any, kind: str = "weight") -> Scheme:
    """The scheme of a recipe's ``TensorQuantConfig`` (or anything with ``format``,
    ``granularity``, ``block_size``, ``dynamic``). Raises ``FormatError`` naming the format
    when none is registered, or the granularity when the scheme does not take it."""
    return make_scheme(
        cfg.format,
        granularity=cfg.granularity,
        block=getattr(cfg, "block_size", (128, 128)),
        dynamic=bool(getattr(cfg, "dynamic", False)),
        kind=kind,
        symmetric=bool(getattr(cfg, "symmetric", True)),
    )


def make_scheme(
    fmt: str,
    *,
    granularity: str = "tensor",
    block: Sequence[int] = (128, 128),
    dynamic: bool = False,
    kind: str = "weight",
    symmetric: bool = True,
) -> Scheme:
    cls = SCHEMES.get(fmt)
    if cls is None:
        raise FormatError(f"unknown quantization scheme {fmt!r}; known: {', '.join(SCHEMES)}")
    allowed = cls.weight_granularities if kind == "weight" else cls.input_granularities
    if cls.quantized and not allowed:
        raise FormatError(f"{fmt} quantizes no {kind}s (its {kind}s: another format, or none)")
    if cls.quantized and granularity not in allowed:
        raise FormatError(
            f"{fmt} {kind}s take granularity {' or '.join(allowed)}, not {granularity}"
        )
    if not symmetric and (kind != "weight" or granularity not in cls.asymmetric_granularities):
        takes = " / ".join(cls.asymmetric_granularities)
        raise FormatError(
            f"{fmt} {kind}s are symmetric (symmetric: false is taken by "
            f"{f'{fmt} {takes} weights' if takes else 'int4 group weights'} only)"
        )
    b = tuple(int(x) for x in block)
    if len(b) == 1:
        b = (b[0], b[0])
    return cls(granularity=granularity, block=b, dynamic=dynamic, symmetric=symmetric)


def scheme_bits(s: Scheme, shape: Sequence[int], model_bits: int = 16) -> float:
    """Bits a weight of ``shape`` takes under ``s`` (codes and scales), as an export holds it."""
    n = math.prod(int(d) for d in shape)
    if not s.quantized:
        return float(n * model_bits)
    if s.packed_fp4:
        return n * 4 + math.ceil(n / s.group) * 8 + 32
    if s.mx:
        return n * s.code_bits + math.ceil(n / s.group) * 8
    if s.group:
        return n * 8 + math.ceil(n / s.group) * 8
    groups = max(1, math.prod(s.amax_shape("weight", shape)))
    zero_points = 0 if s.symmetric else groups * s.code_bits
    return n * s.code_bits + groups * model_bits + zero_points


def replace(s: Scheme, **changes: Any) -> Scheme:
    return dataclasses.replace(s, **changes)
