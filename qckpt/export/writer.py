"""``qckpt export``: a checkpoint plus its calibration file -> FP8/NVFP4 safetensors that serve.

Two steps: :func:`~qckpt.export.plan.plan_export` reads metadata only and decides
everything (what each tensor becomes, the checks of the calibration file, the shard
assignment, the config), so every refusal comes before a byte is written; :func:`write_export`
executes the plan: the safetensors headers are written from the plan first (all shapes are
known), then each source tensor is read, quantized (on a GPU when one is given) and written at
its planned place, with reads, quantization and writes overlapped
(:mod:`~qckpt.export.stages`) and the host bytes in flight bounded by twice the
largest tensor, however large the model is. Under torchrun every rank writes its share of the
tensors (a byte-balanced run of them) into the shard files the ranks share, and the main rank
the rest (:mod:`~qckpt.export.dist`).
:func:`export_checkpoint` is plan and write in a row.

Atomicity and safety (``qckpt.atomic``, ``qckpt.outputs``): the output may not equal, contain or
lie inside the source, the model dir or the calibration file (checked first); everything is
written into a temp dir beside the target, checked (``qckpt check``) and renamed to it at the
very end, refusing atomically a target that appeared meanwhile. With ``overwrite`` an existing
target is replaced only when it is an earlier export (it holds the
:data:`~qckpt.outputs.EXPORT_MARKER` file every export carries). SIGINT/SIGTERM remove the temp
dir; after a SIGKILL it stays (under its hidden name) and the next export to that target
removes it once its pid is gone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qckpt.atomic import AtomicDir, terminate_as_interrupt, write_error
from qckpt.calib.state_file import CalibrationState
from qckpt.errors import ExportError, PeerError
from qckpt.export.dist import Team
from qckpt.export.plan import ExportPlan, plan_export
from qckpt.export.shares import Share, assign_items, check_written, create_files
from qckpt.export.stages import HOST_SLACK_BYTES, write_share
from qckpt.memory import peak_rss, unmap_large_allocations
from qckpt.outputs import EXPORT_MARKER, check_export_target, export_marker
from qckpt.phases import gc_paused
from qckpt.recipe import ExportConfig, QuantConfig
from qckpt.storage.files import write_json
from qckpt.storage.model_files import copy_model_files
from qckpt.storage.shards import shard_layout, write_index

__all__ = [
    "ExportPlan",
    "ExportReport",
    "WriteOptions",
    "export_checkpoint",
    "gc_paused",
    "plan_export",
    "write_export",
]


ProgressFn = Callable[[int, int, str], None]


class _Steps:
    """Seconds of the main rank's steps, for the report (``ExportReport.steps``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class ExportReport:
    output: str
    layout: str
    quant_format: str
    source_format: str
    source_tensors: int  # stored tensors in the source (a fused experts parameter counts once)
    tensors_written: int
    quantized_linears: int
    bytes_read: int  # all ranks together
    bytes_written: int  # tensor data, headers excluded, all ranks together
    shards: int
    largest_tensor_bytes: int
    # the main rank's wall time from the start of planning (the calibration file's read, in the
    # command) to the finished dir renamed into place: the same span for any number of ranks
    seconds: float
    gbps: float  # bytes_read / seconds / 1e9
    peak_rss_bytes: int  # the largest whole-process peak RSS (VmHWM) of any rank, never reset
    # anonymous memory (RssAnon, sampled; no file pages) at its peak during the write, and over
    # what the process held when the write began: the figure the documented bound is about
    peak_rss_anon_bytes: int = 0
    write_rss_anon_bytes: int = 0
    host_bound_bytes: int = 0  # 2 x largest tensor + 256 MiB
    world_size: int = 1
    device: str = "cpu"
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what known clients cannot serve
    # stored tensors that went in runs (the bulk path, qckpt.export.shares.Run), all ranks
    # together; the rest went one at a time
    run_sources: int = 0
    lanes: int = 1  # shard files written at once by one rank (the most of any rank)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: files, bytes, seconds
    # the main rank's seconds per step, in order: plan (up to write_export), share (its
    # assignment), create (the shard files), write (its own share), wait (for the other ranks'
    # agreement), check_written, finish (index, config, layout and model files, marker),
    # self_check, commit (the rename); what does not shrink with ranks is all but write
    steps: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def self_check(tmp: Path, target: Path) -> None:
    """``qckpt check`` on the finished temp dir: a layout bug never reaches the target name."""
    from qckpt.layouts.check import check_export

    res = check_export(tmp)
    if not res.ok:
        more = f" (and {len(res.problems) - 1} more)" if len(res.problems) > 1 else ""
        raise ExportError(f"{target}: the export failed its own check: {res.problems[0]}{more}")


def _refuse_unmarked(target: Path) -> None:
    check_export_target(target, overwrite=True)


