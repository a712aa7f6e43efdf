"""What a quantized HF dir holds, found from its files: the read side's common part.

A quantized dir stores each quantized linear as codes plus scales. :class:`SourceLayout` says
which layout a dir holds and maps each logical ``{module}.weight`` to its stored tensors
(:class:`QuantWeight`); each family's module (``deepseek``, ``compressed_tensors``,
``modelopt``) builds one from its config with the helpers here (``fp8_weights`` /
``nvfp4_weights``: which stored tensors are a weight's codes and scales), and
:mod:`qckpt.layouts.registry` picks the family. Activation and KV-cache scales are hidden
(``PARAM_SUFFIXES``); a value is computed by :mod:`qckpt.layouts.dequantize`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qckpt.errors import CheckpointError
from qckpt.formats.scheme import (
    MX_BLOCK,
    SCHEMES,
    Fp8Scheme,
    Int8Scheme,
    Nvfp4Scheme,
    Scheme,
)
from qckpt.layouts.names import (
    GPT_OSS_BLOCKS,
    GPT_OSS_SCALES,
    NVFP4_GROUP,
    PARAM_SUFFIXES,
    packed_int_cols,
)
from qckpt.storage.slices import Index

FP8 = torch.float8_e4m3fn


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, kw_only=True)
class QuantWeight:
    """How one logical weight is stored."""

    name: str  # the logical name, e.g. model.layers.0.mlp.down_proj.weight
    shape: tuple[int, ...]  # logical (dequantized) shape: 2-D, or 3-D where ``experts``
    scheme: Scheme  # what the codes and scales are (asked, never named)
    granularity: str  # fp8: tensor | channel | block; nvfp4: group
    block: tuple[int, int] = (1, 1)  # block: (b0, b1); nvfp4: (1, 16)
    codes: str  # stored key of the codes
    scale: str  # stored key of the (block) scales
    global_scale: str = ""  # nvfp4: stored key of the second-level scale
    global_divides: bool = False  # compressed-tensors nvfp4: value = e2m1 * (scale / global)
    file: str = ""  # file of the codes
    # integer codes packed into int32 words, this many bits each (compressed-tensors
    # pack-quantized); 0: one code per stored element
    packed_bits: int = 0
    # stored key of the zero points packed along the rows (asymmetric pack-quantized); "": none
    zero_point: str = ""
    # gpt-oss's fused experts: codes [experts, rows, cols / 32, 16] and scales [experts, rows,
    # cols / 32] hold each expert's [rows, cols] linear, which the model holds transposed
    # (``shape`` [experts, cols, rows]: the input dim first); 0 for a 2-D linear
    experts: int = 0

    @property
    def aux_keys(self) -> tuple[str, ...]:
        """The stored keys beside the codes (scales, a global scale, zero points)."""
        return tuple(k for k in (self.scale, self.global_scale, self.zero_point) if k)

    @property
    def scale_layout(self) -> str:
        """A short description for ``inspect``."""
        s = self.scheme
        if s.packed_fp4:
            second = "global 1/scale" if self.global_divides else "scale_2"
            return f"{s.name} e4m3 per {s.group} + {second}"
        if s.mx:
            experts = " (experts, transposed)" if self.experts else ""
            return f"{s.name} e8m0 per {s.group}{experts}"
        if self.granularity == "block":
            return f"{s.name} block {list(self.block)}"
        return f"{s.name} {self.granularity}"


@dataclass(kw_only=True)
class SourceLayout:
    """What a dir holds: its layout name, the quantized weights and the hidden parameters."""

    name: str  # plain | fp8-blockwise | compressed-tensors | modelopt | gpt-oss-mxfp4
    detail: str = ""
    weights: dict[str, QuantWeight] = field(default_factory=dict)  # logical name -> storage
    hidden: set[str] = field(default_factory=set)  # stored keys that are no model tensor
    dtype: torch.dtype = torch.bfloat16  # the dequantized tensors' dtype (the model's)

    @property
    def quantized(self) -> bool:
        return self.name != "plain"

    def describe(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name

    def logical_index(self, index: Index) -> Index:
        """The index a BF16 checkpoint of the same model would have: quantized weights under
        their logical name, shape and dtype; quantization parameters gone."""
        out: Index = {}
        claimed = {k for w in self.weights.values() for k in (w.codes, *w.aux_keys)}
        for k, v in index.items():
            if k in claimed or k in self.hidden:
                continue
            out[k] = v
        for name, w in self.weights.items():
            out[name] = (w.file, w.shape, self.dtype)
        return out

    def summary(self) -> dict[str, Any]:
        """The layout and its scales, as ``inspect`` reports them."""
        kinds: dict[str, int] = {}
        for w in self.weights.values():
            kinds[w.scale_layout] = kinds.get(w.scale_layout, 0) + 1
        return {
            "layout": self.name,
            "detail": self.detail,
            "quantized_weights": len(self.weights),
            "scales": dict(sorted(kinds.items())),
            "hidden_tensors": len(self.hidden),
            "dequantized_dtype": str(self.dtype).replace("torch.", ""),
        }


def read_json_if_any(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return obj


def model_dtype(cfg: dict[str, Any] | None) -> torch.dtype:
    name = (cfg or {}).get("torch_dtype") or (cfg or {}).get("dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if isinstance(dt, torch.dtype) and dt.is_floating_point and dt not in FP8_DTYPES:
        return dt
    return torch.bfloat16


def is_param(key: str) -> bool:
    return key.rpartition(".")[2].endswith(PARAM_SUFFIXES)


def expect_block(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def fp8_granularity(
    key: str, shape: tuple[int, ...], sshape: tuple[int, ...], options: list[tuple[str, Any]]
) -> tuple[str, tuple[int, int]]:
    """Which of the layout's weight schemes a scale shape is: (granularity, block)."""
    for gran, block in options:
        if gran == "block" and tuple(sshape) == expect_block(shape, block):
            return "block", tuple(block)
        if gran == "tensor" and math.prod(sshape) == 1:
            return "tensor", (1, 1)
        if gran == "channel" and tuple(sshape) in ((shape[0], 1), (shape[0],)):
            return "channel", (1, 1)
    want = ", ".join(g if g != "block" else f"block {list(b)}" for g, b in options)
    raise CheckpointError(
        f"{key}: scale shape {list(sshape)} fits none of the checkpoint's weight schemes "
        f"({want}) for a weight of shape {list(shape)}"
    )


