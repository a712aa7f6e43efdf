"""Quantized checkpoints as sources: which layout a dir holds, and its weights dequantized.

A quantized HF dir stores each quantized linear as codes plus scales; every command wants the
tensor a BF16 checkpoint would hold under the same name. This module finds the layout from the
files alone (``config.json``'s ``quantization_config``, ``hf_quant_config.json``, tensor names
and dtypes) and maps each logical ``{module}.weight`` to its stored tensors:

==============================  =================================================================
layout                          stored per quantized linear -> value
==============================  =================================================================
``fp8-blockwise`` (DeepSeek-V3  ``weight`` F8_E4M3 [M, N], ``weight_scale_inv`` F32
style: ``quant_method: fp8``,   [ceil(M/b0), ceil(N/b1)] -> ``code * scale[i // b0, j // b1]``
``weight_block_size [b0, b1]``) (edge blocks partial); no block size: one scale, per tensor
``compressed-tensors``          ``float-quantized``: ``weight`` F8_E4M3, ``weight_scale`` of the
                                group's strategy: tensor (1,), channel (M, 1), block (as above)
                                -> ``code * scale``. ``nvfp4-pack-quantized``: ``weight_packed``
                                U8 [M, N/2] (low nibble first), ``weight_scale`` F8_E4M3 per 16,
                                ``weight_global_scale`` F32 (1,) = 448*6/amax ->
                                ``e2m1 * (scale / global_scale)``
``modelopt``                    ``FP8``: ``weight`` F8_E4M3, ``weight_scale`` F32 scalar ->
                                ``code * scale``; ``NVFP4``: ``weight`` U8 [M, N/2],
                                ``weight_scale`` F8_E4M3 per 16, ``weight_scale_2`` F32 =
                                amax/(6*448) -> ``e2m1 * (weight_scale_2 * scale)``
==============================  =================================================================

Each product is computed in float32 (the codes and scales are exact there) and rounded once to
the destination's dtype, which is what compressed-tensors' decompressor and DeepSeek's
``weight_dequant`` do (checked bit for bit in the tests). qckpt's own exports are
compressed-tensors or ModelOpt dirs and read the same way.

Activation and KV-cache scales (``input_scale``, ``k_scale``, ``input_global_scale``, ...) are
not model tensors: they are hidden. Anything quantized that no known layout explains (an F8
tensor or a ``*_scale`` tensor without a ``quantization_config``, a layout or a bit width we do
not read) is refused with one line naming what was found; codes are never read as values.

Dequantizing works on any rectangle of a weight (a TP slice, one expert of a fused tensor) and
row chunk by row chunk into the destination (on its device), so the transient memory is one
chunk, not one tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qckpt.errors import CheckpointError

FP8 = torch.float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
NVFP4_GROUP = 16
# rows of a region are dequantized in chunks of about this many elements: the float32
# temporaries of one chunk are the transient cost, whatever the tensor's size
CHUNK_ELEMS = 1 << 22
# stored tensors that are quantization parameters, never model tensors
_PARAM_SUFFIXES = (
    "_scale",
    "_scale_inv",
    "_scale_2",
    "_global_scale",
    "_zero_point",
    "_g_idx",
    "weight_packed",
    "weight_shape",
)

# name -> (file, shape, dtype), what ``hf_reader.hf_index`` reads from the headers
Index = dict[str, tuple[str, tuple[int, ...], torch.dtype]]
# (stored key, row range, col range) -> CPU tensor; None ranges: the whole tensor
Fetch = Callable[[str, tuple[int, int] | None, tuple[int, int] | None], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class QuantWeight:
    """How one logical weight is stored."""

    name: str  # the logical name, e.g. model.layers.0.mlp.down_proj.weight
    shape: tuple[int, int]  # logical (dequantized) shape
    scheme: str  # "fp8" | "nvfp4"
    granularity: str  # fp8: tensor | channel | block; nvfp4: group
    block: tuple[int, int] = (1, 1)  # block: (b0, b1); nvfp4: (1, 16)
    codes: str  # stored key of the codes
    scale: str  # stored key of the (block) scales
    global_scale: str = ""  # nvfp4: stored key of the second-level scale
    global_divides: bool = False  # compressed-tensors nvfp4: value = e2m1 * (scale / global)
    file: str = ""  # file of the codes

    @property
    def scale_layout(self) -> str:
        """A short description for ``inspect``."""
        if self.scheme == "nvfp4":
            return "nvfp4 e4m3 per 16 + " + ("global 1/scale" if self.global_divides else "scale_2")
        if self.granularity == "block":
            return f"fp8 block {list(self.block)}"
        return f"fp8 {self.granularity}"


@dataclass(kw_only=True)
class SourceLayout:
    """What a dir holds: its layout name, the quantized weights and the hidden parameters."""

    name: str  # plain | fp8-blockwise | compressed-tensors | modelopt
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
        claimed = {k for w in self.weights.values() for k in (w.codes, w.scale, w.global_scale)}
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


# ---- reading the configs ----------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return obj


def _model_dtype(cfg: dict[str, Any] | None) -> torch.dtype:
    name = (cfg or {}).get("torch_dtype") or (cfg or {}).get("dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if isinstance(dt, torch.dtype) and dt.is_floating_point and dt not in FP8_DTYPES:
        return dt
    return torch.bfloat16


def _is_param(key: str) -> bool:
    return key.rpartition(".")[2].endswith(_PARAM_SUFFIXES)


def _expect_block(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def _fp8_granularity(
    key: str, shape: tuple[int, ...], sshape: tuple[int, ...], options: list[tuple[str, Any]]
) -> tuple[str, tuple[int, int]]:
    """Which of the layout's weight schemes a scale shape is: (granularity, block)."""
    for gran, block in options:
        if gran == "block" and tuple(sshape) == _expect_block(shape, block):
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