def _finish_dir(plan: ExportPlan, tmp: Path, step: _Steps) -> None:
    """What only the main rank writes, after every shard is: index, config, layout files,
    model files, the marker (last: overwrite replaces only a dir holding it), then the check."""
    with step("finish"):
        if plan.shards.index:
            write_index(tmp, plan.shards)
        write_json(tmp / "config.json", plan.config)
        for fname, obj in plan.layout.extra_files(plan.ignore_list).items():
            write_json(tmp / fname, obj)
        if plan.source_dir is not None:
            copy_model_files(plan.source_dir, tmp)
        marker = export_marker(layout=plan.layout_name, shards=len(plan.shards.files))
        write_json(tmp / EXPORT_MARKER, marker)
    with step("self_check"):
        self_check(tmp, plan.target)


@dataclass(kw_only=True)
class WriteOptions:
    """How a rank writes its shards: where it quantizes and how many threads read and write."""

    device: str = "cpu"  # a torch device: "cpu", "cuda", "cuda:1"
    readers: int = 2
    writers: int = 4
    quantizers: int | None = (
        None  # None: 1 on the CPU, 4 on a GPU (qckpt.export.stages.write_share)
    )
    # shard files a rank writes at once (qckpt.export.shares.lane_order); None: stages.LANES
    # or the environment's QCKPT_EXPORT_LANES (the benchmarks' A/B switch)
    lanes: int | None = None
    # process-wide (glibc): large blocks mmapped and unmapped when freed, so that the host bytes
    # the writer gives back leave the RSS (qckpt.memory.unmap_large_allocations); the export
    # command sets it, a library caller decides for its own process
    unmap_large_allocations: bool = False

    def __post_init__(self) -> None:
        q = 1 if self.quantizers is None else self.quantizers
        lanes = 1 if self.lanes is None else self.lanes
        if not all(1 <= n <= 64 for n in (self.readers, self.writers, q, lanes)):
            raise ExportError(
                f"readers, writers, quantizers and lanes must be 1..64, got {self.readers}, "
                f"{self.writers}, {self.quantizers}, {self.lanes}"
            )


def _write_rank(
    plan: ExportPlan, team: Team, tmp: Path, share: Share, opts: WriteOptions, progress, step
) -> list[dict]:
    """This rank's share of the tensors, then the agreement: every rank's stats, or the
    failure."""
    if opts.unmap_large_allocations:
        unmap_large_allocations()
    try:
        with step("write"):
            stats = write_share(
                plan,
                tmp,
                share,
                device=opts.device,
                readers=opts.readers,
                writers=opts.writers,
                quantizers=opts.quantizers,
                lanes=opts.lanes,
                progress=progress,
                should_stop=team.check_peers,
            )
    except Exception as exc:  # tell the others first, then fail with it
        msg = " ".join(str(exc).split()) or type(exc).__name__
        team.mark_failed(msg)
        try:
            team.agree(False, msg, {})
        except (ExportError, PeerError):
            pass  # this rank's own error is the one to report
        raise
    stats_d = {**stats.to_dict(), "peak_rss_bytes": peak_rss()}
    with step("wait"):
        return team.agree(True, "", stats_d, written=stats.slots)


def _prepare_share(plan: ExportPlan, team: Team) -> Share:
    """This rank's share, and the layout of every shard file it writes into (header bytes,
    offsets: kept on the plan's specs). Done before the temp dir is shared, so that on the
    other ranks it overlaps the main rank's making of the files."""
    share = assign_items(plan, team.world)[team.rank]
    if not team.is_main:
        meta = plan.layout.shard_metadata()
        for i in share.files():
            shard_layout(Path(plan.shards.files[i]), plan.shards.specs[i], meta)
    return share


def write_export(
    plan: ExportPlan,
    *,
    progress: ProgressFn | None = None,
    started: float | None = None,
    mesh: Any = None,
    options: WriteOptions | None = None,
) -> ExportReport:
    """Execute ``plan``: every file into a temp dir beside the target, renamed to it at the end.

    ``mesh`` (a :class:`~qckpt.parallel.mesh.Mesh` of several ranks, every rank calling this
    with the same plan): each rank writes its share of the tensors into the shared shard
    files; the main rank then checks every file is whole, writes the rest and renames the dir
    (see :mod:`qckpt.export.dist`). ``started`` (a ``time.perf_counter()``) is when
    the export began, planning included.
    """
    t0 = time.perf_counter() if started is None else started
    step = _Steps()
    step.seconds["plan"] = time.perf_counter() - t0
    opts = options or WriteOptions()
    team = Team(mesh)
    out = AtomicDir(
        plan.target, key="export.output", replace=plan.overwrite, may_replace=_refuse_unmarked
    )
    # one process: SIGTERM unwinds and removes the temp dir; under torchrun a SIGTERM must end
    # a rank at once, even one blocked in a collective
    on_term = terminate_as_interrupt() if team.world == 1 else contextlib.nullcontext()
    agreed = False
    with on_term:
        with step("share"):
            share = _prepare_share(plan, team)
        # every shard file exists before any rank opens one: the ranks share them
        with step("create"):
            tmp = team.begin(out, prepare=lambda d: _create_files(plan, d, out.target))
        try:
            ranks = _write_rank(plan, team, tmp, share, opts, progress, step)
            agreed = True
            if team.is_main:
                with step("check_written"), gc_paused():
                    check_written(plan, [r["written"] for r in ranks])
                with gc_paused():
                    _finish_dir(plan, tmp, step)
                with step("commit"):
                    out.commit()
        except BaseException as exc:
            if team.is_main:
                out.abort()
                if agreed:  # the others wait for the outcome
                    _tell(team, False, " ".join(str(exc).split()) or type(exc).__name__)
            else:  # renamed away first: never races a commit (qckpt.export.dist's module doc)
                team.discard()
            err = write_error(exc, out.target, "export.output", tmp)
            if err is not None:
                raise err from exc
            raise
        seconds = time.perf_counter() - t0  # the main rank: the committed dir
        if team.is_main:
            _tell(team, True, "")
        else:
            team.outcome(True, "")
    rep = _report(plan, ranks, seconds, team.world, opts.device)
    rep.steps = {k: round(v, 4) for k, v in step.seconds.items()}
    return rep


