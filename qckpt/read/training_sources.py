"""Megatron-Core ``torch_dist`` and torchtitan DCP checkpoints as sources, in HF names.

``qckpt.layouts.training`` says which stored rectangles make each HF tensor; here those rectangles are
cut along the stored chunks (one per layer and TP / EP shard) into :class:`ChunkPiece` s and read
as they lie: each chunk's ``torch.save`` archive is located without ``torch.load``
(``qckpt.storage.torch_save``) and a piece's rows come out of the file with positional reads, so a
destination costs its own bytes (one layer's slice of a stacked tensor, one query group's rows
of QKV, one expert of the expert axis) and a rank reads only its shard's chunks.

* :func:`detect` tells a Megatron dir (``metadata.json`` says ``"sharded_backend":
  "torch_dist"``) and a torchtitan one (its key names in ``.metadata``) from a plain DCP dir.
  ``.metadata`` is read through the allow-list unpickler (``qckpt.storage.dcp_metadata``: Megatron's own
  classes come back as inert stubs, Megatron is never imported); ``common.pt`` and the
  ``common_state`` byte entries (the pickled training args) are never opened.
* :class:`TrainingReader` (and :class:`FastTrainingReader`): a DCP ``StorageReader`` in the
  model's state-dict names (fused experts as one tensor whose chunks are the pieces), what
  ``load`` and ``calibrate`` plan against; the streaming planner's scratch receives the pieces.
* :class:`TrainingSource`: a ``CheckpointSource`` in HF checkpoint names (per expert), what
  ``export``, ``convert`` and ``inspect`` read, one tensor at a time.
"""

from __future__ import annotations

import bisect
import functools
import io
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from qckpt.errors import CheckpointError
from qckpt.layouts.registry import refuse_quantized_dcp
from qckpt.layouts.training import Mapping, Piece, map_checkpoint
from qckpt.models import naming
from qckpt.models.build import transformers_config
from qckpt.read.detect import megatron_config, resolve_iteration
from qckpt.read.fast_readers import FastReader
from qckpt.read.source import CheckpointSource, Entry
from qckpt.read.state_dict_reader import StateDictReader
from qckpt.storage import safetensors as stio
from qckpt.storage.dcp_metadata import read_checked_metadata
from qckpt.storage.files import open_regular
from qckpt.storage.torch_save import StoredTensor, locate_tensor


def stored_tensors(md: Metadata, framework: str) -> tuple[dict, dict, str]:
    """Stored name -> global shape / dtype (byte entries left out), and the key prefix dropped
    (torchtitan's model state may sit under ``model.``)."""
    tensors = {
        k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
    }
    prefix = ""
    if framework == "torchtitan" and "model.tok_embeddings.weight" in tensors:
        prefix = "model."
    shapes = {k[len(prefix) :]: tuple(int(s) for s in v.size) for k, v in tensors.items()}
    dtypes = {k[len(prefix) :]: v.properties.dtype for k, v in tensors.items()}
    return shapes, dtypes, prefix


def hf_targets(config: Any) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint names and shapes ``save_pretrained`` would write for ``config``
    (a meta model: nothing allocated), fused experts per expert, a tied head left out."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    model_type = getattr(config, "model_type", "")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        if name.endswith("._extra_state") or (tied and name == "lm_head.weight"):
            continue
        for hf_name, view in naming.hf_tensors(name, t, model_type):
            out[hf_name] = tuple(view.shape)
    return out


def state_dict_targets(
    expected: dict[str, torch.Size], model_type: str
) -> tuple[dict[str, tuple[int, ...]], dict[str, list[tuple[str, tuple, tuple]]]]:
    """HF checkpoint targets of a model's state-dict shapes, and for each fused experts
    parameter its per-expert (hf name, offsets, sizes) inside it."""
    from qckpt.read.hf_reader import per_expert_pieces

    targets: dict[str, tuple[int, ...]] = {}
    fused: dict[str, list[tuple[str, tuple, tuple]]] = {}
    for name, shape in expected.items():
        if name.endswith("._extra_state"):
            continue
        if naming.is_fused_experts_param(name) and len(shape) == 3:
            fused[name] = per_expert_pieces(name, tuple(shape), model_type)
            for hf_name, _, sizes in fused[name]:
                targets[hf_name] = tuple(sizes[1:])
        else:
            targets[name] = tuple(shape)
    return targets, fused


