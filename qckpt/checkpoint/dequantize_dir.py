"""``convert`` of a quantized HF dir into a plain one: every weight dequantized with its scales.

Streaming: one source tensor in flight (read, dequantized in float32, rounded once to the
output dtype) and at most one output shard in memory. The output is what ``save_pretrained``
of the dequantized model would write: the same tensor names, ``config.json`` without its
``quantization_config`` and with the output dtype, the tokenizer and generation files carried
over, shards with ``model.safetensors.index.json`` past ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from qckpt.errors import CheckpointError
from qckpt.outputs import EXPORT_MARKER

# files of a quantized dir that describe the quantization (or, the marker, that qckpt exported
# it: a dequantized copy is no export, and export.overwrite must not take it for one)
_QUANT_FILES = {"hf_quant_config.json", "model.safetensors.index.json", EXPORT_MARKER}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _carry_files(src: Path, dst: Path, dtype: torch.dtype) -> None:
    for f in src.iterdir():
        if not f.is_file() or f.suffix == ".safetensors" or f.name in _QUANT_FILES:
            continue
        if f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("quantization_config", None)
            name = str(dtype).replace("torch.", "")
            for key in ("torch_dtype", "dtype"):
                if key in cfg:
                    cfg[key] = name
            (dst / f.name).write_text(json.dumps(cfg, indent=2))
        else:
            shutil.copyfile(f, dst / f.name)


def dequantize_dir(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
) -> dict[str, object]:
    """Write the dequantized checkpoint of the quantized HF dir ``src`` into ``dst`` (which
    must exist and be empty). Returns {layout, tensors, dequantized, bytes, files}."""
    from safetensors.torch import save_file

    from qckpt.checkpoint.export_source import list_entries, read_entry

    srcp, out = Path(src), Path(dst)
    fmt, entries = list_entries(srcp, "safetensors")
    from qckpt.checkpoint.hf_reader import hf_index
    from qckpt.checkpoint.quantized_sources import source_layout

    layout = source_layout(srcp, hf_index(srcp))
    if not layout.quantized:
        raise CheckpointError(f"{srcp}: not a quantized checkpoint; nothing to dequantize")
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, dequantized = 0, 0, 0
    files: list[tuple[Path, list[str]]] = []

    def flush() -> None:
        p = out / f".shard-{len(files):05d}.safetensors"
        save_file(shard, str(p), metadata={"format": "pt"})
        files.append((p, list(shard)))
        shard.clear()

    for e in entries:
        t = read_entry(e, srcp, fmt)
        if e.quant is not None or t.dtype.is_floating_point:
            t = t.to(dtype)
        dequantized += e.quant is not None
        n = t.numel() * t.element_size()
        if shard and shard_bytes + n > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[e.name] = t.contiguous()
        shard_bytes += n
        total += n
        del t
    if shard or not files:
        flush()
    _name_shards(out, files, total)
    _carry_files(srcp, out, dtype)
    return {
        "layout": layout.describe(),
        "tensors": len(entries),
        "dequantized": dequantized,
        "bytes": total,
        "files": len(files),
    }


def _name_shards(out: Path, files: list[tuple[Path, list[str]]], total: int) -> None:
    if len(files) == 1:
        files[0][0].replace(out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, (p, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        p.replace(out / final)
        weight_map.update({k: final for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