def _check_2d(key: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 2:
        raise CheckpointError(f"{key}: a quantized weight must be 2-D, got shape {list(shape)}")


def _fp8_weights(
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
        _check_2d(key, shape)
        gran, block = _fp8_granularity(key, shape, index[skey][1], options)
        out[key] = QuantWeight(
            name=key,
            shape=(shape[0], shape[1]),
            scheme="fp8",
            granularity=gran,
            block=block,
            codes=key,
            scale=skey,
            file=f,
        )
    return out


def _nvfp4_weights(index: Index, codes_leaf: str, global_leaf: str, divides: bool) -> dict:
    """Every U8 ``{m}.{codes_leaf}`` with ``{m}.weight_scale`` (F8) and ``{m}.{global_leaf}``."""
    out: dict[str, QuantWeight] = {}
    for key, (f, shape, dt) in index.items():
        mod, _, leaf = key.rpartition(".")
        if leaf != codes_leaf or dt != torch.uint8:
            continue
        skey, gkey = f"{mod}.weight_scale", f"{mod}.{global_leaf}"
        if skey not in index or gkey not in index:
            continue
        _check_2d(key, shape)
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
            scheme="nvfp4",
            granularity="group",
            block=(1, NVFP4_GROUP),
            codes=key,
            scale=skey,
            global_scale=gkey,
            global_divides=divides,
            file=f,
        )
    return out


# ---- the layouts ------------------------------------------------------------------------------


def _blockwise_fp8(index: Index, qc: dict[str, Any]) -> SourceLayout:
    bs = qc.get("weight_block_size")
    if bs is None:
        options: list[tuple[str, Any]] = [("tensor", None)]
        detail = "fp8 per-tensor weight_scale_inv"
    else:
        if (
            not isinstance(bs, list)
            or len(bs) != 2
            or not all(isinstance(b, int) and b > 0 for b in bs)
        ):
            raise CheckpointError(
                f"quantization_config.weight_block_size: two positive ints, got {bs!r}"
            )
        options = [("block", (bs[0], bs[1]))]
        detail = f"fp8 block {bs}"
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise CheckpointError(f"quantization_config.fmt {fmt!r}: only e4m3 fp8 sources are read")
    return SourceLayout(
        name="fp8-blockwise", detail=detail, weights=_fp8_weights(index, "_scale_inv", options)
    )


def _ct_weight_options(qc: dict[str, Any]) -> tuple[list[tuple[str, Any]], bool]:
    """(fp8 weight schemes, any nvfp4 group) of a compressed-tensors config; refuses the rest."""
    top = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization_config: compressed-tensors without config_groups")
    fp8: list[tuple[str, Any]] = []
    nvfp4 = False
    for gname, g in groups.items():
        w = (g or {}).get("weights") if isinstance(g, dict) else None
        if not w:
            continue
        fmt = g.get("format") or top
        if fmt == "dense":
            continue  # weights stored unquantized (their scales are hidden): a plain read
        bits, typ, strat = w.get("num_bits"), w.get("type"), w.get("strategy")
        where = f"quantization_config.config_groups.{gname}"
        if w.get("symmetric") is False:
            raise CheckpointError(f"{where}: asymmetric weights (zero points) are not read")
        if fmt in ("float-quantized", "naive-quantized") and (bits, typ) == (8, "float"):
            if strat == "block":
                bs = w.get("block_structure")
                if not (isinstance(bs, list) and len(bs) == 2):
                    raise CheckpointError(f"{where}.weights.block_structure: two ints, got {bs!r}")
                fp8.append(("block", (int(bs[0]), int(bs[1]))))
            elif strat in ("tensor", "channel"):
                fp8.append((strat, None))
            else:
                raise CheckpointError(f"{where}: fp8 weights with strategy {strat!r} are not read")
        elif fmt == "nvfp4-pack-quantized" and (bits, typ) == (4, "float"):
            if w.get("group_size") != NVFP4_GROUP:
                raise CheckpointError(
                    f"{where}: nvfp4 needs group_size 16, got {w.get('group_size')}"
                )
            nvfp4 = True
        else:
            raise CheckpointError(
                f"{where}: compressed-tensors format {fmt!r} with {bits}-bit {typ} weights "
                f"(strategy {strat}) is not a source layout qckpt reads"
            )
    return fp8, nvfp4


def _compressed_tensors(index: Index, qc: dict[str, Any]) -> SourceLayout:
    fp8, nvfp4 = _ct_weight_options(qc)
    weights: dict[str, QuantWeight] = {}
    if fp8:
        weights.update(_fp8_weights(index, "_scale", fp8))
    if nvfp4:
        weights.update(_nvfp4_weights(index, "weight_packed", "weight_global_scale", True))
    kinds = sorted({w.scale_layout for w in weights.values()})
    return SourceLayout(name="compressed-tensors", detail=", ".join(kinds), weights=weights)


def _modelopt(index: Index, qc: dict[str, Any] | None, hq: dict[str, Any] | None) -> SourceLayout:
    q = (hq or {}).get("quantization") or {}
    algo = q.get("quant_algo") or (qc or {}).get("quant_algo")
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):  # per-tensor / per-channel weight_scale
        weights = _fp8_weights(index, "_scale", [("tensor", None), ("channel", None)])
    elif algo == "NVFP4":
        group = q.get("group_size") or (qc or {}).get("group_size") or NVFP4_GROUP
        if group != NVFP4_GROUP:
            raise CheckpointError(f"modelopt NVFP4 with group_size {group}: only 16 is read")
        weights = _nvfp4_weights(index, "weight", "weight_scale_2", False)
    else:
        raise CheckpointError(
            f"modelopt quant_algo {algo!r}: not a source layout qckpt reads (FP8, "
            "FP8_PER_CHANNEL_PER_TOKEN, NVFP4)"
        )
    return SourceLayout(name="modelopt", detail=str(algo), weights=weights)


