"""``qckpt check``: is an FP8/FP4 export dir something vLLM and transformers will load right?

Torch-free (the safetensors headers are JSON; the scale values are read with numpy), so it runs
anywhere, on any export (qckpt's or another tool's) in the two layouts qckpt writes:

* the config: ``quantization_config`` with a known ``quant_method``, read into each module's
  scheme by the family's rules (:mod:`qckpt.layouts.ct_check`: each ``config_groups`` entry and
  its ``targets``; :mod:`qckpt.layouts.modelopt_check`: ``quant_algo``, or ``MIXED_PRECISION``'s
  ``quantized_layers``): each linear is checked against its own; for ModelOpt the
  ``hf_quant_config.json`` beside it, with the same algorithm, the same ignore list
  (``exclude_modules``) and a KV-cache algorithm that agrees with ``kv_cache_scheme``; the
  ``ignore`` key in ``config.json`` (what vLLM reads there);
* the modules: a quantized weight (FP8, or NVFP4's packed uint8: ``weight_packed`` in
  compressed-tensors' nvfp4-pack-quantized) is a quantized linear; every
  other 2-D weight that is not an embedding must be named by the ignore list, and no quantized
  one may be (vLLM would load the one as FP8 and the other in high precision: garbage either
  way); q/k/v and gate/up are quantized together or not at all, and with one scheme, as are
  the experts of one MoE layer (vLLM fuses them); MoE experts
  come as 0..N-1, every one with every projection;
* the scales: each quantized linear has the scales of its scheme, with the shape and dtype the
  clients allocate; no stray scale for a module that is not quantized; every scale is finite and
  positive (NVFP4's FP8 block scales may be zero: an all-zero block); KV-cache scales for every
  attention when the config asks for them.

The first problem of each kind per module is reported; the result lists them all.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qckpt.errors import CheckpointError
from qckpt.layouts.check_common import FLOAT_DTYPES, Scheme, SchemeMap  # noqa: F401
from qckpt.layouts.ct_check import ct_schemes
from qckpt.layouts.modelopt_check import modelopt_schemes
from qckpt.layouts.names import (
    CT_WEIGHT_SHAPE,
    CT_ZERO_POINT,
    EMBEDDING_LEAVES,
    INPUT_SCALE,
    MODELOPT_FILE,
    MX_GROUP,
    NVFP4_GROUP,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    packed_int_cols,
)
from qckpt.models.fused import FUSED_GROUPS, fused_parts
from qckpt.storage.files import open_regular

MAX_HEADER = 100 << 20


_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)$")


@dataclass
class Tensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(kw_only=True)
class CheckResult:
    path: str
    layout: str = ""
    scheme: str = ""
    quantized: int = 0
    experts: int = 0
    unquantized: int = 0
    kv: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        what = f"{self.layout} {self.scheme}".strip() or "unknown layout"
        if not self.ok:
            n = len(self.problems)
            return f"{self.path}: {n} problem{'s' if n > 1 else ''} ({what})"
        kv = ", KV-cache scales" if self.kv else ""
        return (
            f"{self.path}: OK ({what}: {self.quantized} quantized linears, {self.experts} of "
            f"them experts; {self.unquantized} left in high precision{kv})"
        )

    def lines(self) -> list[str]:
        return [self.summary(), *self.problems]


# -- reading -----------------------------------------------------------------------------------


def _header(path: Path) -> dict:
    # a FIFO or device under a shard's name is refused, never waited on
    with open_regular(path) as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"header of {n} bytes")
        head = json.loads(f.read(n))
    if not isinstance(head, dict):
        raise ValueError("header is not a JSON object")
    return {"__len__": n, **head}


def _tensors(root: Path, problems: list[str]) -> dict[str, Tensor]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            files = sorted(set(wmap.values()))
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{index.name}: not a safetensors index ({exc})")
            return {}
    else:
        wmap, files = None, sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        problems.append(f"{root}: no safetensors files")
    out: dict[str, Tensor] = {}
    for fname in files:
        f = root / fname
        if not f.exists():
            problems.append(f"{fname}: named by the index but missing")
            continue
        try:
            head = _header(f)
        except (OSError, ValueError, CheckpointError) as exc:
            problems.append(f"{fname}: unreadable safetensors header ({exc})")
            continue
        base, size = 8 + head.pop("__len__"), f.stat().st_size
        for name, info in head.items():
            if name == "__metadata__":
                continue
            try:
                b, e = info["data_offsets"]
                t = Tensor(f, info["dtype"], tuple(info["shape"]), base + b, e - b)
            except (KeyError, TypeError, ValueError):
                problems.append(f"{fname}: bad header entry for {name}")
                continue
            if t.offset + t.nbytes > size:
                problems.append(f"{fname}: {name} runs past the end of the file")
            out[name] = t
    if wmap is not None:
        for name in sorted(set(wmap) ^ set(out))[:5]:
            where = "the index" if name in wmap else "a shard"
            problems.append(f"{name}: only in {where} (index and shards disagree)")
    return out


class _Files(threading.local):
    """The files one ``check_export`` reads scales from, each opened once (an export of a
    large MoE has tens of thousands of scales: an open per scale cost seconds)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] | None = None
        # one-value scales whose test is deferred to one bulk read and test (_settle_scales):
        # (name, tensor, zero allowed, where its problem goes in the list)
        self.scales: list[tuple[str, Tensor, bool, int]] | None = None

    def read(self, t: Tensor) -> bytes:
        if self.fds is None:  # outside check_export: open and close
            with open(t.file, "rb") as f:
                f.seek(t.offset)
                return f.read(t.nbytes)
        fd = self.fds.get(t.file)
        if fd is None:
            fd = self.fds[t.file] = os.open(t.file, os.O_RDONLY)
        return os.pread(fd, t.nbytes, t.offset)

    @contextlib.contextmanager
    def kept_open(self) -> Iterator[None]:
        self.fds = {}
        self.scales = []
        try:
            yield
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds = None
            self.scales = None


