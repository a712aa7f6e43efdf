"""What a path holds: a DCP dir, an HF safetensors dir (plain or a quantized export), a
calibration file, or a single safetensors file. Reads headers and metadata only, except for the
(small) amax tensors of a calibration file."""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

from qckpt.errors import CheckpointError
from qckpt.read.detect import TITAN_KEY, is_dcp_dir
from qckpt.read.sources import DCPSource, SafetensorsSource
from qckpt.storage import safetensors as stio
from qckpt.storage.dcp_structure import Kinds, check_data_files, structure_problem
from qckpt.storage.files import open_regular, read_json

# Importing this module must not import torch: inspecting an HF dir or a calibration file reads
# JSON headers (and a few float32 values) only. A plain DCP dir's metadata is unpickled here
# into inert stand-ins of DCP's classes (``light_dcp``); what that reader does not know (a
# training framework's checkpoint, a class it does not admit, a problem) goes to the full reader
# (``checkpoint.safe_metadata``, torch's classes), which also words every error.


def _summarize_tensors(entries: dict[str, dict]) -> dict[str, Any]:
    dtypes = Counter(e["dtype"] for e in entries.values())
    nbytes = sum(
        math.prod(e["shape"]) * stio.DTYPES.get(e["dtype"], (0, ""))[0] for e in entries.values()
    )
    largest = max(entries.items(), key=lambda kv: math.prod(kv[1]["shape"]), default=(None, None))
    return {
        "tensors": len(entries),
        "bytes": nbytes,
        "dtypes": dict(sorted(dtypes.items())),
        "largest": {"name": largest[0], "shape": list(largest[1]["shape"])} if largest[0] else None,
    }


def _header_entries(header: stio.Header) -> dict[str, dict]:
    return {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in header.tensors}


def _json_meta(path: Path, meta: dict[str, str], key: str) -> Any:
    try:
        return json.loads(meta.get(key, "{}"))
    except ValueError:
        raise CheckpointError(f"{path}: corrupt calibration metadata {key!r} (not JSON)") from None


def _amax_values(header: stio.Header) -> dict[str, list[float]] | None:
    """Every tensor's float32 values, read without torch (None if one is not float32)."""
    if any(t.dtype != "F32" for t in header.tensors):
        return None
    out: dict[str, list[float]] = {}
    with open_regular(header.path) as f:
        for t in header.tensors:
            f.seek(t.begin)
            a = array("f")
            a.frombytes(f.read(t.nbytes))
            out[t.name] = a.tolist()
    return out


def inspect_calibration(path: Path, header: stio.Header) -> dict[str, Any]:
    meta = header.metadata
    values = _amax_values(header) if meta.get("qckpt_calibration") == "1" else None
    if values is None:  # another file version or dtype: the full reader says what is wrong
        from qckpt.calib.state_file import load_calibration

        st = load_calibration(path)
        values = {k: v.flatten().tolist() for k, v in st.amax.items()}
    quantizers = _json_meta(path, meta, "quantizers")
    zeros = sorted(k for k, v in values.items() if v and max(abs(x) for x in v) == 0.0)
    calibrated = sum(1 for q in quantizers.values() if q.get("calibrated", True))
    shared = sum(1 for q in quantizers.values() if q.get("shared"))
    maxes = [max(v) for v in values.values() if v]
    return {
        "kind": "calibration",
        "path": str(path),
        "model_type": meta.get("model_type", ""),
        "model_fingerprint": meta.get("model_fingerprint", ""),
        "quant": _json_meta(path, meta, "quant"),
        "quantizers": len(quantizers) or len(values),
        "calibrated": calibrated if quantizers else len(values),
        "amax_values": len(values),
        "shared_from_layer": shared,
        "zero_amax": zeros,
        "amax_min": min(maxes) if maxes else None,
        "amax_max": max(maxes) if maxes else None,
    }


