"""What a path holds: a DCP dir, an HF safetensors dir (plain or a quantized export), a
calibration file, or a single safetensors file. Reads headers and metadata only, except for the
(small) amax tensors of a calibration file."""

from __future__ import annotations

import json
import math
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

from qckpt.errors import CheckpointError
from qckpt.read.detect import is_dcp_dir
from qckpt.read.sources import DCPSource, SafetensorsSource
from qckpt.storage import safetensors as stio
from qckpt.storage.files import open_regular, read_json

# Importing this module must not import torch: inspecting an HF dir or a calibration file reads
# JSON headers (and a few float32 values) only. DCP metadata needs torch's classes to unpickle.


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


def inspect_dcp(path: Path) -> dict[str, Any]:
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


def inspect_hf_dir(path: Path) -> dict[str, Any]:
    if not stio.has_safetensors(path):
        raise CheckpointError(f"{path}: no .metadata (DCP) and no *.safetensors (HF) here")
    src = SafetensorsSource(path)
    entries = {e.name: {"dtype": e.dtype, "shape": list(e.shape)} for e in src.stored()}
    shard_meta = src.metadata()
    out: dict[str, Any] = {"kind": "hf", "path": str(path), "files": len(src.files())}
    out.update(_summarize_tensors(entries))
    out.update(_quant_summary(path))
    out["scales"] = sum(1 for k in entries if k.endswith(("_scale", "_scale_2")))
    cfg = read_json(path / "config.json") if (path / "config.json").exists() else {}
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
            out["ignore"] = qc.get("ignore") or qc.get("exclude_modules")
    if (path / "hf_quant_config.json").exists():
        q = read_json(path / "hf_quant_config.json", what="ModelOpt config")
        q = q.get("quantization") if isinstance(q.get("quantization"), dict) else {}
        out["kind"] = "export"
        out["quant_method"] = out.get("quant_method") or "modelopt"
        out["quant_algo"] = q.get("quant_algo")
    return out


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


def inspect_path(path: str | Path, model: str | None = None) -> dict[str, Any]:
    """Describe what ``path`` holds; one-line CheckpointError when it holds nothing we know.
    ``model`` (a built-in name or an HF config dir): the config a training checkpoint's
    tensors map onto (then the mapped tensors are counted and every leftover named)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_dir():
        from qckpt.read.detect import TRAINING_FORMATS, detect_format

        if is_dcp_dir(p) or (p / "latest_checkpointed_iteration.txt").is_file():
            fmt = detect_format(p)
            if fmt in TRAINING_FORMATS:
                return inspect_training(p, fmt, model)
            return inspect_dcp(p)
        return inspect_hf_dir(p)
    header = stio.read_header(p)
    if header.metadata.get("qckpt_calibration"):
        return inspect_calibration(p, header)
    return {
        "kind": "safetensors",
        "path": str(p),
        **_summarize_tensors(_header_entries(header)),
        "metadata": header.metadata,
    }
