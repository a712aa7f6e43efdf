"""The calibration file: one amax per quantizer in safetensors, described by its metadata.

Layout (``calibrate`` writes it, ``export`` and ``inspect`` read it):

* tensors ``{module}.weight_amax`` and ``{module}.input_amax`` (float32), where ``module`` is the
  model's own checkpoint name of the linear (per expert for MoE:
  ``model.layers.0.mlp.experts.3.gate_proj``). Shape ``()`` for per-tensor amax (and the global
  amax of NVFP4), ``[out]`` per channel, ``[ceil(rows/b0), ceil(cols/b1)]`` per block.
* a quantizer that nobody calibrated has no tensor; it is listed in the metadata with
  ``calibrated: false`` so that export can tell "missing" from "never seen".
* ``__metadata__``: ``qckpt_calibration`` (file version), ``model_type``, ``model_fingerprint``
  (hash of the checkpoint's tensor names and shapes), ``quant`` (the recipe's quant section as
  JSON) and ``quantizers`` (JSON: name -> {granularity, format, dtype, calibrated, shared, ...}).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from torch import nn

from qckpt.atomic import write_bytes
from qckpt.errors import CheckpointError
from qckpt.models.naming import hf_tensors
from qckpt.parallel.shard import model_shards

FILE_VERSION = "1"


def model_fingerprint(names_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """A short hash of a checkpoint's tensor names and shapes (in checkpoint naming)."""
    h = hashlib.sha256()
    for name, shape in sorted((n, tuple(int(x) for x in s)) for n, s in names_shapes):
        h.update(f"{name}:{shape};".encode())
    return h.hexdigest()[:16]


