"""``load_checkpoint``: a DCP dir or an HF safetensors dir into a model with quantized params.

Streaming (the default) goes through ``StreamingDequantLoadPlanner``: one high-precision scratch
at a time, quantized once per destination. ``stream=False`` is the bulk baseline kept for A/B:
dequantize every quantized destination to a full high-precision state dict, DCP-load it, quantize
back. Both check first that the checkpoint fits the model (every key present, shapes and dtypes
loadable) and fail with a one-line ``CheckpointError`` naming the tensor; nothing is reported as
loaded unless every item was read and every quantized destination was written.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from qckpt import phases
from qckpt.errors import CheckpointError, PeerError, QckptError, UsageError
from qckpt.load.destination import destination_of, prepended_axes, unwrap_prepended
from qckpt.load.meter import MemoryMeter
from qckpt.load.planner import StreamingDequantLoadPlanner
from qckpt.load.preflight import preflight
from qckpt.load.shard_scales import WholeScales, check_blocks
from qckpt.models.quantize_params import PLAIN_PARAMS
from qckpt.parallel.deadline import deadline_of
from qckpt.parallel.shard import ShardSpec, model_shards


@dataclass
class LoadReport:
    """What a load did and what it cost. ``to_dict()`` is the JSON report."""

    path: str
    format: str  # "dcp" | "safetensors"
    stream: bool
    device: str
    world_size: int
    rank: int
    tensors: int  # destinations loaded
    tensors_per_format: dict[str, int]  # {"none": plain, "fp8": ..., ...}
    transient_bytes: int  # measured, see measured_by
    predicted_transient_bytes: int  # max numel * nominal itemsize over quantized destinations
    peak_bytes: int  # device peak (CUDA allocator) or host RSS peak (CPU)
    host_peak_rss_bytes: int
    measured_by: str
    bytes_read: int
    seconds: float
    gbps: float  # bytes_read / seconds / 1e9
    read_items: int
    main_params: str | None = None
    main_params_bytes: int = 0
    # the storage reader: "fast" (parallel reads, up to max_inflight quantized destinations
    # live) or "plain" (DCP's per-item torch.load, one at a time); inline_items: items the fast
    # reader handed to the plain code (byte entries, unusual archives, quantized sources)
    reader: str = "plain"
    max_inflight: int = 1
    read_threads: int = 1
    inline_items: int = 0
    # the fast reader's staging buffers for the destinations read ahead of their scratch (host
    # memory, pinned on CUDA; 0: none made): the most it holds beside max_inflight scratches
    read_ahead_bytes: int = 0
    # a quantized source (qckpt.layouts): its layout, and the destinations that took its
    # codes and scales as they are (same layout: no dequantize/quantize round trip)
    source_layout: str = "plain"
    copied_tensors: int = 0
    # what this rank holds: its parameters' bytes (quantized as stored, plain as they are) and,
    # under EP / TP, its block (``holds``: experts [start, stop) of total, TP rank of tp) and
    # how many of its destinations took the whole tensor's amax from their shard group
    param_bytes: int = 0
    holds: dict[str, Any] = field(default_factory=dict)
    whole_amax_reduced: int = 0
    # (seconds since start, transient level in bytes, host RSS bytes) at every read item
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    # the FP32 master copies when main_params="fp32" (not part of the JSON report)
    main_param_tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "main_param_tensors"}
        d["samples"] = [list(s) for s in self.samples]
        return d


def _one_line(exc: BaseException) -> str:
    """A CheckpointException (one failure per rank, with tracebacks) as one line."""
    failures = getattr(exc, "failures", None) or {}

    def _peer(item: tuple[int, Any]) -> tuple[bool, int]:
        # a rank that only saw its peer fail (PeerError) is not the cause: name the cause
        inner = item[1][0] if isinstance(item[1], tuple) else item[1]
        return isinstance(inner, PeerError), item[0]

    for rank, f in sorted(failures.items(), key=_peer):
        inner = f[0] if isinstance(f, tuple) else f
        msg = str(inner).strip().splitlines()
        text = msg[0] if msg else type(inner).__name__
        if isinstance(inner, QckptError):
            return text
        return f"rank {rank}: {type(inner).__name__}: {text}"
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class _BulkPlanner(StreamingDequantLoadPlanner):
    """The bulk baseline's planner: its state dict holds no quantized tensor (they were all
    dequantized), so every item takes the default path; kept for the same sampling, progress
    and local-shard planning as streaming."""


def _dcp(state: dict[str, Any], reader: Any, planner: Any, group: Any, no_dist: bool) -> None:
    try:
        with warnings.catch_warnings():
            # dcp.load warns that it runs in one process when asked to; that is the point
            warnings.simplefilter("ignore")
            dcp_load(
                state, storage_reader=reader, planner=planner, process_group=group, no_dist=no_dist
            )
    except CheckpointException as exc:
        raise CheckpointError(_one_line(exc)) from None
    except (RuntimeError, dist.DistError):
        # DCP's own gather after the read, with a peer already known dead (a collective of
        # ours failed first under the mesh's deadline): that first failure is the one line
        dl = deadline_of(group) if group is not None else None
        if dl is not None and dl.passed:
            raise PeerError(dl.failure or "load: a peer failed") from None
        raise


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    format: str = "auto",
    stream: bool = True,
    main_params: str | None = None,
    mesh: Any = None,
    progress: Callable[[int], Any] | None = None,
    tap: Callable[[str, torch.Tensor], Any] | None = None,
    reader: Any = "fast",
    max_inflight: int = 1,
    read_threads: int | None = None,
    only: Collection[str] | None = None,
) -> LoadReport:
    """Load the checkpoint at ``path`` (DCP dir or HF safetensors dir) into ``model`` in place.

    ``stream=True`` (default) streams quantized destinations one scratch at a time; ``False``
    is the bulk baseline. ``main_params="fp32"`` also returns FP32 master copies of the quantized
    params holding the checkpoint's values exactly (``report.main_param_tensors``). ``mesh``
    (``qckpt.parallel.mesh.Mesh``) makes the load collective over its world; without one, a
    running process group is used if there is one. ``progress(n)`` is called per tensor.
    ``tap(name, value)``: see ``StreamingDequantLoadPlanner`` (no same-layout copy with a tap).
    ``reader``: fast (``qckpt.read.fast_read``), plain (DCP's), or a :func:`model_reader`.
    ``only``: the state-dict names to fill (every name of a tied tensor among them); the other
    tensors are neither read nor checked (a data-parallel rank reading its share:
    :mod:`qckpt.pipeline.dp_read`).
    """
    with phases.gc_paused():
        return _load_checkpoint(
            model,
            path,
            format=format,
            stream=stream,
            main_params=main_params,
            mesh=mesh,
            progress=progress,
            tap=tap,
            reader=reader,
            max_inflight=max_inflight,
            read_threads=read_threads,
            only=only,
        )


def _load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    format: str,
    stream: bool,
    main_params: str | None,
    mesh: Any,
    progress: Callable[[int], Any] | None,
    tap: Callable[[str, torch.Tensor], Any] | None,
    reader: Any,
    max_inflight: int,
    read_threads: int | None,
    only: Collection[str] | None = None,
) -> LoadReport:
    kind = reader if isinstance(reader, str) else reader.kind
    main_params = _check_args(main_params, kind, max_inflight)
    pre = preflight(
        model,
        path,
        format,
        reader=reader,
        max_inflight=max_inflight,
        threads=read_threads,
        only=only,
    )
    fmt, shards, reader, md, state = pre.format, pre.shards, pre.reader, pre.metadata, pre.state
    specs, whole = _sharded(model, state, mesh)
    # with a tap every quantized destination must pass through the scratch, none copied
    copied = set() if main_params or tap else _copy_same_layout(state, reader, specs, progress)

    group, world, no_dist, rank = _world_of(mesh)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    inflight = max_inflight if kind == "fast" and stream else 1
    per_fmt, predicted = _formats_and_transient(tensors, inflight)
    meter = MemoryMeter(device)
    t0 = time.perf_counter()
    # the copied destinations are done: the rest is read (and dequantized) by DCP
    args = (_without(state, copied), reader, meter, progress, main_params, group, no_dist, shards)
    args += (whole,)
    if stream:
        items, masters = _stream_load(*args, path=path, tap=tap)
    else:
        items, masters = _bulk_load(*args, md=md, tap=tap)
    seconds = _stop(meter, device, t0)
    bytes_read = int(getattr(reader, "bytes_read", 0))
    source = getattr(reader, "source", None)
    return LoadReport(
        path=str(path),
        format=fmt,
        stream=stream,
        device=str(device),
        world_size=max(world, 1),
        rank=rank,
        tensors=len(tensors),
        tensors_per_format=per_fmt,
        transient_bytes=int(meter.transient),
        predicted_transient_bytes=int(predicted),
        peak_bytes=int(meter.device_peak if meter.cuda else meter.peak_rss),
        host_peak_rss_bytes=int(meter.peak_rss),
        measured_by=meter.measured_by,
        bytes_read=bytes_read,
        seconds=seconds,
        gbps=bytes_read / seconds / 1e9 if seconds > 0 else 0.0,
        read_items=int(items),
        main_params=main_params,
        main_params_bytes=sum(t.numel() * t.element_size() for t in masters.values()),
        **_reader_info(reader, kind, inflight),
        source_layout=source.describe() if source is not None else "plain",
        copied_tensors=len(copied),
        **_what_this_rank_holds(model, specs, whole),
        samples=meter.samples,
        main_param_tensors=masters,
    )


def _stop(meter: MemoryMeter, device: torch.device, t0: float) -> float:
    """The load's seconds (queued device work included); the meter's last window closed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    meter.close_window()
    meter.sample(force=True)
    return seconds


def _world_of(mesh: Any) -> tuple[Any, int, bool, int]:
    """(process group, world size, no_dist, rank) of a load over ``mesh`` (or the running
    process group when there is no mesh)."""
    group = getattr(mesh, "world_group", None)
    world = int(getattr(mesh, "world_size", 0) or 0)
    if mesh is None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    no_dist = world <= 1 or not (dist.is_available() and dist.is_initialized())
    rank = dist.get_rank() if not no_dist else 0
    return group, world, no_dist, rank


def _formats_and_transient(
    tensors: list[torch.Tensor], inflight: int = 1
) -> tuple[dict[str, int], int]:
    """Destinations per format ("none": plain), and the predicted transient: the ``inflight``
    largest quantized destinations' numel times their nominal itemsize (that many scratches
    live at a time; one for the plain reader: 2 * max(numel) for BF16)."""
    per_fmt: dict[str, int] = {}
    sizes: list[int] = []
    for v in tensors:
        dest = destination_of(v)
        if dest is not None:
            per_fmt[dest.fmt] = per_fmt.get(dest.fmt, 0) + 1
            sizes.append(dest.numel() * dest.dtype.itemsize)
        else:
            per_fmt["none"] = per_fmt.get("none", 0) + 1
    return per_fmt, sum(sorted(sizes, reverse=True)[:inflight])


def _check_args(main_params: str | None, reader: str, max_inflight: int) -> str | None:
    """The arguments a recipe gives a load, checked; ``main_params`` normalized."""
    if main_params in (PLAIN_PARAMS, ""):  # load.main_params: none
        main_params = None
    if main_params not in (None, "fp32"):
        raise UsageError(f"load.main_params: must be none or fp32; got {main_params!r}")
    if reader not in ("fast", "plain"):
        raise UsageError(f"load.reader: must be fast or plain; got {reader!r}")
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise UsageError(f"load.max_inflight: must be an integer >= 1; got {max_inflight!r}")
    return main_params


def _reader_info(reader: Any, kind: str, inflight: int) -> dict[str, Any]:
    """The report's reader fields."""
    from qckpt.read.read_sizes import default_threads

    threads = getattr(reader, "threads", None) or (default_threads() if kind == "fast" else 1)
    return {
        "reader": kind,
        "max_inflight": inflight,
        "read_threads": int(threads),
        "inline_items": int(getattr(reader, "inline_items", 0)),
        "read_ahead_bytes": int(getattr(reader, "read_ahead_bytes", 0)),
    }


def _stream_load(
    state: dict[str, Any],
    reader: Any,
    meter: MemoryMeter,
    progress: Callable[[int], Any] | None,
    main_params: str | None,
    group: Any,
    no_dist: bool,
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    whole: WholeScales | None,
    *,
    path: str | os.PathLike,
    tap: Callable[[str, torch.Tensor], Any] | None = None,
) -> tuple[int, dict[str, torch.Tensor]]:
    """The streaming load: (items read, FP32 master copies when ``main_params="fp32"``)."""
    planner = StreamingDequantLoadPlanner(
        main_params=main_params == "fp32",
        meter=meter,
        progress=progress,
        shards=shards,
        tap=tap,
        whole_amax=whole,
    )
    try:
        _dcp(state, reader, planner, group, no_dist)
        left = planner.pending()
        if left["destinations"] or left["plain_items"]:
            raise CheckpointError(f"checkpoint {path}: load incomplete ({left})")
        return planner.stats["items"], planner.take_main_params()
    finally:
        planner.reset()


def _sharded(
    model: nn.Module | dict[str, Any], state: dict[str, Any], mesh: Any
) -> tuple[dict[str, ShardSpec], WholeScales | None]:
    """This rank's blocks (ShardSpecs) and the group-amax hook of a sharded load; a split
    that cuts a scale block is refused here, before any read."""
    specs = model_shards(model) if isinstance(model, nn.Module) else {}
    check_blocks(state, specs)
    return specs, WholeScales.of(model, mesh)


def _what_this_rank_holds(
    model: nn.Module | dict[str, Any], specs: dict[str, ShardSpec], whole: WholeScales | None
) -> dict[str, Any]:
    """The report's per-rank figures (after the load: the hook's reductions are counted)."""
    return {
        "param_bytes": _param_bytes(model),
        "holds": _holds(specs),
        "whole_amax_reduced": len(whole.reduced) if whole is not None else 0,
    }


def _param_bytes(model: nn.Module | dict[str, Any]) -> int:
    """Bytes this rank's parameters and buffers hold (quantized ones as stored)."""
    from qckpt.formats import is_quantized

    sd = model.state_dict(keep_vars=True) if isinstance(model, nn.Module) else dict(model)
    seen: set[int] = set()
    total = 0
    for v in sd.values():
        if not isinstance(v, torch.Tensor) or id(v) in seen:
            continue
        seen.add(id(v))
        total += v.quantized_nbytes() if is_quantized(v) else v.numel() * v.element_size()
    return total


def _holds(specs: dict[str, ShardSpec]) -> dict[str, Any]:
    """This rank's block under EP / TP, from its ShardSpecs ({} when it holds whole tensors)."""
    out: dict[str, Any] = {}
    experts = next((s for s in specs.values() if s.kind == "expert"), None)
    if experts is not None:
        out["experts"] = [experts.start, experts.stop, experts.total]
        out["ep_rank"] = experts.rank
        out["ep"] = experts.world
    tp = next((s for s in specs.values() if s.kind == "tp"), None)
    if tp is not None:
        out["tp_rank"] = tp.rank
        out["tp"] = tp.world
    if specs:
        out["sharded_tensors"] = len(specs)
    return out


def _without(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in names} if names else state


def _copy_same_layout(
    state: dict[str, Any],
    reader: Any,
    specs: dict[str, ShardSpec],
    progress: Callable[[int], Any] | None,
) -> set[str]:
    """Destinations of a quantized source's own layout get its codes and scales as they are
    (``same_layout.copy_plan`` says where: same format, block size and scale dtype, the
    local block cut on block boundaries); the rest are dequantized by the reader as usual.
    A sharded block is copied exactly when the whole tensor would be (the decision reads the
    whole shape), so every rank of a group decides alike and the collective order holds."""
    from qckpt.formats import is_quantized
    from qckpt.load.same_layout import copy_into, copy_plan
    from qckpt.storage.slices import SafetensorsFetch

    source = getattr(reader, "source", None)
    if source is None or not source.quantized:
        return set()
    fetch = SafetensorsFetch(reader.path, reader.raw_index)
    done: set[str] = set()
    for name, t in state.items():
        entry = reader.layout.get(name)
        if not is_quantized(t) or entry is None or len(entry.shape) != t.dim():
            continue
        spec = specs.get(name)
        lo = tuple(spec.offsets) if spec is not None else (0,) * t.dim()
        whole = tuple(spec.global_shape) if spec is not None else None
        hits = copy_plan(t, entry.pieces, lo, whole)
        if hits is not None:
            copy_into(t, hits, lo, fetch)
            done.add(name)
            if progress is not None:
                progress(1)
    reader.bytes_read += fetch.bytes_read
    fetch.close()
    return done


def _bulk_load(
    state: dict[str, Any],
    reader: Any,
    meter: MemoryMeter,
    progress: Callable[[int], Any] | None,
    main_params: str | None,
    group: Any,
    no_dist: bool,
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    whole: WholeScales | None,
    *,
    md: Metadata,
    tap: Callable[[str, torch.Tensor], Any] | None = None,
) -> tuple[int, dict[str, torch.Tensor]]:
    """The baseline: every quantized destination dequantized at once (2 * sum(numel) bytes)."""
    meter.open_window()
    hp: dict[str, Any] = {}
    quant: dict[str, tuple[Any, int, int]] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            hp[name] = t
            continue
        ckpt_shape = md.state_dict_metadata[name].size
        k = 0 if name in shards else prepended_axes(ckpt_shape, t.shape, name)
        dest = destination_of(t)
        if dest is not None:
            buf = dest.dequantize(torch.float32 if main_params == "fp32" else dest.dtype)
            nbytes = buf.numel() * buf.element_size()
            if main_params == "fp32":
                meter.add_output(nbytes)
            else:
                meter.add_scratch(nbytes)
            quant[name] = (dest, k, nbytes)
            hp[name] = buf.view(ckpt_shape) if k else buf
            meter.sample(fresh=True)
        else:
            hp[name] = t.view(ckpt_shape) if k else t
    planner = _BulkPlanner(meter=meter, progress=progress, shards=shards)
    _dcp(hp, reader, planner, group, no_dist)
    masters: dict[str, torch.Tensor] = {}
    for name, (t, k, nbytes) in quant.items():
        full = unwrap_prepended(hp.pop(name), k, name)
        if main_params == "fp32":
            masters[name] = full
            src = full.to(t.dtype)
            meter.add_scratch(src.numel() * src.element_size())
        else:
            src = full
        if tap is not None:
            tap(name, src)
        state_snapshot = t.quant_state()
        # in state order, the same on every rank (the order invariant of shard_scales)
        amax = whole(name, t, src) if whole is not None else None
        if amax is None:
            t.quantize_(src, update_state=False)
        else:
            t.quantize_(src, update_state=False, amax=amax)
        t.load_quant_state(state_snapshot)
        if main_params == "fp32":
            meter.sub_scratch(src.numel() * src.element_size())
        else:
            meter.sub_scratch(nbytes)
        del src, full
        meter.sample(fresh=True)
    meter.close_window()
    return planner.stats["items"], masters