def _found(index: Index) -> str:
    """What quantized-looking tensors a dir holds, for a refusal message."""
    f8 = [k for k, (_, _, dt) in index.items() if dt in FP8_DTYPES]
    params = [k for k in index if _is_param(k)]
    parts = []
    if f8:
        parts.append(f"{len(f8)} float8 tensors (e.g. {f8[0]})")
    if params:
        parts.append(f"{len(params)} quantization parameters (e.g. {params[0]})")
    return " and ".join(parts)


def detect_layout(
    index: Index, config: dict[str, Any] | None, hf_quant: dict[str, Any] | None, where: str
) -> SourceLayout:
    """The layout of a dir from its tensors (``index``), ``config.json`` and
    ``hf_quant_config.json`` (None when absent). One-line CheckpointError when it is quantized in
    a way qckpt does not read."""
    qc = (config or {}).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    try:
        if hf_quant is not None or method == "modelopt":
            layout = _modelopt(index, qc if isinstance(qc, dict) else None, hf_quant)
        elif method == "compressed-tensors":
            layout = _compressed_tensors(index, qc)
        elif method == "fp8":
            layout = _blockwise_fp8(index, qc)
        elif qc is not None:
            raise CheckpointError(
                f"quantization_config with quant_method {method!r}: not a source layout qckpt "
                "reads (fp8 blockwise, compressed-tensors, modelopt)"
            )
        else:
            found = _found(index)
            if found:
                raise CheckpointError(
                    f"unknown quantized layout: {found}, and no quantization_config in config.json"
                )
            return SourceLayout(name="plain", dtype=_model_dtype(config))
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    layout.dtype = _model_dtype(config)
    claimed = {k for w in layout.weights.values() for k in (w.codes, w.scale, w.global_scale)}
    for k, (_, _, dt) in index.items():
        if k in claimed:
            continue
        if _is_param(k):
            layout.hidden.add(k)  # activation / KV-cache scales and the like
        elif dt in FP8_DTYPES or (dt == torch.uint8 and f"{k}_scale" in index):
            raise CheckpointError(
                f"{where}: {k} is stored as {dt} but the {layout.describe()} layout gives it no "
                "scale; refusing to read its codes as values"
            )
    return layout