_FILES = _Files()


def _values(t: Tensor) -> np.ndarray:
    return _decode(_FILES.read(t), t.dtype)


def _decode(raw: bytes, dtype: str) -> np.ndarray:
    """Little-endian values of a safetensors dtype as float64 (ValueError for one not read)."""
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float64)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float64)
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if dtype == "F8_E4M3":
        return _e4m3(np.frombuffer(raw, dtype=np.uint8))
    if dtype == "U8":  # a scale stored as bytes is E8M0 (MX): 2**(code - 127), 255 is NaN
        b = np.frombuffer(raw, dtype=np.uint8)
        return np.where(b == 255, np.nan, np.ldexp(1.0, b.astype(np.int32) - 127))
    raise ValueError(dtype)


def _e4m3(b: np.ndarray) -> np.ndarray:
    """E4M3 (fn) bytes -> float64: NaN for 0x7F/0xFF, no infinities."""
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(np.float64)
    val = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp.astype(np.int32) - 7))
    val = sign * val
    return np.where((b & 0x7F) == 0x7F, np.nan, val)


# -- the config --------------------------------------------------------------------------------


# -- the modules -------------------------------------------------------------------------------


def _ignored_by(ignore: list[str], layout: str):
    """A predicate: does the ignore list name this module, as vLLM reads the list?"""
    pats = [p for p in ignore if isinstance(p, str)]
    regex = [re.compile(p[3:]) for p in pats if p.startswith("re:")]
    plain = [p for p in pats if not p.startswith("re:")]

    def hit(module: str) -> bool:
        if module in plain or any(r.match(module) for r in regex):
            return True
        # ModelOpt entries are wildcards, and vLLM also matches them as substrings
        return layout == "modelopt" and any(
            fnmatch.fnmatchcase(module, p) or p in module for p in plain
        )

    return hit


def _is_embedding(module: str) -> bool:
    return module.rpartition(".")[2] in EMBEDDING_LEAVES