class _Inert:
    """A stand-in for one of DCP's metadata dataclasses: keeps the pickle's state as fields."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # a dataclass with __slots__
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
        self.__dict__.update(state)


class _TensorProperties(_Inert):
    def __setstate__(self, state: Any) -> None:  # DCP pickles it as a 5-tuple, dtype first
        if not isinstance(state, tuple) or len(state) != 5:
            raise pickle.UnpicklingError("unexpected TensorProperties state")
        self.dtype = state[0]


class _Size(tuple):
    pass


class _Dtype(str):
    """``torch.<name>`` as its name."""


_DCP_MD = "torch.distributed.checkpoint.metadata"
_LIGHT_CLASSES: dict[tuple[str, str], Any] = {
    (_DCP_MD, name): type(name, (_Inert,), {})
    for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "StorageMeta",
    )
}  # fmt: skip
_LIGHT_CLASSES.update(
    {
        (_DCP_MD, "TensorProperties"): _TensorProperties,
        (_DCP_MD, "_MEM_FORMAT_ENCODING"): int,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): type(
            "_StorageInfo", (_Inert,), {}
        ),
        ("torch", "Size"): _Size,
        ("torch.serialization", "_get_layout"): str,  # a layout by name ("torch.strided")
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("collections", "OrderedDict"): dict,
        # StorageMeta's checkpoint_id, pickled as a path of its parts (inert data)
        ("pathlib", "PosixPath"): lambda *parts: "/".join(parts),
        ("pathlib", "PurePosixPath"): lambda *parts: "/".join(parts),
    }
)
# the dtypes a checkpoint holds (pickled by name); any other goes to the full reader
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "bool", "uint8",
    "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
)  # fmt: skip
_LIGHT_CLASSES.update({("torch", n): _Dtype(n) for n in _DTYPE_NAMES})
_LIGHT_CLASSES[("torch", "strided")] = "torch.strided"


_LIGHT_KINDS = Kinds(
    is_tensor=lambda m: type(m) is _LIGHT_CLASSES[(_DCP_MD, "TensorStorageMetadata")],
    is_bytes=lambda m: type(m) is _LIGHT_CLASSES[(_DCP_MD, "BytesStorageMetadata")],
    is_dtype=lambda d: isinstance(d, _Dtype),
)


class _NotLight(Exception):
    """The light reader steps aside: the full one reads (and words any error)."""


class _LightUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _LIGHT_CLASSES.get((module, name))
        if obj is None:
            raise _NotLight(f"{module}.{name}")
        return obj


def light_dcp(path: Path) -> dict[str, dict] | None:
    """A plain DCP dir's tensors ({name: dtype, shape, chunks}) and its byte entries' count
    (under ``""``), read without torch; None where the full reader must decide: a training
    framework's dir, a class or dtype not admitted here, anything the full reader would refuse
    (structure, data files: then it says why)."""
    if (path / "metadata.json").exists() or (path / "latest_checkpointed_iteration.txt").exists():
        return None  # maybe Megatron's
    try:
        with open_regular(path / ".metadata") as f:
            md = _LightUnpickler(io.BytesIO(f.read())).load()
    except Exception:  # noqa: BLE001 - unknown, unsafe or corrupt: the full reader says which
        return None
    if type(md) is not _LIGHT_CLASSES[(_DCP_MD, "Metadata")]:
        return None
    # the full reader's own checks, on the stand-ins: any problem and it reads (and words it)
    if structure_problem(md, _LIGHT_KINDS):
        return None
    try:
        check_data_files(path, md)
    except CheckpointError:
        return None
    entries: dict[str, dict] = {}
    other = 0
    for name, m in md.state_dict_metadata.items():
        if TITAN_KEY.match(name):
            return None
        if not _LIGHT_KINDS.is_tensor(m):
            other += 1
            continue
        dtype = m.properties.dtype
        code = next((k for k, (_, a) in stio.DTYPES.items() if a == dtype), str(dtype))
        entries[name] = {"dtype": code, "shape": list(m.size), "chunks": len(m.chunks)}
    entries[""] = {"non_tensor_items": other}
    return entries


def _dcp_entries(path: Path, light: dict[str, dict] | None) -> tuple[dict[str, dict], int]:
    """{name: dtype, shape, chunks} of a DCP dir's tensors, and how many byte entries it has."""
    if light is not None:
        return light, light.pop("")["non_tensor_items"]
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = DCPSource(path).dcp_metadata()
    entries = {}
    other = 0
    for name, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            code = stio.dtype_code(m.properties.dtype).removeprefix("torch.")
            entries[name] = {"dtype": code, "shape": list(m.size), "chunks": len(m.chunks)}
        else:
            other += 1
    return entries, other


def inspect_dcp(path: Path, light: dict[str, dict] | None = None) -> dict[str, Any]:
    """``light``: what ``light_dcp`` read of it, when it could (else torch's classes read)."""
    entries, other = _dcp_entries(path, light if light is not None else light_dcp(path))
    out = {
        "kind": "dcp",
        "path": str(path),
        **_summarize_tensors(entries),
        "non_tensor_items": other,
    }
    out["files"] = len(list(path.glob("*.distcp")))
    out["max_chunks_per_tensor"] = max((e["chunks"] for e in entries.values()), default=0)
    cfg = path / "config.json"
    if cfg.exists():
        out["model_type"] = read_json(cfg, what="model config").get("model_type")
    return out