def fp8_scheme(granularity: str, block: tuple[int, int]) -> Scheme:
    """The scheme of FP8 codes stored with ``granularity`` scales (``block`` where blocked):
    equal to what a destination of that layout stores (``Format.stored_scheme``)."""
    if granularity == "block":
        return Fp8Scheme(granularity="block", block=tuple(block))
    return Fp8Scheme(granularity=granularity)


def check_2d(key: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 2:
        raise CheckpointError(f"{key}: a quantized weight must be 2-D, got shape {list(shape)}")


def fp8_weights(
    index: Index, scale_suffix: str, options: list[tuple[str, Any]]
) -> dict[str, QuantWeight]:
    """Every F8 ``{m}.weight`` with its ``{m}.weight{scale_suffix}``."""
    out: dict[str, QuantWeight] = {}
    for key, (f, shape, dt) in index.items():
        if dt not in FP8_DTYPES or not key.endswith(".weight"):
            continue
        skey = key + scale_suffix
        if skey not in index:
            continue  # reported as unexplained below
        if dt != FP8:
            raise CheckpointError(f"{key}: stored as {dt}; only float8_e4m3fn codes are read")
        check_2d(key, shape)
        gran, block = fp8_granularity(key, shape, index[skey][1], options)
        out[key] = QuantWeight(
            name=key,
            shape=(shape[0], shape[1]),
            scheme=fp8_scheme(gran, block),
            granularity=gran,
            block=block,
            codes=key,
            scale=skey,
            file=f,
        )
    return out


def nvfp4_weights(index: Index, codes_leaf: str, global_leaf: str, divides: bool) -> dict:
    """Every U8 ``{m}.{codes_leaf}`` with ``{m}.weight_scale`` (F8) and ``{m}.{global_leaf}``."""
    out: dict[str, QuantWeight] = {}
    for key, (f, shape, dt) in index.items():
        mod, _, leaf = key.rpartition(".")
        if leaf != codes_leaf or dt != torch.uint8:
            continue
        skey, gkey = f"{mod}.weight_scale", f"{mod}.{global_leaf}"
        if skey not in index or gkey not in index:
            continue
        check_2d(key, shape)
        logical = (shape[0], shape[1] * 2)
        if index[skey][2] != FP8 or tuple(index[skey][1]) != (
            shape[0],
            math.ceil(logical[1] / NVFP4_GROUP),
        ):
            raise CheckpointError(
                f"{skey}: an NVFP4 block scale must be float8_e4m3fn of shape "
                f"{[shape[0], math.ceil(logical[1] / NVFP4_GROUP)]}; got {index[skey][2]} "
                f"{list(index[skey][1])}"
            )
        if math.prod(index[gkey][1]) != 1:
            raise CheckpointError(f"{gkey}: must hold one value, has shape {list(index[gkey][1])}")
        out[f"{mod}.weight"] = QuantWeight(
            name=f"{mod}.weight",
            shape=logical,
            scheme=Nvfp4Scheme(),
            granularity="group",
            block=(1, NVFP4_GROUP),
            codes=key,
            scale=skey,
            global_scale=gkey,
            global_divides=divides,
            file=f,
        )
    return out


def int_packed_weights(index: Index, bits: int, groups: list[int]) -> dict:
    """Every I32 ``{m}.weight_packed`` with ``{m}.weight_scale`` (compressed-tensors
    ``pack-quantized`` INT4 / INT8 of ``bits``): the logical columns from the scales
    (``groups``: the config's group sizes, 0 per channel), which the packed width must agree
    with."""
    cls = next(c for c in SCHEMES.values() if c.integer and c.code_bits == bits)
    out: dict[str, QuantWeight] = {}
    for key, (f, shape, dt) in index.items():
        mod, _, leaf = key.rpartition(".")
        skey = f"{mod}.weight_scale"
        if leaf != "weight_packed" or dt != torch.int32 or skey not in index:
            continue
        check_2d(key, shape)
        rows, words = int(shape[0]), int(shape[1])
        scale_shape = tuple(index[skey][1])
        fits = packed_int_cols(words, bits)
        group = next((g for g in groups if g and scale_shape[-1] * g in fits), 0)
        if group:
            cols, gran, block = scale_shape[-1] * group, "group", (1, group)
        elif 0 in groups and math.prod(scale_shape) == rows:
            cols, gran, block = fits[-1], "channel", (1, 1)
        else:
            raise CheckpointError(
                f"{skey}: shape {list(scale_shape)} fits no int{bits} group size {groups} of a "
                f"{rows} x {fits[0]}..{fits[-1]} weight"
            )
        zkey = f"{mod}.weight_zero_point"
        zp = zkey if gran == "group" and zkey in index else ""
        if zp and tuple(index[zkey][1]) != (-(-rows * bits // 32), scale_shape[-1]):
            raise CheckpointError(
                f"{zkey}: shape {list(index[zkey][1])}, not the zero points of {list(scale_shape)} "
                "scales packed along the rows"
            )
        out[f"{mod}.weight"] = QuantWeight(
            name=f"{mod}.weight",
            shape=(rows, cols),
            scheme=cls(granularity=gran, block=block, symmetric=not zp),
            zero_point=zp,
            granularity=gran,
            block=block,
            codes=key,
            scale=skey,
            file=f,
            packed_bits=bits,
        )
    return out


def mx_weights(index: Index, bits: int) -> dict:
    """Every MX weight: a U8 ``{m}.weight_packed`` (E2M1, ``bits`` 4; no global scale beside
    it: that is NVFP4) or an F8 ``{m}.weight`` (E4M3, ``bits`` 8) with a U8 ``{m}.weight_scale``
    of one E8M0 exponent per 32 logical columns (compressed-tensors ``mxfp4-pack-quantized`` /
    ``mxfp8-quantized``)."""
    leaf_want, dt_want, per = ("weight_packed", torch.uint8, 2) if bits == 4 else ("weight", FP8, 1)
    cls = next(c for c in SCHEMES.values() if c.mx and c.code_bits == bits)
    out: dict[str, QuantWeight] = {}
    for key, (f, shape, dt) in index.items():
        mod, _, leaf = key.rpartition(".")
        skey = f"{mod}.weight_scale"
        if leaf != leaf_want or dt != dt_want or skey not in index:
            continue
        if f"{mod}.weight_global_scale" in index or index[skey][2] != torch.uint8:
            continue  # NVFP4's, or FP8 with float scales
        check_2d(key, shape)
        rows, cols = int(shape[0]), int(shape[1]) * per
        want = (rows, math.ceil(cols / MX_BLOCK))
        if tuple(index[skey][1]) != want:
            raise CheckpointError(
                f"{skey}: an {cls.name} scale must be uint8 (E8M0) of shape {list(want)}; got "
                f"{list(index[skey][1])}"
            )
        out[f"{mod}.weight"] = QuantWeight(
            name=f"{mod}.weight",
            shape=(rows, cols),
            scheme=cls(),
            granularity="group",
            block=(1, MX_BLOCK),
            codes=key,
            scale=skey,
            file=f,
        )
    return out


def int8_weights(index: Index, strategies: list[str]) -> dict:
    """Every I8 ``{m}.weight`` with ``{m}.weight_scale`` (compressed-tensors ``int-quantized``):
    per row or per tensor, as the scale's shape says."""
    out: dict[str, QuantWeight] = {}
    for key, (f, shape, dt) in index.items():
        skey = f"{key}_scale"
        if dt != torch.int8 or not key.endswith(".weight") or skey not in index:
            continue
        check_2d(key, shape)
        sshape = tuple(index[skey][1])
        gran = "tensor" if math.prod(sshape) == 1 else "channel"
        if gran not in strategies or (gran == "channel" and math.prod(sshape) != shape[0]):
            raise CheckpointError(
                f"{skey}: shape {list(sshape)} fits none of the int8 strategies {strategies} "
                f"of a weight of shape {list(shape)}"
            )
        out[key] = QuantWeight(
            name=key,
            shape=(int(shape[0]), int(shape[1])),
            scheme=Int8Scheme(granularity=gran),
            granularity=gran,
            block=(1, 1),
            codes=key,
            scale=skey,
            file=f,
        )
    return out


def found(index: Index) -> str:
    """What quantized-looking tensors a dir holds, for a refusal message."""
    f8 = [k for k, (_, _, dt) in index.items() if dt in FP8_DTYPES]
    params = [k for k in index if is_param(k)]
    blocks = [
        k
        for k, (_, _, dt) in index.items()
        if dt == torch.uint8 and k.endswith(GPT_OSS_BLOCKS)
        and k.removesuffix(GPT_OSS_BLOCKS) + GPT_OSS_SCALES in index
    ]  # fmt: skip
    parts = []
    if f8:
        parts.append(f"{len(f8)} float8 tensors (e.g. {f8[0]})")
    if blocks:
        parts.append(f"{len(blocks)} MXFP4 blocks tensors (e.g. {blocks[0]})")
    if params:
        parts.append(f"{len(params)} quantization parameters (e.g. {params[0]})")
    return " and ".join(parts)