def _create_files(plan: ExportPlan, tmp: Path, target: Path) -> None:
    """The main rank's shard files (``create_files``); an error of the write itself (a full
    disk, no permission) is the one-line ``export.output`` error the other writes give."""
    try:
        create_files(plan, tmp)
    except OSError as exc:
        err = write_error(exc, target, "export.output", tmp)
        if err is None:
            raise
        raise err from exc


def _tell(team: Team, ok: bool, message: str) -> None:
    """The main rank's outcome to the others. Its own failure to get through changes nothing
    here: on success the export is whole and in place (a rank that died after the agreement
    fails on its own), on failure this rank raises its own error."""
    with contextlib.suppress(ExportError, PeerError):
        team.outcome(ok, message)


def _report(
    plan: ExportPlan, ranks: list[dict], seconds: float, world: int, device: str
) -> ExportReport:
    st = [r["stats"] for r in ranks]
    bytes_read = sum(s["bytes_read"] for s in st)
    return ExportReport(
        output=str(plan.target),
        layout=plan.layout_name,
        quant_format=plan.layout.shard_metadata()["quant_format"],
        source_format=plan.source.format,
        source_tensors=plan.source_tensors,
        tensors_written=sum(s["tensors_written"] for s in st),
        quantized_linears=plan.quantized_linears,
        bytes_read=bytes_read,
        bytes_written=sum(s["bytes_written"] for s in st),
        shards=len(plan.shards.files),
        largest_tensor_bytes=plan.largest_tensor_bytes,
        seconds=seconds,
        gbps=bytes_read / seconds / 1e9 if seconds > 0 else 0.0,
        peak_rss_bytes=max([peak_rss()] + [s["peak_rss_bytes"] for s in st]),
        peak_rss_anon_bytes=max(s["rss_anon_peak_bytes"] for s in st),
        write_rss_anon_bytes=max(s["rss_anon_peak_bytes"] - s["rss_anon_start_bytes"] for s in st),
        host_bound_bytes=2 * plan.largest_tensor_bytes + HOST_SLACK_BYTES,
        world_size=world,
        device=str(device),
        files=sorted(p.name for p in plan.target.iterdir()),
        warnings=plan.layout.warnings(plan.quantized_modules),
        run_sources=sum(s.get("run_sources", 0) for s in st),
        lanes=max(s.get("lanes", 1) for s in st),
        ranks=[{"rank": r["rank"], **r["stats"]} for r in ranks] if world > 1 else [],
    )


def export_checkpoint(
    *,
    source: str | os.PathLike,
    calibration: str | os.PathLike | CalibrationState,
    output: str | os.PathLike,
    model_type: str,
    model_config: Any,
    quant: QuantConfig,
    export: ExportConfig,
    source_dir: str | os.PathLike | None = None,
    source_format: str = "auto",
    progress: ProgressFn | None = None,
    mesh: Any = None,
    options: WriteOptions | None = None,
) -> ExportReport:
    """Export ``source`` (DCP or HF safetensors dir) quantized with ``calibration`` into ``output``:
    :func:`plan_export`, then :func:`write_export`.

    ``model_config`` is the model's transformers config (or its dict); ``source_dir`` a model dir
    whose config.json, generation config and tokenizer files are carried over; ``mesh`` and
    ``options``: see :func:`write_export`. Raises :class:`ExportError` (one line, before anything is written) for a refused target, a
    calibration file of another model or format, or a recipe the layout cannot express.
    """
    t0 = time.perf_counter()
    plan = plan_export(
        source=source,
        calibration=calibration,
        output=output,
        model_type=model_type,
        model_config=model_config,
        quant=quant,
        export=export,
        source_dir=source_dir,
        source_format=source_format,
    )
    return write_export(plan, progress=progress, started=t0, mesh=mesh, options=options)