def _expected_scales(scheme: Scheme, shape: tuple[int, ...]) -> dict[str, tuple]:
    """scale name -> (accepted shapes, accepted dtypes) for a weight of ``shape`` as stored."""
    out_dim = shape[0]
    f32 = ("F32",)
    if scheme.int_bits:
        return _expected_int_scales(scheme, shape)
    if scheme.mx:
        cols = shape[1] * 2 if scheme.packed else shape[1]
        return {WEIGHT_SCALE: ({(out_dim, -(-cols // MX_GROUP))}, ("U8",))}
    if scheme.packed:
        cols = shape[1] * 2
        exp = {
            WEIGHT_SCALE: ({(out_dim, cols // NVFP4_GROUP)}, ("F8_E4M3",)),
            scheme.global_leaf: ({(), (1,)}, f32),
        }
    elif scheme.weight == "tensor":
        exp = {WEIGHT_SCALE: ({(), (1,)}, scheme.scale_dtypes)}
    elif scheme.weight == "channel":
        exp = {WEIGHT_SCALE: ({(out_dim,), (out_dim, 1)}, scheme.scale_dtypes)}
    else:
        b0, b1 = scheme.block
        want = (math.ceil(shape[0] / b0), math.ceil(shape[1] / b1))
        exp = {WEIGHT_SCALE: ({want}, scheme.scale_dtypes)}
    if scheme.static_input:
        exp[scheme.input_leaf] = ({(), (1,)}, scheme.scale_dtypes)
    return exp


def _expected_int_scales(scheme: Scheme, shape: tuple[int, ...]) -> dict[str, tuple]:
    """Integer codes packed into words: a scale per group (or row) of the logical columns,
    which the packed width bounds to within one word; the logical shape beside them."""
    out_dim, words = shape
    cols = packed_int_cols(words, scheme.int_bits)
    if scheme.weight == "group":
        g = scheme.block[1] if scheme.block else 1
        shapes = {(out_dim, c // g) for c in cols if c % g == 0}
    else:
        shapes = {(out_dim, 1), (out_dim,)}
    exp = {WEIGHT_SCALE: (shapes, scheme.scale_dtypes), CT_WEIGHT_SHAPE: ({(2,)}, ("I64",))}
    if scheme.zero_points:  # one per scale, packed along the rows (every word's value is one)
        zrows = -(-out_dim * scheme.int_bits // 32)
        exp[CT_ZERO_POINT] = ({(zrows, s[1]) for s in shapes}, ("I32",))
    return exp


# a one-value scale's bytes per dtype: the scales tested in bulk
_ONE_VALUE = {"F32": 4, "BF16": 2, "F16": 2}


_BULK_GAP = 4096  # scales this close in a file are read with one pread


def _check_scale(name: str, t: Tensor, allow_zero: bool, problems: list[str]) -> None:
    todo = _FILES.scales
    if todo is not None and _ONE_VALUE.get(t.dtype) == t.nbytes:
        todo.append((name, t, allow_zero, len(problems)))  # _settle_scales tests it
        return
    _check_scale_now(name, t, allow_zero, problems)


def _settle_scales(problems: list[str]) -> None:
    """The deferred one-value scales (tens of thousands on a large MoE, where a read and a
    numpy test each cost seconds): read with one ``pread`` per run of nearby scales, tested
    per dtype in one go; a bad one gets :func:`_check_scale_now`'s message, at the place in
    ``problems`` it would have had."""
    todo, _FILES.scales = _FILES.scales or [], []
    raws = _read_many([t for _, t, _, _ in todo])
    # a scale past the end of its file (reported already) is read short: tested on its own
    bad = [i for i, (_, t, _, _) in enumerate(todo) if len(raws[i]) != t.nbytes]
    for code in {t.dtype for _, t, _, _ in todo}:
        idx = [
            i for i, (_, t, _, _) in enumerate(todo) if t.dtype == code and len(raws[i]) == t.nbytes
        ]
        v = _decode(b"".join(raws[i] for i in idx), code)
        zero_ok = np.array([todo[i][2] for i in idx], dtype=bool)
        good = np.isfinite(v) & ((v > 0) | (zero_ok & (v == 0)))
        bad += [idx[j] for j in np.flatnonzero(~good)]
    if not bad:
        return
    found: dict[int, list[str]] = {}
    for i in sorted(bad):
        name, t, zero_ok, at = todo[i]
        _check_scale_now(name, t, zero_ok, found.setdefault(at, []))
    merged: list[str] = []
    for at in range(len(problems) + 1):
        merged += found.get(at, [])
        if at < len(problems):
            merged.append(problems[at])
    problems[:] = merged


def _read_many(ts: list[Tensor]) -> list[bytes]:
    """Each tensor's bytes, in order; one read per run of tensors lying close in one file."""
    rank = {f: str(f) for f in {t.file for t in ts}}  # one str per file, not per tensor
    order = sorted(range(len(ts)), key=lambda i: (rank[ts[i].file], ts[i].offset))
    out: list[bytes] = [b""] * len(ts)
    k = 0
    while k < len(order):
        first = ts[order[k]]
        end, j = first.offset + first.nbytes, k + 1
        while j < len(order):
            nxt = ts[order[j]]
            if nxt.offset > end + _BULK_GAP or (
                nxt.file is not first.file and nxt.file != first.file
            ):
                break
            end, j = max(end, nxt.offset + nxt.nbytes), j + 1
        run = _FILES.read(
            Tensor(first.file, "U8", (end - first.offset,), first.offset, end - first.offset)
        )
        for i in order[k:j]:
            a = ts[i].offset - first.offset
            out[i] = run[a : a + ts[i].nbytes]
        k = j
    return out


def _check_scale_now(name: str, t: Tensor, allow_zero: bool, problems: list[str]) -> None:
    try:
        v = _values(t)
    except ValueError:
        problems.append(f"{name}: scale dtype {t.dtype} cannot be read")
        return
    if v.size == 1:  # the common per-tensor scale: one float, no array reductions
        x = float(v[0])
        if math.isfinite(x) and (x > 0 or (allow_zero and x == 0)):
            return
    if np.isnan(v).any() or np.isinf(v).any():
        problems.append(f"{name}: NaN or Inf scale")
    elif (v < 0).any():
        problems.append(f"{name}: negative scale ({v.min():.6g})")
    elif not allow_zero and (v == 0).any():
        problems.append(f"{name}: zero scale (clients divide by it)")


def _check_module(m: str, w: Tensor, scheme: Scheme, tensors: dict, problems: list[str]) -> None:
    want_dtype = "U8" if scheme.packed else scheme.codes_dtype
    if w.dtype != want_dtype or len(w.shape) != 2:
        problems.append(
            f"{m}.{scheme.codes_leaf}: {w.dtype} {list(w.shape)}, {scheme.name} stores {want_dtype}"
        )
        return
    for leaf, (shapes, dtypes) in _expected_scales(scheme, w.shape).items():
        t = tensors.get(f"{m}.{leaf}")
        if t is None:
            problems.append(f"{m}: no {leaf}")
            continue
        if t.shape not in shapes or t.dtype not in dtypes:
            want = " or ".join(str(list(s)) for s in sorted(shapes))
            problems.append(
                f"{m}.{leaf}: {t.dtype} {list(t.shape)}, expected {'/'.join(dtypes)} {want}"
            )
            continue
        if leaf not in (CT_WEIGHT_SHAPE, CT_ZERO_POINT):  # the logical shape, codes: no scale
            _check_scale(f"{m}.{leaf}", t, allow_zero=t.dtype == "F8_E4M3", problems=problems)


def _check_fused(quantized: set[str], problems: list[str]) -> None:
    parents: dict[str, set[str]] = {}
    for m in quantized:
        parent, _, leaf = m.rpartition(".")
        parents.setdefault(parent, set()).add(leaf)
    for parent, leaves in parents.items():
        for group in FUSED_GROUPS:
            have = [g for g in group if g in leaves]
            missing = [g for g in group if g not in leaves]
            if have and missing:
                problems.append(
                    f"{parent}: {', '.join(have)} quantized but {', '.join(missing)} not "
                    f"(vLLM fuses {'/'.join(group)} into one weight)"
                )


def _check_fused_schemes(smap: SchemeMap, quantized: set[str], problems: list[str]) -> None:
    """Linears a client fuses (q/k/v, gate/up, an MoE layer's experts) have one scheme: one
    weight has one quantization method there."""
    first: dict[str, tuple[str, Scheme | None]] = {}
    groups = [(g[0].rpartition(".")[0], g) for g in fused_parts(sorted(quantized))]
    groups += [(k, v) for k, v in _experts_of(quantized).items()]
    for key, members in sorted(groups):
        for m in members:
            s = smap.of(m)
            other, os_ = first.setdefault(key, (m, s))
            if os_ is not s:
                problems.append(
                    f"{key}: {other} is {os_.name if os_ else 'unquantized'} but {m} is "
                    f"{s.name if s else 'unquantized'} (clients load them as one weight)"
                )
                break


def _experts_of(quantized: set[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m in sorted(quantized):
        hit = _EXPERT.match(m)
        if hit:
            out.setdefault(hit["experts"], []).append(m)
    return out


def _check_fused_globals(
    smap: SchemeMap, quantized: set[str], tensors: dict, problems: list[str]
) -> None:
    """NVFP4: vLLM keeps one global scale for a fused weight (the largest of the parts'), so
    parts with different ones are served scaled by the ratio of their amaxes: garbage."""
    for group in sorted(fused_parts(sorted(quantized))):
        scheme = smap.of(group[0])
        if scheme is None or not scheme.packed:
            continue
        parent = group[0].rpartition(".")[0]
        leaves = [m.rpartition(".")[2] for m in group]
        ts = [tensors.get(f"{parent}.{leaf}.{scheme.global_leaf}") for leaf in sorted(leaves)]
        if len(ts) < 2 or any(t is None or t.nbytes != 4 or t.dtype != "F32" for t in ts):
            continue  # a missing or malformed one is reported by _check_module
        vals = [float(v[0]) for v in (_decode(b, "F32") for b in _read_many(ts))]
        if len(set(vals)) > 1:
            parts = ", ".join(
                f"{leaf} {v:.6g}" for leaf, v in zip(sorted(leaves), vals, strict=True)
            )
            problems.append(
                f"{parent}: {scheme.global_leaf} differs between fused linears ({parts}): vLLM "
                "dequantizes the fused weight with the largest one, the others come out scaled wrong"
            )


def _check_experts(quantized: set[str], cfg: dict, problems: list[str]) -> int:
    layers: dict[str, dict[int, set[str]]] = {}
    for m in quantized:
        hit = _EXPERT.match(m)
        if hit:
            layers.setdefault(hit["experts"], {}).setdefault(int(hit["e"]), set()).add(hit["proj"])
    n_cfg = next(
        (cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in cfg),
        None,
    )
    count = 0
    for prefix, experts in sorted(layers.items()):
        n = n_cfg if isinstance(n_cfg, int) else max(experts) + 1
        projs = set().union(*experts.values())
        absent = [e for e in range(n) if experts.get(e) != projs]
        if absent:
            e = absent[0]
            lack = sorted(projs - experts.get(e, set()))
            problems.append(
                f"{prefix}: expert {e} lacks quantized {', '.join(lack)} "
                f"({len(absent)} of {n} experts incomplete)"
            )
        count += sum(len(p) for p in experts.values())
    return count


def _check_kv(scheme: Scheme, tensors: dict, attn: list[str], problems: list[str]) -> bool:
    def names(a: str) -> list[str]:
        if scheme.kv_names == "modelopt":
            return [f"{a}.k_proj.k_scale", f"{a}.v_proj.v_scale"]
        return [f"{a}.k_scale", f"{a}.v_scale"]

    present = [n for a in attn for n in names(a) if n in tensors]
    if not scheme.kv:
        if present:
            problems.append(f"{present[0]}: KV-cache scales present but no kv_cache_scheme")
        return False
    for a in attn:
        for n in names(a):
            if n not in tensors:
                problems.append(f"{n}: missing (the config asks for FP8 KV-cache scales)")
            else:
                _check_scale(n, tensors[n], allow_zero=False, problems=problems)
    return True


# -- the whole dir -----------------------------------------------------------------------------


def check_export(path: str | Path, *, max_problems: int = 50) -> CheckResult:
    """Validate an export dir (see the module doc); never raises for a bad export."""
    root = Path(path)
    res = CheckResult(path=str(path))
    p = res.problems
    try:
        cfg = json.loads((root / "config.json").read_text())
        qc = cfg.get("quantization_config") or _legacy_modelopt(root)
    except FileNotFoundError:
        p.append(f"{root / 'config.json'}: missing")
        return res
    except (ValueError, TypeError, AttributeError, OSError) as exc:
        p.append(f"config.json: not readable ({type(exc).__name__})")
        return res
    if not isinstance(qc, dict):
        p.append("config.json: no quantization_config: not a quantized export")
        return res
    res.layout = str(qc.get("quant_method", ""))
    if res.layout == "compressed-tensors":
        smap = ct_schemes(qc, p)
    elif res.layout == "modelopt":
        smap = modelopt_schemes(root, qc, p)
    else:
        p.append(
            f"config.json: quant_method {res.layout!r} (checked: compressed-tensors, modelopt)"
        )
        return res
    if not isinstance(qc.get("ignore", []), list):
        p.append("config.json: quantization_config.ignore is not a list")
    tensors = _tensors(root, p)
    if smap is None or not tensors:
        return res
    res.scheme = smap.name
    with _FILES.kept_open():
        _check_tensors(res, smap, cfg, qc, tensors)
        _settle_scales(p)
    del p[max_problems:]
    return res


def _legacy_modelopt(root: Path) -> dict | None:
    """Older ModelOpt exports describe themselves in hf_quant_config.json alone (vLLM reads it
    when config.json has no quantization_config): the flat config that file stands for."""
    try:
        q = json.loads((root / MODELOPT_FILE).read_text())["quantization"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    flat = {"quant_method": "modelopt", "quant_algo": q.get("quant_algo")}
    flat["ignore"] = q.get("exclude_modules") or []
    if q.get("kv_cache_quant_algo"):
        flat["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return flat


def _check_tensors(res: CheckResult, smap: SchemeMap, cfg: dict, qc: dict, tensors: dict) -> None:
    p = res.problems
    ignored = _ignored_by(list(qc.get("ignore") or []), res.layout)
    quantized: set[str] = set()
    codes = {s.codes_leaf for s in smap.schemes}
    code_dtypes = {"F8_E4M3", "U8"} | {s.codes_dtype for s in smap.schemes}
    for name, t in sorted(tensors.items()):
        module, _, leaf = name.rpartition(".")
        if leaf in codes and t.dtype in code_dtypes:
            scheme = smap.of(module)
            quantized.add(module)
            if scheme is not None and leaf != scheme.codes_leaf:
                p.append(
                    f"{name}: {t.dtype} codes, but the config quantizes {module} as "
                    f"{scheme.name} (its codes are {scheme.codes_leaf})"
                )
                continue
            if ignored(module):
                p.append(f"{module}: quantized, but the ignore list names it")
            if scheme is None:
                p.append(f"{module}: quantized, but no scheme of the config covers it")
                continue
            _check_module(module, t, scheme, tensors, p)
        elif leaf == "weight" and len(t.shape) == 2 and not _is_embedding(module):
            res.unquantized += 1
            if not ignored(module):
                p.append(
                    f"{module}: {t.dtype} weight not in the ignore list (clients would load it "
                    "as quantized)"
                )
    scale_leaves = {WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE}
    scale_leaves |= {leaf for s in smap.schemes for leaf in (s.global_leaf, s.input_leaf)}
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf in scale_leaves and module not in quantized:
            p.append(f"{name}: a scale for {module}, which is not quantized")
    _check_fused(quantized, p)
    _check_fused_schemes(smap, quantized, p)
    _check_fused_globals(smap, quantized, tensors, p)
    res.experts = _check_experts(quantized, cfg, p)
    tail = ".k_proj.weight"
    attn = sorted({m[: -len(tail)] for m in tensors if m.endswith(tail)})
    res.kv = _check_kv(smap.first, tensors, attn, p)
    res.quantized = len(quantized)
    if not quantized:
        p.append("no quantized weight in the export")