def model_names_shapes(model: nn.Module) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The checkpoint names and whole shapes of ``model``'s tensors, also on a rank that holds
    only shards of some (EP experts, TP blocks: their :class:`ShardSpec` has the whole shape)."""
    mtype = getattr(getattr(model, "config", None), "model_type", "") or ""
    shards = model_shards(model)
    for name, t in model.state_dict().items():
        spec = shards.get(name)
        # shapes only: a meta stand-in of the whole shape (no memory, and no op on a
        # quantized tensor, which cannot be sliced per expert)
        t = torch.empty((), device="meta").expand(spec.global_shape if spec else t.shape)
        for n, v in hf_tensors(name, t, mtype):
            yield n, tuple(v.shape)


@dataclass(kw_only=True)
class CalibrationState:
    amax: dict[str, torch.Tensor] = field(default_factory=dict)  # "{module}.{kind}_amax"
    quantizers: dict[str, dict[str, Any]] = field(default_factory=dict)
    model_type: str = ""
    model_fingerprint: str = ""
    quant: dict[str, Any] = field(default_factory=dict)
    # what export needs to know of the model (qckpt.export.model_record); {}: not known
    model: dict[str, Any] = field(default_factory=dict)
    # calibrate.algorithm; "mse" adds ``{module}.weight_clip_amax`` / ``input_clip_amax``: the
    # amaxes the export makes the scales from (``weight_amax`` stays max |w|, the source
    # guard's reference). A file without the key is a max calibration
    algorithm: str = "max"
    # gptq: the sidecar dir of the GPTQ'd weights (absolute once loaded; the file stores its
    # name, beside the file) and its files (qckpt/read/gptq_source.py)
    weights_dir: str = ""
    weights_files: list[str] = field(default_factory=list)
    # this rank's share of the GPTQ'd weights, before they are written (never in the file)
    weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    # the one-value float32 amaxes as Python floats, read from the file in one go
    # (load_calibration): name -> (the tensor it is the value of, its value)
    floats: dict[str, tuple[torch.Tensor, float]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def get(self, module: str, kind: str) -> torch.Tensor | None:
        return self.amax.get(f"{module}.{kind}_amax")

    def float_of(self, key: str) -> float | None:
        """``amax[key]``'s value as a float when it is one known from the file (and the entry
        was not replaced since); None otherwise."""
        got = self.floats.get(key)
        if got is None or self.amax.get(key) is not got[0]:
            return None
        return got[1]


def save_calibration(
    state: CalibrationState, path: str | os.PathLike, key: str = "calibrate.output"
) -> Path:
    """Write atomically (``qckpt.atomic``): a crash, a full disk or Ctrl-C never leaves a half
    file; write failures are one line naming ``key`` and the file. Returns the path written
    (symlinks followed)."""
    meta = {
        "qckpt_calibration": FILE_VERSION,
        "model_type": state.model_type,
        "model_fingerprint": state.model_fingerprint,
        "quant": json.dumps(state.quant, sort_keys=True),
        "quantizers": json.dumps(state.quantizers, sort_keys=True),
    }
    if state.model:
        meta["model"] = json.dumps(state.model, sort_keys=True)
    if state.algorithm != "max":  # a max file is byte for byte what it always was
        meta["algorithm"] = state.algorithm
    if state.weights_dir:
        meta["weights_dir"] = Path(state.weights_dir).name
        meta["weights_files"] = json.dumps(state.weights_files)
    tensors = {k: v.detach().to(torch.float32).cpu() for k, v in state.amax.items()}
    # serialized here and written by Python, so a write error is an OSError naming its errno
    # (safetensors' own file writer reports it as a SafetensorError string)
    return write_bytes(path, f32_file_bytes(tensors, meta), key=key)


def f32_file_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    """The safetensors file of float32 ``tensors`` (host) and ``meta``, as ``safetensors``
    writes it (tensors by name, compact JSON header padded with spaces to 8 bytes; the bytes
    are safetensors' own whenever ``meta`` has one key, whose order it does not fix), made in
    one concatenation: safetensors' ``save`` took 0.2-0.3 s for a file of 6,208 amaxes, a cost
    every rank of a data-parallel run waits for."""
    names = sorted(tensors)
    header: dict[str, object] = {"__metadata__": meta} if meta else {}
    end = 0
    for k in names:
        t = tensors[k]
        if t.dtype != torch.float32:
            raise ValueError(f"{k}: {t.dtype}, not float32")
        header[k] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [end, end + 4 * t.numel()],
        }
        end += 4 * t.numel()
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    flat = torch.cat([tensors[k].reshape(-1) for k in names]) if names else torch.zeros(0)
    return struct.pack("<Q", len(head)) + head + flat.numpy().astype("<f4", copy=False).tobytes()


def load_calibration(path: str | os.PathLike) -> CalibrationState:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: calibration file not found (run `qckpt calibrate` first)")
    try:
        raw = path.read_bytes()
        try:
            meta, tensors, floats = _read_f32_file(raw)
        except Exception:  # noqa: BLE001 - safetensors' own parse below says what is wrong
            meta, tensors, floats = None, None, {}
        if meta is None:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
        if tensors is None:  # one parse of the whole file (a lookup per name cost seconds)
            tensors = load_bytes(raw)
    except Exception as exc:  # safetensors raises several types for a bad header
        raise CheckpointError(f"{path}: not a safetensors calibration file ({exc})") from None
    if meta.get("qckpt_calibration") != FILE_VERSION:
        raise CheckpointError(
            f"{path}: not a qckpt calibration file (no qckpt_calibration metadata)"
        )
    return CalibrationState(
        amax=tensors,
        quantizers=json.loads(meta.get("quantizers", "{}")),
        model_type=meta.get("model_type", ""),
        model_fingerprint=meta.get("model_fingerprint", ""),
        quant=json.loads(meta.get("quant", "{}")),
        model=json.loads(meta.get("model", "{}")),
        algorithm=meta.get("algorithm", "max"),
        weights_dir=str(path.parent / meta["weights_dir"]) if meta.get("weights_dir") else "",
        weights_files=json.loads(meta.get("weights_files", "[]")),
        floats={k: (tensors[k], v) for k, v in floats.items() if k in tensors},
    )


def _read_f32_file(
    raw: bytes,
) -> tuple[dict[str, str], dict[str, torch.Tensor] | None, dict[str, float]]:
    """A safetensors file's metadata, its tensors when every one is float32 (what
    ``save_calibration`` writes), and the value of each one-value tensor as a float.

    The tensors are views of one buffer, by name as ``safetensors.torch.load`` orders them,
    each with the bits stored (NaN payloads included): a large MoE's file holds ~40k scalar
    amaxes, and a tensor made, checked and compared per amax cost ~0.5 s of every export's
    planning. Tensors None: a file this does not take (another dtype, offsets that do not tile
    the data exactly); raises on anything malformed (the caller then takes safetensors' path,
    which says what is wrong)."""
    import numpy as np

    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata is not a map of strings")
    start = 8 + n
    size = len(raw) - start
    data = np.frombuffer(raw, dtype="<f4", offset=start, count=size // 4)
    item = data.item
    floats: dict[str, float] = {}
    spans: list[tuple[int, int, str, tuple[int, ...]]] = []
    f32_only = True
    for name, info in head.items():
        b, e = info["data_offsets"]
        shape = info["shape"]
        f32_only = f32_only and info["dtype"] == "F32" and b % 4 == 0
        if info["dtype"] == "F32" and e - b == 4 and b % 4 == 0:
            floats[name] = item(b // 4)
        spans.append((b, e, name, tuple(shape)))
    if not f32_only or size % 4 or not _tiles(spans, size):
        return meta, None, floats
    flat = torch.frombuffer(bytearray(raw[start:]), dtype=torch.float32)
    # scalars (most of a per-tensor file) as 0-d views made in one call, when the buffer holds
    # little else; any other shape as a view of its span
    scalars = flat.unbind() if flat.numel() <= 4 * len(spans) + 4096 else None
    tensors: dict[str, torch.Tensor] = {}
    for b, e, name, shape in sorted(spans, key=lambda s: s[2]):
        if shape == () and scalars is not None:
            tensors[name] = scalars[b // 4]
        else:
            tensors[name] = flat[b // 4 : e // 4].view(shape)
    return meta, tensors, floats


def _tiles(spans: list[tuple[int, int, str, tuple[int, ...]]], size: int) -> bool:
    """The float32 spans cover ``[0, size)`` exactly, in some order, each ``4 x`` its shape's
    elements (what safetensors itself requires of a file)."""
    end = 0
    for b, e, _, shape in sorted(spans):
        n = 4
        for d in shape:
            if type(d) is not int or d < 0:
                return False
            n *= d
        if type(b) is not int or type(e) is not int or b != end or e - b != n:
            return False
        end = e
    return end == size


def calibration_differences(a: str | os.PathLike, b: str | os.PathLike) -> list[str]:
    """How two calibration files differ, one line per difference ([] = the same calibration).

    Amaxes are compared bit for bit (their bytes, so -0.0 vs 0.0 and NaN payloads count) and
    the metadata as parsed: safetensors writes its metadata keys in no fixed order, so two
    writes of the same calibration need not be the same bytes.
    """
    sa, sb = load_calibration(a), load_calibration(b)
    out = [
        f"{what}: {x!r} vs {y!r}"
        for what, x, y in (
            ("model_type", sa.model_type, sb.model_type),
            ("model_fingerprint", sa.model_fingerprint, sb.model_fingerprint),
            ("quant", sa.quant, sb.quant),
            ("algorithm", sa.algorithm, sb.algorithm),
        )
        if x != y
    ]
    for k in sorted(set(sa.quantizers) | set(sb.quantizers)):
        if sa.quantizers.get(k) != sb.quantizers.get(k):
            out.append(f"{k}: quantizer {sa.quantizers.get(k)} vs {sb.quantizers.get(k)}")
    for k in sorted(set(sa.amax) | set(sb.amax)):
        x, y = sa.amax.get(k), sb.amax.get(k)
        if x is None or y is None:
            out.append(f"{k}: only in {a if y is None else b}")
        elif x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            out.append(f"{k}: {x.flatten()[:4].tolist()} vs {y.flatten()[:4].tolist()} (bits)")
    return out
