"""``convert`` of a quantized HF dir into a plain one: every weight dequantized with its scales.

Streaming: one source tensor in flight (read, dequantized in float32, rounded once to the
output dtype), written by the shard writer that export and ``convert --to hf`` use. The output
is what ``save_pretrained`` of the dequantized model would write: the same tensor names,
``config.json`` without its ``quantization_config`` and with the output dtype, the tokenizer and
generation files carried over, shards with ``model.safetensors.index.json`` past
``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from qckpt.errors import CheckpointError
from qckpt.outputs import EXPORT_MARKER
from qckpt.storage.files import read_json

# files of a quantized dir that describe the quantization (or, the marker, that qckpt exported
# it: a dequantized copy is no export, and export.overwrite must not take it for one)
_QUANT_FILES = {"hf_quant_config.json", "model.safetensors.index.json", EXPORT_MARKER}


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _carry_files(src: Path, dst: Path, dtype: torch.dtype) -> None:
    for f in src.iterdir():
        if not f.is_file() or f.suffix == ".safetensors" or f.name in _QUANT_FILES:
            continue
        if f.name == "config.json":
            cfg = read_json(f, what="model config")
            cfg.pop("quantization_config", None)
            name = str(dtype).replace("torch.", "")
            for key in ("torch_dtype", "dtype"):
                if key in cfg:
                    cfg[key] = name
            (dst / f.name).write_text(json.dumps(cfg, indent=2))
        else:
            shutil.copyfile(f, dst / f.name)


@dataclass(frozen=True)
class _Out:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def dequantize_dir(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
) -> dict[str, object]:
    """Write the dequantized checkpoint of the quantized HF dir ``src`` into ``dst`` (which
    must exist and be empty). Returns {layout, tensors, dequantized, bytes, files}."""
    from qckpt.read.sources import SafetensorsSource
    from qckpt.storage.shards import plan_shards, write_shards

    srcp, out = Path(src), Path(dst)
    source = SafetensorsSource(srcp)
    layout = source.layout()
    if layout is None or not layout.quantized:
        raise CheckpointError(f"{srcp}: not a quantized checkpoint; nothing to dequantize")
    entries = source.entries()
    outs = [
        _Out(e.name, dtype if e.torch_dtype.is_floating_point else e.torch_dtype, e.shape)
        for e in entries
    ]
    plan = plan_shards(([o] for o in outs), max_shard_bytes, single_file_name=True)
    tensors = (
        (o.name, t.to(o.dtype))
        for o, (_, t) in zip(outs, source.iter_tensors(entries), strict=True)
    )
    total = write_shards(out, plan, tensors, metadata={"format": "pt"})
    _carry_files(srcp, out, dtype)
    return {
        "layout": layout.describe(),
        "tensors": len(entries),
        "dequantized": sum(1 for e in entries if e.scales),
        "bytes": total,
        "files": len(plan.files),
    }
