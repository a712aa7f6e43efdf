"""What a path holds: a DCP dir, an HF safetensors dir (plain or a quantized export), a
calibration file, or a single safetensors file. Reads headers and metadata only, except for the
(small) amax tensors of a calibration file."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from qckpt.checkpoint.export_source import read_safetensors_header
from qckpt.errors import CheckpointError

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1,
    "I16": 2, "I32": 4, "I64": 8, "BOOL": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip


def _safetensors_header(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensor name -> {dtype, shape}, metadata) from the JSON header, without reading data."""
    header, _ = read_safetensors_header(path)
    meta = header.pop("__metadata__", None) or {}
    return header, meta


def _summarize_tensors(entries: dict[str, dict]) -> dict[str, Any]:
    dtypes = Counter(e["dtype"] for e in entries.values())
    nbytes = sum(math.prod(e["shape"]) * _DTYPE_BYTES.get(e["dtype"], 0) for e in entries.values())
    largest = max(entries.items(), key=lambda kv: math.prod(kv[1]["shape"]), default=(None, None))
    return {
        "tensors": len(entries),
        "bytes": nbytes,
        "dtypes": dict(sorted(dtypes.items())),
        "largest": {"name": largest[0], "shape": list(largest[1]["shape"])} if largest[0] else None,
    }


def inspect_calibration(path: Path, meta: dict[str, str]) -> dict[str, Any]:
    from qckpt.calib.state_file import load_calibration

    st = load_calibration(path)
    values = {k: v for k, v in st.amax.items()}
    zeros = sorted(k for k, v in values.items() if v.numel() and float(v.abs().max()) == 0.0)
    calibrated = sum(1 for q in st.quantizers.values() if q.get("calibrated", True))
    shared = sum(1 for q in st.quantizers.values() if q.get("shared"))
    maxes = [float(v.max()) for v in values.values() if v.numel()]
    return {
        "kind": "calibration",
        "path": str(path),
        "model_type": st.model_type,
        "model_fingerprint": st.model_fingerprint,
        "quant": st.quant,
        "quantizers": len(st.quantizers) or len(values),
        "calibrated": calibrated if st.quantizers else len(values),
        "amax_values": len(values),
        "shared_from_layer": shared,
        "zero_amax": zeros,
        "amax_min": min(maxes) if maxes else None,
        "amax_max": max(maxes) if maxes else None,
    }


def inspect_dcp(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from qckpt.checkpoint.safe_metadata import read_metadata_file

    md = read_metadata_file(path / ".metadata")
    entries = {}
    other = 0
    for name, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            dt = str(m.properties.dtype).replace("torch.", "")
            code = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", "int64": "I64",
                    "float8_e4m3fn": "F8_E4M3", "uint8": "U8"}.get(dt, dt)  # fmt: skip
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
    if cfg.is_file():
        out["model_type"] = json.loads(cfg.read_text()).get("model_type")
    return out


def inspect_hf_dir(path: Path) -> dict[str, Any]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .metadata (DCP) and no *.safetensors (HF) here")
    entries: dict[str, dict] = {}
    shard_meta: dict[str, str] = {}
    for f in files:
        h, meta = _safetensors_header(f)
        entries.update(h)
        shard_meta.update(meta)
    out: dict[str, Any] = {"kind": "hf", "path": str(path), "files": len(files)}
    out.update(_summarize_tensors(entries))
    cfg_path = path / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        out["model_type"] = cfg.get("model_type")
        qc = cfg.get("quantization_config")
        if qc:
            out["kind"] = "export"
            out["quant_method"] = qc.get("quant_method")
            out["quant_format"] = qc.get("format")
            groups = qc.get("config_groups") or {}
            out["config_groups"] = {
                g: {
                    "weights": (v.get("weights") or {}).get("strategy"),
                    "inputs": (v.get("input_activations") or {}).get("strategy"),
                    "dynamic_inputs": (v.get("input_activations") or {}).get("dynamic"),
                }
                for g, v in groups.items()
            }
            out["ignore"] = qc.get("ignore") or qc.get("exclude_modules")
    hq = path / "hf_quant_config.json"
    if hq.is_file():
        q = json.loads(hq.read_text()).get("quantization", {})
        out["kind"] = "export"
        out["quant_method"] = out.get("quant_method") or "modelopt"
        out["quant_algo"] = q.get("quant_algo")
    out["scales"] = sum(1 for k in entries if k.endswith(("_scale", "_scale_2")))
    out["source_layout"] = _source_layout(path)
    if (path / "model.safetensors.index.json").is_file():
        out["index"] = True
    if shard_meta:
        out["shard_metadata"] = shard_meta
    return out


def _source_layout(path: Path) -> dict[str, Any]:
    """How qckpt reads the dir as a source: its layout and scales, or why it refuses it."""
    from qckpt.checkpoint.hf_reader import hf_index
    from qckpt.checkpoint.quantized_sources import source_layout

    try:
        return source_layout(path, hf_index(path)).summary()
    except CheckpointError as exc:
        return {"layout": "unknown", "refused": str(exc)}


def inspect_path(path: str | Path) -> dict[str, Any]:
    """Describe what ``path`` holds; one-line CheckpointError when it holds nothing we know."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_dir():
        if (p / ".metadata").is_file():
            return inspect_dcp(p)
        return inspect_hf_dir(p)
    header, meta = _safetensors_header(p)
    if meta.get("qckpt_calibration"):
        return inspect_calibration(p, meta)
    return {"kind": "safetensors", "path": str(p), **_summarize_tensors(header), "metadata": meta}