def source_layout(path: str | os.PathLike, index: Index) -> SourceLayout:
    """``detect_layout`` with the dir's own config files."""
    p = Path(path)
    return detect_layout(
        index, _read_json(p / "config.json"), _read_json(p / "hf_quant_config.json"), str(p)
    )


def refuse_quantized_dcp(names: dict[str, torch.dtype], where: str) -> None:
    """A DCP dir holding codes or scales: no layout of ours says how to read it; refuse."""
    index: Index = {k: ("", (), dt) for k, dt in names.items()}
    found = _found(index)
    if found:
        raise CheckpointError(
            f"{where}: unknown quantized layout: {found} in a DCP checkpoint (qckpt reads "
            "quantized HF safetensors dirs, and DCP checkpoints of high-precision values)"
        )


# ---- dequantizing -----------------------------------------------------------------------------


def _e2m1(packed: torch.Tensor, c0: int, c1: int, col_base: int) -> torch.Tensor:
    """float32 values of logical columns [c0, c1) from packed bytes starting at column col_base."""
    from qckpt.formats.nvfp4 import e2m1_values

    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return e2m1_values(codes[:, c0 - col_base : c1 - col_base])


def _expand(s: torch.Tensor, b0: int, b1: int, r: tuple[int, int], c: tuple[int, int]) -> Any:
    """Block scales of rows [r0, r1) x cols [c0, c1), expanded to one per element."""
    (r0, r1), (c0, c1) = r, c
    s = s.to(torch.float32)
    s = s.repeat_interleave(b0, 0)[r0 % b0 : r0 % b0 + (r1 - r0)]
    return s.repeat_interleave(b1, 1)[:, c0 % b1 : c0 % b1 + (c1 - c0)]