def inspect_training(path: Path, framework: str, model: str | None = None) -> dict[str, Any]:
    """A Megatron-Core / torchtitan checkpoint: framework, version, architecture, stacking,
    and with ``model`` the HF tensors it maps onto (count) and what is left over (named)."""
    from qckpt.layouts.training import architecture, stacking
    from qckpt.read.detect import resolve_iteration
    from qckpt.read.training_sources import TrainingSource, stored_tensors

    root = resolve_iteration(path)
    src_md = DCPSource(root).dcp_metadata()
    shapes, _, _ = stored_tensors(src_md, framework)
    out: dict[str, Any] = {"kind": framework, "path": str(root), "framework": framework}
    out.update(architecture(framework, shapes))
    out["stacking"] = stacking(set(shapes))
    out["byte_entries"] = len(src_md.state_dict_metadata) - len(shapes)
    out["files"] = len(list(root.glob("*.distcp")))
    if model is None:
        out["mapped_tensors"] = "pass --model (an HF config) to map the tensors"
        return out
    from qckpt.models.build import load_config

    src = TrainingSource(root, framework, load_config(model))
    out.update(src.checkpoint().describe())
    out["model"] = str(model)
    return out


def inspect_hf_dir(path: Path, layout: bool = True) -> dict[str, Any]:
    """``layout=False``: no ``source_layout`` (how qckpt would read the dir as a source): a
    quantized dir's layout is told from torch dtypes, and the one-line summary does not show
    it."""
    if not stio.has_safetensors(path):
        raise CheckpointError(f"{path}: no .metadata (DCP) and no *.safetensors (HF) here")
    src = SafetensorsSource(path)
    entries = {e.name: {"dtype": e.dtype, "shape": list(e.shape)} for e in src.stored()}
    shard_meta = src.metadata()
    out: dict[str, Any] = {"kind": "hf", "path": str(path), "files": len(src.files())}
    out.update(_summarize_tensors(entries))
    out.update(_quant_summary(path))
    schemes = export_schemes(path, entries)
    if len(schemes) > 1:  # a mixed export; a one-scheme one reads as it did before
        out["schemes"] = schemes
    out["scales"] = sum(1 for k in entries if k.endswith(("_scale", "_scale_2", "_scales")))
    cfg = read_json(path / "config.json") if (path / "config.json").exists() else {}
    if layout:
        out["source_layout"] = _source_layout(src, cfg)
    if (path / stio.INDEX_NAME).exists():
        out["index"] = True
    if shard_meta:
        out["shard_metadata"] = shard_meta
    return out


def _quant_summary(path: Path) -> dict[str, Any]:
    """model_type and, for an export, its quantization config (config.json, hf_quant_config)."""
    out: dict[str, Any] = {}
    if (path / "config.json").exists():
        cfg = read_json(path / "config.json", what="model config")
        out["model_type"] = cfg.get("model_type")
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict) and qc:
            out["kind"] = "export"
            out["quant_method"] = qc.get("quant_method")
            out["quant_format"] = qc.get("format")
            groups = qc.get("config_groups") or {}
            out["config_groups"] = {
                g: {
                    "weights": _get(v, "weights", "strategy"),
                    "inputs": _get(v, "input_activations", "strategy"),
                    "dynamic_inputs": _get(v, "input_activations", "dynamic"),
                }
                for g, v in (groups.items() if isinstance(groups, dict) else [])
            }
            out["ignore"] = (
                qc.get("ignore") or qc.get("exclude_modules") or qc.get("modules_to_not_convert")
            )
    if (path / "hf_quant_config.json").exists():
        q = read_json(path / "hf_quant_config.json", what="ModelOpt config")
        q = q.get("quantization") if isinstance(q.get("quantization"), dict) else {}
        out["kind"] = "export"
        out["quant_method"] = out.get("quant_method") or "modelopt"
        out["quant_algo"] = q.get("quant_algo")
    return out


# (num_bits, type) of a compressed-tensors quantization args -> the scheme's name
_CT_NAMES = {(4, "float"): "NVFP4", (8, "float"): "FP8", (8, "int"): "INT8", (4, "int"): "INT4"}
# stored leaves that mark a quantized linear's weight (codes beside scales)
_QUANT_LEAVES = (".weight_scale", ".weight_packed", ".weight_scale_inv")


