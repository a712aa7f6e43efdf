"""What ``qckpt check`` knows of a scheme as a layout stores it, and which scheme each module
of an export has (torch-free: the family rules beside it, :mod:`qckpt.layouts.ct_check` and
:mod:`qckpt.layouts.modelopt_check`, read the config into a :class:`SchemeMap`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from qckpt.layouts.names import INPUT_SCALE, WEIGHT_SCALE_2

FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(kw_only=True)
class Scheme:
    """What one quantized linear holds: its weight dtype and the scales' shapes and dtypes."""

    name: str
    weight: str  # the scale granularity: "tensor" | "channel" | "block" | "group" (NVFP4's)
    static_input: bool
    scale_dtypes: tuple[str, ...]
    block: tuple[int, int] | None = None
    # E2M1 codes two a byte (uint8) under E4M3 block scales and a float32 global scale
    packed: bool = False
    # the stored codes' safetensors dtype (I32: integer codes packed 32 / bits to a word)
    codes_dtype: str = "F8_E4M3"
    int_bits: int = 0  # integer codes: their bits (the words hold 32 / int_bits each)
    # asymmetric integer groups: int32 words of zero points packed along the rows beside them
    zero_points: bool = False
    mx: bool = False  # packed E2M1 codes under E8M0 (uint8) scales per 32, no global scale
    kv: bool = False
    kv_names: str = "ct"  # "ct": {attn}.k_scale; "modelopt": {attn}.k_proj.k_scale
    # the stored names: ModelOpt's; compressed-tensors NVFP4 has its own (see qckpt.layouts.names)
    codes_leaf: str = "weight"
    global_leaf: str = WEIGHT_SCALE_2
    input_leaf: str = INPUT_SCALE


@dataclass
class SchemeMap:
    """The schemes of an export's config and which one each module has (the first rule whose
    predicate takes the module; None: the config quantizes it with none)."""

    rules: list[tuple[Scheme, Callable[[str], bool]]] = field(default_factory=list)

    @property
    def schemes(self) -> list[Scheme]:
        return [s for s, _ in self.rules]

    @property
    def first(self) -> Scheme:
        return self.rules[0][0]

    @property
    def name(self) -> str:
        return " + ".join(dict.fromkeys(s.name for s in self.schemes))

    def of(self, module: str) -> Scheme | None:
        return next((s for s, hit in self.rules if hit(module)), None)


def one(scheme: Scheme) -> SchemeMap:
    """A config of one scheme for every module."""
    return SchemeMap([(scheme, lambda _m: True)])