# ---- pieces cut along the stored chunks --------------------------------------------------------


@dataclass(frozen=True)
class ChunkPiece:
    """A piece inside one stored chunk: ``chunk`` (its index in the inner metadata), the region
    (``offsets`` from the chunk's start, ``sizes``) and where it lands (dest offsets / sizes,
    in the HF tensor's coordinates)."""

    stored: str  # the stored fqn as the checkpoint names it (prefix included)
    chunk: MetadataIndex
    chunk_sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dest_offsets: tuple[int, ...]
    dest_sizes: tuple[int, ...]
    interleave: int = 0

    def src_region(self, offs: tuple[int, ...], lens: tuple[int, ...]) -> tuple[tuple, tuple]:
        """A sub-rectangle given in dest coordinates (relative to the piece) in chunk
        coordinates: the non-1 axes of both correspond in order."""
        dest_axes = [d for d, n in enumerate(self.dest_sizes) if n != 1]
        src_axes = [s for s, n in enumerate(self.sizes) if n != 1]
        o, n = list(self.offsets), [1] * len(self.sizes)
        for s, d in zip(src_axes, dest_axes, strict=True):
            o[s] += int(offs[d])
            n[s] = int(lens[d])
        return tuple(o), tuple(n)


class ChunkIndex:
    """A stored tensor's chunks found by region: a trie over their offsets, axis by axis (at
    each level the distinct offsets sorted, and the longest chunk of the level on that axis),
    so that a piece visits the chunks near it instead of all of them: a stacked expert tensor
    has a chunk per layer and expert (12k of fc1 at 48 layers), and one piece per layer and
    expert cut from it, which a scan of every chunk made quadratic in the model's size."""

    def __init__(self, chunks: list[ChunkStorageMetadata]) -> None:
        self.chunks = chunks
        self.offsets = [tuple(int(o) for o in c.offsets) for c in chunks]
        self.ndim = len(chunks[0].offsets) if chunks else 0
        self.root = self._node(list(range(len(chunks))), 0)

    def _node(self, members: list[int], d: int) -> Any:
        if d == self.ndim:
            return members
        groups: dict[int, list[int]] = {}
        for i in members:
            groups.setdefault(self.offsets[i][d], []).append(i)
        starts = sorted(groups)
        longest = max(int(self.chunks[i].sizes[d]) for i in members)
        return starts, [self._node(groups[o], d + 1) for o in starts], longest

    def near(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[int]:
        """The indices (in stored order) of every chunk that may meet the region: a superset
        of those that do (the caller intersects), never missing one."""
        found: list[int] = []
        todo = [(self.root, 0)]
        while todo:
            node, d = todo.pop()
            if d == self.ndim:
                found.extend(node)
                continue
            starts, kids, longest = node
            lo = bisect.bisect_right(starts, offsets[d] - longest)
            hi = bisect.bisect_left(starts, offsets[d] + sizes[d])
            todo.extend((kids[k], d + 1) for k in range(lo, hi))
        return sorted(found)


def _cut(piece: Piece, prefix: str, index: ChunkIndex) -> list[ChunkPiece]:
    """``piece`` intersected with each chunk of its stored tensor (``index``: its chunks)."""
    fqn = prefix + piece.stored
    src_axes = [s for s, n in enumerate(piece.src_sizes) if n != 1]
    dest_axes = [d for d, n in enumerate(piece.dest_sizes) if n != 1]
    out: list[ChunkPiece] = []
    for i in index.near(piece.src_offsets, piece.src_sizes):
        c = index.chunks[i]
        lo = [max(a, int(co)) for a, co in zip(piece.src_offsets, c.offsets, strict=True)]
        hi = [
            min(a + n, int(co) + int(cn))
            for a, n, co, cn in zip(
                piece.src_offsets, piece.src_sizes, c.offsets, c.sizes, strict=True
            )
        ]
        if any(h <= lw for lw, h in zip(lo, hi, strict=True)):
            continue
        d_off, d_len = list(piece.dest_offsets), list(piece.dest_sizes)
        for s, d in zip(src_axes, dest_axes, strict=True):
            d_off[d] += lo[s] - piece.src_offsets[s]
            d_len[d] = hi[s] - lo[s]
        sizes = tuple(h - lw for lw, h in zip(lo, hi, strict=True))
        if piece.interleave and sizes != piece.src_sizes:
            raise CheckpointError(f"{fqn}: a permuted head block spans stored chunks")
        out.append(
            ChunkPiece(
                fqn,
                MetadataIndex(fqn, torch.Size(c.offsets)),
                tuple(int(n) for n in c.sizes),
                tuple(lw - int(co) for lw, co in zip(lo, c.offsets, strict=True)),
                sizes,
                tuple(d_off),
                tuple(d_len),
                piece.interleave,
            )
        )
    if sum(math.prod(p.sizes) for p in out) != math.prod(piece.src_sizes):
        raise CheckpointError(f"{fqn}: the checkpoint's chunks do not hold all of its data")
    return out


def _contiguous_start(shape: tuple[int, ...], offs: tuple, lens: tuple) -> int | None:
    """Element offset of a rectangle that is one contiguous run of a row-major ``shape``."""
    axes = [d for d, n in enumerate(lens) if n != 1]
    if axes and any(lens[d] != shape[d] for d in range(axes[0] + 1, len(shape))):
        return None
    start, stride = 0, 1
    for d in reversed(range(len(shape))):
        start += int(offs[d]) * stride
        stride *= shape[d]
    return start


class TrainingCheckpoint:
    """A training checkpoint dir: its metadata, its mapping onto the HF names, its chunks."""

    def __init__(
        self,
        path: str | os.PathLike,
        framework: str,
        config: Any,
        targets: dict[str, tuple[int, ...]],
    ) -> None:
        self.path = resolve_iteration(path)
        self.framework = framework
        self.md = read_checked_metadata(self.path)
        shapes, dtypes, self.prefix = stored_tensors(self.md, framework)
        self.mapping: Mapping = map_checkpoint(framework, config, targets, shapes, dtypes)
        # FP8 parameters saved as their codes (scales elsewhere): no layout of ours reads them
        used = {p.stored for t in self.mapping.targets.values() for p in t.pieces}
        refuse_quantized_dcp({self.prefix + k: dtypes[k] for k in used}, str(self.path))
        indexes: dict[str, ChunkIndex] = {}

        def cut(p: Piece) -> list[ChunkPiece]:
            fqn = self.prefix + p.stored
            if fqn not in indexes:
                indexes[fqn] = ChunkIndex(list(self.md.state_dict_metadata[fqn].chunks))
            return _cut(p, self.prefix, indexes[fqn])

        self.pieces = {
            name: [cp for p in t.pieces for cp in cut(p)]
            for name, t in self.mapping.targets.items()
        }
        self._located: dict[MetadataIndex, StoredTensor | None] = {}

    def warn_leftover(self) -> None:
        """One line per stored model tensor no HF tensor uses (never dropped silently)."""
        for k in self.mapping.leftover:
            print(
                f"qckpt: {self.path}: stored tensor {k} maps to no HF tensor (not read)",
                file=sys.stderr,
            )

    def stored_tensor(self, cp: ChunkPiece) -> StoredTensor | None:
        """Where a chunk's elements lie (located once; None: an archive read the plain way)."""
        if cp.chunk not in self._located:
            info = self.md.storage_data[cp.chunk]
            path = str(self.path / info.relative_path)
            base, length = int(info.offset), int(info.length)
            with open_regular(path) as f:

                def read(pos: int, n: int, f: Any = f) -> bytes:
                    n = max(0, min(n, length - pos))
                    return os.pread(f.fileno(), n, base + pos) if n else b""

                st = locate_tensor(read, length, path, base)
            if st is not None and math.prod(st.shape) != math.prod(cp.chunk_sizes):
                st = None
            self._located[cp.chunk] = st
        return self._located[cp.chunk]

    def fast_view(self, cp: ChunkPiece) -> StoredTensor | None:
        """The piece as a row-major tensor of its dest shape in the file (contiguous there),
        for the fast reader; None when it is not one run (or is permuted)."""
        st = self.stored_tensor(cp)
        if st is None or cp.interleave:
            return None
        start = _contiguous_start(cp.chunk_sizes, cp.offsets, cp.sizes)
        if start is None:
            return None
        return StoredTensor(st.path, st.offset + start * st.dtype.itemsize, st.dtype, cp.dest_sizes)

    def read(
        self, cp: ChunkPiece, offs: tuple | None = None, lens: tuple | None = None
    ) -> torch.Tensor:
        """The piece's elements (or the sub-rectangle ``offs`` / ``lens`` of it, in dest
        coordinates) as a fresh tensor of that dest shape."""
        offs = offs if offs is not None else (0,) * len(cp.dest_sizes)
        lens = lens if lens is not None else cp.dest_sizes
        if cp.interleave and tuple(lens) != cp.dest_sizes:
            raise CheckpointError(f"{cp.stored}: a permuted head block is read whole")
        s_off, s_len = cp.src_region(tuple(offs), tuple(lens))
        block = self._read_rect(cp, s_off, s_len)
        if cp.interleave:
            d = cp.interleave  # RoPE pairs (2a, 2a+1) -> HF halves (a, a + d/2)
            block = block.reshape(d // 2, 2, -1).transpose(0, 1).reshape(block.shape)
        return block.reshape(tuple(lens))

    def _read_rect(
        self, cp: ChunkPiece, offs: tuple, lens: tuple, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The rectangle ``offs`` / ``lens`` of the piece's chunk; read straight into ``out``
        (a contiguous tensor of its dtype and element count) when it is one run there."""
        st = self.stored_tensor(cp)
        shape = cp.chunk_sizes
        if st is None:
            whole = self._torch_load(cp).reshape(shape)
            for d, (o, n) in enumerate(zip(offs, lens, strict=True)):
                whole = whole.narrow(d, o, n)
            return whole.clone()
        # the smallest run of elements holding the rectangle (the rectangle itself when it
        # is contiguous: a layer's slice, a group's rows, an expert)
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        first = sum(o * s for o, s in zip(offs, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(offs, lens, strides, strict=True))
        n = last - first + 1
        direct = (
            out is not None
            and n == math.prod(lens)
            and out.is_contiguous()
            and out.dtype == st.dtype
            and out.numel() == n
        )
        buf = out.view(-1) if direct else torch.empty(n, dtype=st.dtype)
        with open_regular(st.path) as f:
            view = memoryview(buf.view(torch.uint8).numpy())
            got, pos = 0, st.offset + first * st.dtype.itemsize
            while got < len(view):
                k = os.preadv(f.fileno(), [view[got:]], pos + got)
                if k <= 0:
                    raise CheckpointError(f"{st.path}: truncated data for {cp.stored}")
                got += k
        if n == math.prod(lens):
            return buf
        return torch.as_strided(buf, tuple(lens), tuple(strides)).clone()

    def _torch_load(self, cp: ChunkPiece) -> torch.Tensor:
        info = self.md.storage_data[cp.chunk]
        with open_regular(self.path / info.relative_path) as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"{self.path / info.relative_path}: cannot read {cp.stored} ({type(exc).__name__})"
            ) from None
        if not isinstance(t, torch.Tensor) or t.numel() != math.prod(cp.chunk_sizes):
            raise CheckpointError(f"{self.path / info.relative_path}: {cp.stored} is not its chunk")
        return t

    def assemble(self, name: str) -> torch.Tensor:
        """One HF tensor, whole: its pieces read into it one after the other."""
        t = self.mapping.targets[name]
        out = torch.empty(t.shape, dtype=t.dtype)
        for cp in self.pieces[name]:
            dst = out
            for d, (o, n) in enumerate(zip(cp.dest_offsets, cp.dest_sizes, strict=True)):
                dst = dst.narrow(d, o, n)
            if not cp.interleave and dst.is_contiguous():  # the bytes land in place
                t = self._read_rect(cp, cp.offsets, cp.sizes, out=dst)
                if t.data_ptr() != dst.data_ptr():  # not one run: read aside, copied
                    dst.copy_(t.reshape(dst.shape))
                continue
            dst.copy_(self.read(cp))
        return out

    def describe(self) -> dict[str, Any]:
        """What ``inspect`` says of it."""
        version = ""
        if self.framework == "megatron":
            cfg = megatron_config(self.path) or {}
            version = f"torch_dist v{cfg.get('sharded_backend_version', '?')}"
            common = "common.pt" if (self.path / "common.pt").exists() else ""
            if "common_state" in self.md.state_dict_metadata:
                common = "common_state in .distcp (mcore >= 0.19)"
            if common:
                version += f", training args in {common} (never read)"
            if hasattr(self.md, "mcore_data"):
                version += ", mcore_data in .metadata"
        else:
            keys = self.md.state_dict_metadata
            new = any(".qkv_linear." in k or ".routed_experts." in k for k in keys)
            version = "0.3 names (qkv_linear, routed_experts)" if new else "<= 0.2 names"
        byte_entries = sum(
            1
            for v in self.md.state_dict_metadata.values()
            if not isinstance(v, TensorStorageMetadata)
        )
        return {
            "framework": self.framework,
            "version": version,
            "stacking": self.mapping.stacking,
            "mapped_tensors": len(self.mapping.targets),
            "stored_chunks_read": sum(len(v) for v in self.pieces.values()),
            "leftover": self.mapping.leftover,
            "not_model_entries": len(self.mapping.skipped) + byte_entries,
        }


# ---- a storage reader in state-dict names (load, calibrate, plan) ---------------------------


class TrainingReader(StateDictReader):
    """A training checkpoint read through DCP in the model's state-dict names."""

    reader_kind = "plain"

    def __init__(
        self,
        path: str | os.PathLike,
        framework: str,
        *,
        config: Any,
        expected: dict[str, torch.Size] | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.path = resolve_iteration(path)
        self.framework = framework
        self.config = config
        self.expected = expected
        self.bytes_read = 0
        self.source = None
        self.ckpt: TrainingCheckpoint | None = None
        self._metadata: Metadata | None = None
        self.storage_data: dict[MetadataIndex, ChunkPiece] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self._build()
        return self._metadata

    def _build(self) -> Metadata:
        model_type = str(getattr(self.config, "model_type", ""))
        if self.expected is None:
            targets, fused = hf_targets(self.config), {}
        else:
            targets, fused = state_dict_targets(self.expected, model_type)
        ckpt = self.ckpt = TrainingCheckpoint(self.path, self.framework, self.config, targets)
        ckpt.warn_leftover()
        layout: dict[str, tuple[torch.Size, Any, list[tuple[tuple, tuple, ChunkPiece]]]] = {}
        in_fused = {h for v in fused.values() for h, _, _ in v}
        for name, t in ckpt.mapping.targets.items():
            if name not in in_fused:
                entries = [(cp.dest_offsets, cp.dest_sizes, cp) for cp in ckpt.pieces[name]]
                layout[name] = (torch.Size(t.shape), t.dtype, entries)
        for name, members in fused.items():
            entries, dtype = [], None
            for hf_name, offs, _ in members:
                dtype = ckpt.mapping.targets[hf_name].dtype
                for cp in ckpt.pieces[hf_name]:
                    o = (offs[0], offs[1] + cp.dest_offsets[0], *cp.dest_offsets[1:])
                    entries.append((o, (1, *cp.dest_sizes), cp))
            layout[name] = (torch.Size(self.expected[name]), dtype, entries)
        sd_md: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for name, (shape, dtype, entries) in layout.items():
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in entries]
            sd_md[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), shape, chunks)
            for o, s, cp in entries:
                storage[MetadataIndex(name, torch.Size(o))] = (cp, len(s) - len(cp.dest_sizes))
        return Metadata(state_dict_metadata=sd_md, storage_data=storage)

    def _read_item(self, req: Any, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            raise CheckpointError(
                f"{req.dest_index.fqn}: no byte entries are read from {self.path}"
            )
        cp, lead = self.storage_data[req.storage_index]
        assert self.ckpt is not None
        t = self.ckpt.read(cp, tuple(req.storage_offsets)[lead:], tuple(req.lengths)[lead:])
        self.bytes_read += t.numel() * t.element_size()
        target = planner.resolve_tensor(req).detach()
        target.copy_(t.reshape(target.shape))
        planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            self._read_item(req, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return (Path(checkpoint_id) / ".metadata").exists()


class FastTrainingReader(FastReader, TrainingReader):
    """:class:`TrainingReader` on the fast path: each piece that is one run of its chunk's
    bytes is read in parallel by ``fast_read.FastReadEngine``; the rest inline."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from qckpt.read.fast_io import Files
        from qckpt.read.fast_spans import Job

        jobs = []
        for req in plan.items:
            cp, lead = self.storage_data[req.storage_index]
            inline = functools.partial(self._inline, req, planner)
            jobs.append(Job(req, locate=functools.partial(self._locate, cp, lead), inline=inline))
        self.run_jobs(jobs, planner, Files())
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _locate(self, cp: ChunkPiece, lead: int) -> StoredTensor | None:
        assert self.ckpt is not None
        st = self.ckpt.fast_view(cp)
        if st is None:
            return None
        return StoredTensor(st.path, st.offset, st.dtype, (1,) * lead + tuple(st.shape))

    def _inline(self, req: Any, planner: LoadPlanner) -> None:
        self.inline_items += 1
        self._read_item(req, planner)


# ---- a source in HF checkpoint names (export, convert, inspect) ------------------------------


class TrainingSource(CheckpointSource):
    """A training checkpoint listed and read in HF checkpoint names (per expert); ``config``:
    the HF config its tensors map onto, a transformers config or its dict (what an export after
    ``calibrate`` has: the calibration file's record of the model)."""

    def __init__(self, path: str | os.PathLike, framework: str, config: Any) -> None:
        if config is None:
            raise CheckpointError(
                f"{path}: a {framework} checkpoint needs model.source (an HF config dir or a "
                "built-in name) to say which HF tensors its tensors map onto"
            )
        super().__init__(resolve_iteration(path))
        self.format = framework
        # one config for the meta model's names and the layout's fields (a dict's missing
        # keys take the transformers defaults, as they do for the HF form's own export)
        self.config = transformers_config(config)
        self._ckpt: TrainingCheckpoint | None = None

    def checkpoint(self) -> TrainingCheckpoint:
        if self._ckpt is None:
            self._ckpt = TrainingCheckpoint(
                self.path, self.format, self.config, hf_targets(self.config)
            )
            self._ckpt.warn_leftover()
        return self._ckpt

    def _list(self) -> list[Entry]:
        """In the order a one-file HF dir of the same model lists them (safetensors stores the
        wider dtypes first, each dtype's tensors by name), so an export made from either is the
        same bytes."""
        ck = self.checkpoint()
        out = []
        order = sorted(ck.mapping.targets.items(), key=lambda kv: (_dtype_rank(kv[1].dtype), kv[0]))
        for name, t in order:
            first = ck.pieces[name][0]
            info = ck.md.storage_data[first.chunk]
            out.append(
                Entry(
                    name,
                    stio.dtype_code(t.dtype),
                    tuple(t.shape),
                    str(self.path / info.relative_path),
                    loc=name,
                )
            )
        return out

    def read(self, entry: Entry, pinned: bool = False) -> torch.Tensor:
        del pinned  # pieces are assembled on the host
        return self.checkpoint().assemble(entry.loc)


def _dtype_rank(dtype: torch.dtype) -> tuple[int, int]:
    """safetensors' file order: dtypes from the widest down (its Dtype enum, descending:
    BF16 before F16 among two-byte floats), then names."""
    return (-dtype.itemsize, 0 if dtype == torch.bfloat16 else 1)


def open_training_json(path: str | os.PathLike) -> dict[str, Any]:
    """``metadata.json`` as JSON (for ``inspect``), {} when absent."""
    p = Path(path) / "metadata.json"
    return json.loads(p.read_text()) if p.is_file() else {}
