"""The export's bulk path: adjacent small weights read, checked, quantized and written as one.

Consecutive items that are each one quantized linear whose stored bytes are its value, stored
one after the other in one safetensors file, of one dtype (the experts of a MoE layer: 3 MB each
in Qwen3-30B-A3B, ~18k of them) go as one :class:`~qckpt.export.shares.Run` up to
``RUN_BYTES``: one positional read of their whole byte range (pinned on a GPU), one
host-to-device copy, then per :class:`~qckpt.export.shares.Stack` (one shape and projection,
evenly spaced, a strided ``[k, rows, cols]`` view) one source-weight guard reduction and one
quantize (:meth:`~qckpt.layouts.export_layout.ExportLayout.quantize_stack`, the per-item path's
element-wise math, so the same bytes), one copy back with one wait, and one ``pwritev`` per
shard file of the outputs, which lie next to each other there.

:class:`BulkRuns` is that part of :class:`~qckpt.export.stages.Pipeline` (the stages and the
per-item path are :mod:`qckpt.export.stages`); it keeps no state of its own and uses the
pipeline's plan, device, budgets, pools, stats and lock.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import math
import time

import torch

from qckpt.export.budget import Hold
from qckpt.export.guard import check_source_stack
from qckpt.export.shares import Item, Run, stacks
from qckpt.storage.shards import ShardFile

# offsets of the outputs in a batch's pinned host block: every dtype's alignment
ALIGN = 64


class BulkRuns:
    """The bulk path of one rank's pipeline (see the module doc)."""

    def _bulk_span(self, it: Item) -> tuple[str, int, int] | None:
        """(file, begin, end) of an item a run can take: one quantized linear whose stored
        bytes are its value (no split of a fused tensor, no conversion on read), no larger
        than a run's quantize chunk; None for any other."""
        e = it.entry
        if e is None or len(it.groups) != 1 or len(e.shape) != 2:
            return None
        g = it.groups[0]
        if g.module is None or g.entry.name != e.name or tuple(g.entry.shape) != e.shape:
            return None
        if not 0 < math.prod(e.shape) <= self.chunk_elems or not g.entry.dtype.is_floating_point:
            return None
        if not self.plan.layout.stacks_module(g.module):  # a mix: its scheme may not stack
            return None
        return self.plan.source.span(e)

    def _units(self, limit: int) -> list[Item | Run]:
        """The share's items with runs of adjacent bulk items (:meth:`_bulk_span`, one file,
        one dtype, one scheme, within ``limit`` bytes as the budget counts them) made
        :class:`Run`\\ s."""
        units: list[Item | Run] = []
        cur: list[Item] = []
        spans: list[tuple[str, int, int]] = []

        def flush() -> None:
            if len(cur) > 1:
                units.append(self._make_run(list(cur), [b for _, b, _ in spans]))
            else:
                units.extend(cur)
            cur.clear()
            spans.clear()

        host = out = 0
        for it in self.items:
            sp = self._bulk_span(it)
            if sp is None:
                flush()
                units.append(it)
                continue
            if cur and (
                sp[0] != spans[-1][0]
                or sp[1] != spans[-1][2]
                or it.entry.dtype != cur[-1].entry.dtype
                or self._key(it) != self._key(cur[-1])
                or self._costs(host + it.host_bytes, out + it.out_bytes) > limit
            ):
                flush()
            if not cur:
                host = out = 0
            cur.append(it)
            spans.append(sp)
            host += it.host_bytes
            out += it.out_bytes
        flush()
        return units

    def _key(self, it: Item) -> int:
        """The scheme a bulk item is written with: a run's stacks quantize with one."""
        return self.plan.layout.stack_key(it.groups[0].module)

    def _make_run(self, items: list[Item], begins: list[int]) -> Run:
        dtype = items[0].entry.torch_dtype
        offsets = [b - begins[0] for b in begins]
        shapes = [tuple(it.entry.shape) for it in items]
        return Run(
            items=items,
            dtype=dtype,
            stacks=stacks([it.entry.name for it in items], shapes, offsets, dtype.itemsize),
            host_bytes=sum(it.host_bytes for it in items),
            out_bytes=sum(it.out_bytes for it in items),
        )

    def _costs(self, host: int, out: int) -> int:
        """A run's bytes as the host budget counts them: on a GPU its read buffer and its
        block of outputs are pinned, at the power of two torch's pinned allocator rounds to."""
        if self.device.type != "cuda":
            return host + out
        return sum(1 << (n - 1).bit_length() if n > 1 else n for n in (host, out))

    def _run_read_cost(self, run: Run) -> int:
        return self._costs(run.host_bytes, run.out_bytes) - self._run_out_cost(run)

    def _run_out_cost(self, run: Run) -> int:
        return self._costs(0, run.out_bytes)

    def _read_run(self, run: Run) -> torch.Tensor:
        t0 = time.perf_counter()
        entries = [it.entry for it in run.items]
        buf = self.plan.source.read_span(entries, pinned=self.device.type == "cuda")
        with self.lock:
            self.stats.read_seconds += time.perf_counter() - t0
            self.stats.bytes_read += sum(e.nbytes for e in entries)
            self.stats.sources += len(entries)
            self.stats.runs += 1
            self.stats.run_sources += len(entries)
        self.sampler.sample()
        return buf

    def _runs_on_device(self) -> bool:
        """Runs are quantized on a device (a GPU): copied there, and back with one wait."""
        return self.device.type != "cpu"

    def _run_job(self, run: Run, fut: cf.Future) -> None:
        on_dev = self._runs_on_device()
        cost = run.host_bytes + run.out_bytes
        if on_dev:
            cf.wait([fut])  # the read first: the device budget is not idle
            self.dev_budget.take(cost)
        try:
            with (self._stream() if on_dev else None) or contextlib.nullcontext():
                self._process_run(run, fut)
        finally:
            if on_dev:
                self.dev_budget.give(cost)
        self.finished.extend(it.entry.name for it in run.items)

    def _process_run(self, run: Run, fut: cf.Future) -> None:
        """A run: its bytes to the device (one copy), then per stack the source-weight guard (one
        reduction) and the quantization (one set of kernels); one wait for the device
        (:meth:`_run_to_host`); the first refused weight's one-line error, or the writes."""
        t0 = time.perf_counter()
        read = Hold(self.budget, self._run_read_cost(run))
        buf = fut.result()
        src = buf.to(self.device, non_blocking=True) if self._runs_on_device() else buf
        del buf
        typed = src.view(run.dtype)
        isz = run.dtype.itemsize
        plan = self.plan
        views, outs, bads, cals = [], [], [], []
        for st in run.stacks:
            (rows, cols), k = st.shape, len(st.index)
            w = typed.as_strided((k, rows, cols), (st.stride // isz, cols, 1), st.offset // isz)
            modules = [run.items[i].groups[0].module for i in st.index]
            cal = [plan.cal_amax[f"{m}.weight_amax"] for m in modules]
            bads.append(check_source_stack(w, cal, self.chunk_elems))
            outs.append(plan.layout.quantize_stack(modules, w, plan.amax, self.chunk_elems))
            views.append(w)
            cals.append(cal)
        verdicts = self._run_to_host(bads, outs)
        where = [(s, j) for s, st in enumerate(run.stacks) for j in range(len(st.index))]
        bad = [run.stacks[s].index[j] for (s, j), b in zip(where, verdicts, strict=True) if b]
        if bad:  # the one-line message of the first refused weight, in the items' order
            s, j = next((s, j) for s, j in where if run.stacks[s].index[j] == min(bad))
            module = run.items[run.stacks[s].index[j]].groups[0].module
            read.unref()  # its budget back first: the pipeline may go on
            self.budget.give(self._run_out_cost(run))
            self._refuse(self.pos[id(run)], module, views[s][j], cals[s][j])
        del views, typed, src
        read.unref()
        self._write_run(run, outs)
        self._busy(time.perf_counter() - t0)
        self.sampler.sample()

    def _run_to_host(self, bads: list[torch.Tensor], outs: list[list[torch.Tensor]]) -> list:
        """The verdicts as booleans; on a device every stack's quantized weights and the
        verdicts copied into one host block (pinned on a GPU) with one wait for the stream, the
        weights in ``outs`` replaced by their host views."""
        verdicts = bads[0] if len(bads) == 1 else torch.cat(bads)
        if not self._runs_on_device():
            return verdicts.tolist()
        tensors = [o[0] for o in outs] + [verdicts]
        host = copy_back(tensors, self.device)
        del tensors
        for o, h in zip(outs, host, strict=False):
            o[0] = h
        return host[-1].tolist()

    def _write_run(self, run: Run, outs: list[list[torch.Tensor]]) -> None:
        """Each item's outputs as byte views of its stacks' outputs, written with one
        :meth:`~qckpt.storage.shards.ShardFile.write_span` per file; the run's
        output bytes come back when the last is written."""
        per_item: list[list[memoryview]] = [[] for _ in run.items]
        for st, o in zip(run.stacks, outs, strict=True):
            specs = run.items[st.index[0]].groups[0].specs
            k = len(st.index)
            if len(o) != len(specs) or any(
                t.dtype != sp.dtype or tuple(t.shape) != (k, *sp.shape)
                for t, sp in zip(o, specs, strict=False)
            ):  # the layout and the plan disagree: a bug
                raise AssertionError(
                    f"stacked outputs {[tuple(t.shape) for t in o]}, planned {specs}"
                )
            for t in o:
                mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                n = mv.nbytes // k
                for j, i in enumerate(st.index):
                    per_item[i].append(mv[j * n : (j + 1) * n])
        hold = Hold(self.budget, self._run_out_cost(run))
        seg: list[int] = []
        for i, it in enumerate(run.items):
            if seg and it.file_of[0] != run.items[seg[0]].file_of[0]:
                self._submit_span(run, seg, per_item, hold)
                seg = []
            seg.append(i)
        self._submit_span(run, seg, per_item, hold)
        hold.unref()

    def _submit_span(self, run: Run, seg: list[int], per_item: list, hold: Hold) -> None:
        f = self.out[run.items[seg[0]].file_of[0]]
        names = [sp.name for i in seg for sp in run.items[i].groups[0].specs]
        views = [v for i in seg for v in per_item[i]]
        hold.ref()
        with self.lock:
            self.pending = unfinished(self.pending)
            self.pending.append(self.write_pool.submit(self._write_span, f, names, views, hold))

    def _write_span(self, f: ShardFile, names: list[str], views: list, hold: Hold) -> None:
        t0 = time.perf_counter()
        try:
            n = f.write_span(names, views)
        finally:
            del views
            hold.unref()
        with self.lock:
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.bytes_written += n
            self.stats.tensors_written += len(names)
        self.sampler.sample()


def copy_back(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (on ``device``) copied into one host block, pinned on a GPU so the copies
    queue on the current stream, then one wait for that stream: their host views, in order.
    A wait per tensor was most of a small tensor's time."""
    sizes = [-(-t.nbytes // ALIGN) * ALIGN for t in tensors]  # every dtype's alignment
    offsets = list(itertools.accumulate(sizes, initial=0))
    block = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=device.type == "cuda")
    host = []
    for t, off in zip(tensors, offsets, strict=False):
        h = block[off : off + t.nbytes].view(t.dtype).view(t.shape)
        h.copy_(t, non_blocking=True)
        host.append(h)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return host


def unfinished(futures: list[cf.Future]) -> list[cf.Future]:
    """The futures still running; raises the first finished one's error."""
    keep = []
    for fut in futures:
        if not fut.done():
            keep.append(fut)
        elif fut.exception() is not None:
            raise fut.exception()
    return keep