def _chunk_value(
    w: QuantWeight, fetch: Fetch, r: tuple[int, int], c: tuple[int, int], dev: torch.device
) -> torch.Tensor:
    """float32 value of rows r x cols c of ``w``, computed on ``dev``."""
    (r0, r1), (c0, c1) = r, c
    if w.scheme == "fp8":
        v = fetch(w.codes, r, c).to(dev).to(torch.float32)
        if w.granularity == "tensor":
            return v.mul_(fetch(w.scale, None, None).to(dev, torch.float32).reshape(()))
        if w.granularity == "channel":
            s = fetch(w.scale, None, None).to(dev, torch.float32).reshape(-1, 1)[r0:r1]
            return v.mul_(s)
        b0, b1 = w.block
        s = fetch(w.scale, (r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1))).to(dev)
        return v.mul_(_expand(s, b0, b1, r, c))
    g = NVFP4_GROUP
    packed = fetch(w.codes, r, (c0 // 2, -(-c1 // 2))).to(dev)
    v = _e2m1(packed, c0, c1, (c0 // 2) * 2)
    sb = fetch(w.scale, r, (c0 // g, -(-c1 // g))).to(dev, torch.float32)
    gs = fetch(w.global_scale, None, None).to(dev, torch.float32).reshape(())
    # the two libraries round differently: compressed-tensors divides by its global scale,
    # ModelOpt (and qckpt's nvfp4 format) multiply by weight_scale_2
    s = sb / gs if w.global_divides else gs * sb
    return v.mul_(_expand(s, 1, g, r, c))


def dequantize_into(
    out: torch.Tensor,
    w: QuantWeight,
    fetch: Fetch,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``out`` (shape rows x cols, any float dtype, any device) <- the dequantized region.

    Row chunk by row chunk: each chunk's codes are read, moved to ``out``'s device, multiplied
    by their scales in float32 and rounded once into ``out``."""
    rows = rows or (0, w.shape[0])
    cols = cols or (0, w.shape[1])
    nr, nc = rows[1] - rows[0], cols[1] - cols[0]
    if tuple(out.shape) != (nr, nc):
        raise CheckpointError(f"{w.name}: region {nr}x{nc} read into {tuple(out.shape)}")
    step = max(1, CHUNK_ELEMS // max(nc, 1))
    if w.granularity == "block":
        step = max(w.block[0], step // w.block[0] * w.block[0])
    for a in range(rows[0], rows[1], step):
        b = min(rows[1], a + step)
        out[a - rows[0] : b - rows[0]].copy_(_chunk_value(w, fetch, (a, b), cols, out.device))
    return out


def dequantize(w: QuantWeight, fetch: Fetch, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight as a fresh CPU tensor of ``dtype``."""
    return dequantize_into(torch.empty(w.shape, dtype=dtype), w, fetch)


class SafetensorsFetch:
    """A ``Fetch`` over a dir's safetensors files (``safe_open`` slices: only the asked rows
    and columns leave the file). ``bytes_read`` counts them."""

    def __init__(self, root: str | os.PathLike, index: Index) -> None:
        self.root = Path(root)
        self.index = index
        self.bytes_read = 0
        self._handles: dict[str, Any] = {}

    def __call__(
        self, key: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None
    ) -> torch.Tensor:
        from safetensors import safe_open

        f = self.index[key][0]
        h = self._handles.get(f)
        if h is None:
            h = safe_open(str(self.root / f), framework="pt", device="cpu")
            self._handles[f] = h
        if rows is None:
            t = h.get_tensor(key)
        else:
            t = h.get_slice(key)[rows[0] : rows[1], cols[0] : cols[1]]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()


# ---- the copy path: codes and scales straight into a destination of the same layout -----------

_WHOLE = 0  # a dim that one scale spans entirely (per-tensor; the columns of per-channel)


def _dest_blocks(dest: Any, w: QuantWeight) -> tuple[int, int] | None:
    """The block (rows, cols) over which ``dest`` keeps one scale, when it stores ``w``'s
    layout bit for bit (same codes, same scale values); else None."""
    fmt, opts = getattr(dest, "fmt", None), getattr(dest, "opts", {})
    if w.scheme == "fp8" and opts.get("dtype") == FP8:
        if fmt == "fp8_block" and w.granularity == "block":
            return w.block if tuple(opts["block_size"]) == w.block else None
        if fmt == "fp8" and opts.get("granularity") == w.granularity == "tensor":
            return (_WHOLE, _WHOLE)
        if fmt == "fp8" and opts.get("granularity") == w.granularity == "channel":
            return (1, _WHOLE) if dest.dim() == 2 else None
    if fmt == "nvfp4" and w.scheme == "nvfp4" and not w.global_divides:
        # one global scale per tensor: only a destination fed by one source tensor
        return (1, NVFP4_GROUP)
    return None


def _aligned(g0: int, g1: int, o: int, s: int, lo: int, d: int, b: int) -> bool:
    """Whether [g0, g1) cuts the source piece [o, o+s) and the destination [lo, lo+d) on the
    same block boundaries (b: block length; _WHOLE: the whole dim in both)."""
    if b == _WHOLE:
        return g0 == o == lo and g1 == o + s == lo + d
    if (g0 - o) % b or (g0 - lo) % b:
        return False
    return (g1 - g0) % b == 0 or (g1 == o + s and g1 == lo + d)


def _overlaps(pieces: list[Any], lo: tuple[int, ...], dims: tuple[int, ...]) -> list[Any]:
    """(piece, [(g0, g1) per dim]) of every piece that meets the local block [lo, lo+dims)."""
    out = []
    for p in pieces:
        cut = []
        for o, s, a, d in zip(p.offsets, p.sizes, lo, dims, strict=True):
            g0, g1 = max(o, a), min(o + s, a + d)
            if g0 >= g1:
                break
            cut.append((g0, g1))
        else:
            out.append((p, cut))
    return out


def copy_plan(
    dest: Any, pieces: list[Any], lo: tuple[int, ...], whole: tuple[int, ...] | None = None
) -> list[Any] | None:
    """The pieces to copy into ``dest`` (local block at global offsets ``lo`` of a tensor of
    shape ``whole``, default: ``dest`` is the whole tensor) when every element comes from a
    source weight stored exactly as ``dest`` stores it; else None.

    A scale that spans a whole dim (per tensor; the columns of per channel; nvfp4's global
    scale) is decided on the whole tensor, so a block is copied exactly when the whole
    tensor would be: then every rank holding a block of it decides alike."""
    if not pieces or any(getattr(p, "quant", None) is None for p in pieces):
        return None
    dims = tuple(int(s) for s in dest.shape)
    whole = dims if whole is None else tuple(int(s) for s in whole)
    if len(dims) != len(lo) or len(dims) < 2 or len(whole) != len(dims):
        return None
    hits = _overlaps(pieces, lo, dims)
    blocks = {_dest_blocks(dest, p.quant) for p, _ in hits}
    if len(blocks) != 1 or None in blocks:
        return None
    (b0, b1) = blocks.pop()
    whole_tensor = b0 == _WHOLE or getattr(dest, "fmt", "") == "nvfp4"
    if whole_tensor and len(_overlaps(pieces, (0,) * len(whole), whole)) != 1:
        return None  # one scale for the whole tensor, several source tensors
    for p, cut in hits:
        (r0, r1), (c0, c1) = cut[-2], cut[-1]
        if b0 == _WHOLE:
            continue  # per-tensor: any rectangle of the codes keeps its one scale
        if not _aligned(r0, r1, p.offsets[-2], p.sizes[-2], lo[-2], dims[-2], b0):
            return None
        if b1 == _WHOLE:
            # one scale per row over all columns: the whole tensor's columns are this piece's
            if p.offsets[-1] != 0 or p.sizes[-1] != whole[-1]:
                return None
        elif not _aligned(c0, c1, p.offsets[-1], p.sizes[-1], lo[-1], dims[-1], b1):
            return None
    return hits


def copy_into(dest: Any, hits: list[Any], lo: tuple[int, ...], fetch: Fetch) -> None:
    """Copy the codes and scales of ``copy_plan``'s pieces into ``dest``, bit for bit."""
    with torch.no_grad():
        for p, cut in hits:
            w: QuantWeight = p.quant
            local = tuple(slice(g0 - a, g1 - a) for (g0, g1), a in zip(cut, lo, strict=True))
            (r0, r1), (c0, c1) = cut[-2], cut[-1]
            rows = (r0 - p.offsets[-2], r1 - p.offsets[-2])
            cols = (c0 - p.offsets[-1], c1 - p.offsets[-1])
            dev = dest.qdata.device
            if w.scheme == "nvfp4":
                lead, lr, lc = local[:-2], local[-2], local[-1]
                packed = fetch(w.codes, rows, (cols[0] // 2, -(-cols[1] // 2)))
                dest.qdata[(*lead, lr, slice(lc.start // 2, -(-lc.stop // 2)))].copy_(packed)
                g = NVFP4_GROUP
                sb = fetch(w.scale, rows, (cols[0] // g, -(-cols[1] // g)))
                dest.scale[(*lead, lr, slice(lc.start // g, -(-lc.stop // g)))].copy_(sb)
                dest.global_scale.copy_(fetch(w.global_scale, None, None).reshape(()).to(dev))
                continue
            dest.qdata[local].copy_(fetch(w.codes, rows, cols))
            if w.granularity == "tensor":
                dest.scale.copy_(fetch(w.scale, None, None).to(torch.float32).reshape(()))
            elif w.granularity == "channel":
                s = fetch(w.scale, None, None).to(torch.float32).reshape(-1, 1)
                dest.scale[local[-2]].copy_(s[rows[0] : rows[1]])
            else:
                b0, b1 = w.block
                srows = (rows[0] // b0, -(-rows[1] // b0))
                scols = (cols[0] // b1, -(-cols[1] // b1))
                lr, lc = local[-2], local[-1]
                at = (
                    *local[:-2],
                    slice(lr.start // b0, -(-lr.stop // b0)),
                    slice(lc.start // b1, -(-lc.stop // b1)),
                )
                dest.scale[at].copy_(fetch(w.scale, srows, scols).to(torch.float32))