def _ct_args(args: Any) -> str:
    if not isinstance(args, dict):
        return "unquantized"
    name = _CT_NAMES.get((args.get("num_bits"), args.get("type")), f"{args.get('num_bits')}-bit")
    strategy = args.get("strategy")
    if args.get("block_structure"):
        strategy = "block " + "x".join(str(b) for b in args["block_structure"])
    dyn = args.get("dynamic")
    when = "dynamic" if dyn is True else ("static" if dyn in (False, "local") else "")
    return " ".join(str(x) for x in (name, strategy, when) if x)


def _ct_matcher(targets: list[str]) -> Any:
    regs = [re.compile(t[3:]) for t in targets if t.startswith("re:")]
    names = {t for t in targets if not t.startswith("re:")}

    def match(module: str) -> bool:
        # a class-name target (Linear) takes every linear that no earlier group took
        return module in names or "Linear" in names or any(r.match(module) for r in regs)

    return match


def export_schemes(path: Path, entries: dict[str, dict]) -> dict[str, str]:
    """Each scheme of an export with how many of its linears it holds: a compressed-tensors
    ``config_groups`` entry (weights / inputs), or a ModelOpt ``quant_algo`` (each
    ``quantized_layers`` entry's of a ``MIXED_PRECISION`` one). Empty for no export."""
    quantized = sorted({k.rsplit(".", 1)[0] for k in entries if k.endswith(_QUANT_LEAVES)})
    out: dict[str, str] = {}
    cfg = read_json(path / "config.json") if (path / "config.json").exists() else {}
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    if isinstance(groups, dict) and groups:
        left = list(quantized)
        for g, v in groups.items():
            if not isinstance(v, dict):
                continue
            match = _ct_matcher([str(t) for t in v.get("targets") or []])
            mine = [m for m in left if match(m)]
            left = [m for m in left if m not in mine]
            w, i = _ct_args(v.get("weights")), _ct_args(v.get("input_activations"))
            out[g] = f"{w} weights, {i} inputs: {len(mine)} linears"
        return out
    hq = path / "hf_quant_config.json"
    if not hq.exists():
        return out
    q = read_json(hq, what="ModelOpt config").get("quantization") or {}
    layers = q.get("quantized_layers") if isinstance(q, dict) else None
    counts: dict[str, int] = {}
    if isinstance(layers, dict) and layers:
        for v in layers.values():
            algo = str(v.get("quant_algo") if isinstance(v, dict) else v)
            counts[algo] = counts.get(algo, 0) + 1
    elif isinstance(q, dict) and q.get("quant_algo"):
        counts[str(q["quant_algo"])] = len(quantized)
    return {algo: f"{n} linears" for algo, n in counts.items()}


def _get(d: Any, key: str, leaf: str) -> Any:
    inner = d.get(key) if isinstance(d, dict) else None
    return inner.get(leaf) if isinstance(inner, dict) else None


def _source_layout(src: SafetensorsSource, cfg: dict[str, Any]) -> dict[str, Any]:
    """How qckpt reads the dir as a source: its layout and scales, or why it refuses it."""
    try:
        layout = src.layout()
    except CheckpointError as exc:
        return {"layout": "unknown", "refused": str(exc)}
    if layout is not None:
        return layout.summary()
    # nothing quantized: the summary qckpt.layouts gives a plain dir, without torch
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return {
        "layout": "plain",
        "detail": "",
        "quantized_weights": 0,
        "scales": {},
        "hidden_tensors": 0,
        "dequantized_dtype": dtype if dtype in ("float16", "float32", "float64") else "bfloat16",
    }


def inspect_path(
    path: str | Path, model: str | None = None, *, layout: bool = True
) -> dict[str, Any]:
    """Describe what ``path`` holds; one-line CheckpointError when it holds nothing we know.
    ``model`` (a built-in name or an HF config dir): the config a training checkpoint's
    tensors map onto (then the mapped tensors are counted and every leftover named).
    ``layout=False``: an HF dir's ``source_layout`` left out (``inspect_hf_dir``)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_dir():
        from qckpt.read.detect import TRAINING_FORMATS, detect_format

        if is_dcp_dir(p) or (p / "latest_checkpointed_iteration.txt").is_file():
            light = light_dcp(p) if is_dcp_dir(p) else None
            if light is not None:
                return inspect_dcp(p, light)  # a plain DCP dir (no framework's): without torch
            fmt = detect_format(p)
            if fmt in TRAINING_FORMATS:
                return inspect_training(p, fmt, model)
            return inspect_dcp(p)
        return inspect_hf_dir(p, layout)
    header = stio.read_header(p)
    if header.metadata.get("qckpt_calibration"):
        return inspect_calibration(p, header)
    return {
        "kind": "safetensors",
        "path": str(p),
        **_summarize_tensors(_header_entries(header)),
        "metadata": header.metadata,
    }
