"""The fast read path (``load.reader: fast``) against the plain reader, its ordering invariant,
its memory bound (``load.max_inflight``) and its fallbacks.

Read pieces are made tiny (``CHUNK_BYTES``) so every tensor is read in many pieces by several
threads: the splitting, narrowing and casting paths all run on these small checkpoints.
Resharded and EP/TP-sharded loads: ``tests/dist/test_fast_read_dist.py``; CUDA:
``tests/gpu/test_fast_read_gpu.py``.
"""

from __future__ import annotations

import io
import random
import threading

import pytest
import torch

import qckpt.load.loader as load_mod
import qckpt.read.fast_io as fast_io
import qckpt.read.fast_read as fast_read
import qckpt.read.fast_spans as fast_spans
import qckpt.read.fast_tasks as fast_tasks
from qckpt.convert.dcp import dcp_to_hf_dir, save_model_dcp
from qckpt.errors import CheckpointError, RecipeError, UsageError
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model
from qckpt.models.quantize_params import quantize_model_params
from qckpt.read.fast_read import FastReadEngine
from qckpt.recipe import recipe_from_dict
from qckpt.storage.torch_save import locate_tensor
from tests import quantized_fixtures as fx
from tests.toy import ALL_FORMATS, Toy, assert_same_model, toy_quantized

FORMATS = ["none", *ALL_FORMATS]


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch):
    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 1000)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fastread")
    save_model_dcp(Toy(seed=1), root / "toy-dcp")
    # an FP32 checkpoint for BF16 params: the cast path
    save_model_dcp(Toy(seed=2, dtype=torch.float32), root / "toy-fp32")
    moe = build_model("tiny-moe", seed=1)
    save_model_dcp(moe, root / "moe-dcp")
    dcp_to_hf_dir(root / "moe-dcp", root / "moe-hf", moe.config, max_shard_bytes=60_000)
    return root


def _toy(fmt: str) -> torch.nn.Module:
    return Toy(seed=99) if fmt == "none" else toy_quantized(fmt)


def _moe(fmt: str) -> torch.nn.Module:
    m = build_model("tiny-moe", seed=7)
    if fmt != "none":
        quantize_model_params(m, fmt, ignore=["lm_head"])
    return m


def _both(make, path, **kw):
    a, b = make(), make()
    ra = load_checkpoint(a, path, reader="fast", read_threads=3, **kw)
    rb = load_checkpoint(b, path, reader="plain", **kw)
    assert (ra.reader, rb.reader) == ("fast", "plain")
    assert_same_model(a, b)
    return ra, rb


@pytest.mark.parametrize("fmt", FORMATS)
def test_dcp_fast_equals_plain(ckpts, fmt):
    ra, rb = _both(lambda: _toy(fmt), ckpts / "toy-dcp")
    assert ra.inline_items == 0 and ra.read_items == rb.read_items
    assert ra.bytes_read > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_hf_safetensors_fast_equals_plain(ckpts, fmt):
    # sharded over files, fused experts read one per-expert tensor per item
    ra, _ = _both(lambda: _moe(fmt), ckpts / "moe-hf")
    assert ra.format == "safetensors" and ra.inline_items == 0


@pytest.mark.parametrize("fmt", ["none", "fp8", "mxfp8"])
def test_dtype_cast_and_bulk_and_main_params(ckpts, fmt):
    _both(lambda: _toy(fmt), ckpts / "toy-fp32")
    _both(lambda: _toy(fmt), ckpts / "toy-dcp", stream=False)
    if fmt != "none":
        ra, rb = _both(lambda: _toy(fmt), ckpts / "toy-dcp", main_params="fp32")
        for k, v in ra.main_param_tensors.items():
            assert torch.equal(v, rb.main_param_tensors[k]), k


def test_unlocatable_archive_is_read_by_the_plain_code(tmp_path):
    # a transposed view is saved with its strides: not a row-major run of bytes
    src = Toy(seed=3)
    sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    sd["l1.weight"] = sd["l1.weight"].t().contiguous().t()
    save_model_dcp(sd, tmp_path / "c")
    ra, _ = _both(lambda: _toy("fp8"), tmp_path / "c")
    assert ra.inline_items == 1


# ---- the ordering invariant (the planner's _finish may run collectives) ------------------------


def test_planner_calls_stay_in_plan_order_on_the_calling_thread(ckpts, monkeypatch):
    main = threading.get_ident()
    seen: dict[str, list] = {
        "plan": [],
        "commit": [],
        "finish": [],
        "threads": set(),
        "reads": set(),
        "runs": [],
    }
    real = load_mod.StreamingDequantLoadPlanner

    class Spy(real):
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            seen["plan"] = [(i.dest_index.fqn, i.dest_index.offset) for i in plan.items]
            return plan

        def resolve_tensor(self, read_item):
            seen["threads"].add(threading.get_ident())
            return super().resolve_tensor(read_item)

        def commit_tensor(self, read_item, tensor):
            seen["threads"].add(threading.get_ident())
            seen["commit"].append((read_item.dest_index.fqn, read_item.dest_index.offset))
            super().commit_tensor(read_item, tensor)

        def resolve_run(self, fqn):
            seen["threads"].add(threading.get_ident())
            return super().resolve_run(fqn)

        def commit_run(self, items):
            # a run of items committed in one call: in plan order like one call per item
            seen["threads"].add(threading.get_ident())
            seen["runs"].append(len(items))
            seen["commit"] += [(i.dest_index.fqn, i.dest_index.offset) for i in items]
            super().commit_run(items)

        def _finish(self, fqn, d):
            seen["threads"].add(threading.get_ident())
            seen["finish"].append(fqn)
            super()._finish(fqn, d)

    real_read = fast_io.read_exact

    def read_exact(*args):
        seen["reads"].add(threading.get_ident())
        return real_read(*args)

    monkeypatch.setattr(load_mod, "StreamingDequantLoadPlanner", Spy)
    monkeypatch.setattr(fast_tasks, "read_exact", read_exact)
    m = _moe("fp8")
    load_checkpoint(m, ckpts / "moe-hf", reader="fast", read_threads=4)
    assert seen["threads"] == {main}
    assert seen["commit"] == seen["plan"] and len(seen["plan"]) > 50
    # the per-expert items of each fused parameter went as runs (one planner call for many)
    assert seen["runs"] and max(seen["runs"]) > 1
    # each quantized destination finished at its last item, in plan order, grouped by fqn
    order = list(dict.fromkeys(f for f, _ in seen["plan"]))
    assert seen["finish"] == [f for f in order if f in set(seen["finish"])]
    assert len(seen["finish"]) == sum(1 for p in m.state_dict().values() if hasattr(p, "qdata"))
    # and the bytes were read by the pool, not here
    assert seen["reads"] and main not in seen["reads"]


# ---- the memory bound --------------------------------------------------------------------------


@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_max_inflight_bounds_the_live_scratches(ckpts, monkeypatch, inflight):
    live: list[int] = []
    real = load_mod.StreamingDequantLoadPlanner

    class Spy(real):
        def resolve_tensor(self, read_item):
            out = super().resolve_tensor(read_item)
            live.append(self.pending()["scratch_buffers"])
            return out

        def resolve_run(self, fqn):
            out = super().resolve_run(fqn)
            live.append(self.pending()["scratch_buffers"])
            return out

    monkeypatch.setattr(load_mod, "StreamingDequantLoadPlanner", Spy)
    m = _moe("fp8")
    rep = load_checkpoint(m, ckpts / "moe-hf", reader="fast", max_inflight=inflight)
    sizes = sorted(
        (2 * p.numel() for p in m.state_dict().values() if hasattr(p, "qdata")), reverse=True
    )
    assert rep.max_inflight == inflight
    assert rep.predicted_transient_bytes == sum(sizes[:inflight])
    assert max(live) <= inflight
    assert sizes[0] <= rep.transient_bytes <= rep.predicted_transient_bytes


def test_reader_and_max_inflight_are_checked():
    assert recipe_from_dict({}).load.reader == "fast"
    assert recipe_from_dict({}).load.max_inflight == 1
    with pytest.raises(RecipeError, match=r"^load\.max_inflight: must be in 1 \.\. 64, got 0$"):
        recipe_from_dict({"load": {"max_inflight": 0}})
    with pytest.raises(RecipeError, match=r"^load\.reader: must be one of fast, plain"):
        recipe_from_dict({"load": {"reader": "mmap"}})
    with pytest.raises(UsageError, match="load.max_inflight"):
        load_checkpoint(Toy(), "/nonexistent", max_inflight=0)


# ---- quantized sources: codes and scales by the plain code, the rest on the fast path -----------


@pytest.fixture(scope="module")
def qdirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fastq")
    src = fx.bf16_dir(root)
    return {
        "blockwise": fx.blockwise_fp8(src, root / "bw", (24, 40)),
        "ct-nvfp4": fx.compressed_tensors(src, root / "ct-nvfp4", "nvfp4"),
    }


@pytest.mark.parametrize("fmt", ["none", "fp8", "fp8_block"])
@pytest.mark.parametrize("name", ["blockwise", "ct-nvfp4"])
def test_quantized_sources_fast_equals_plain(qdirs, name, fmt):
    def make():
        m = build_model("tiny-moe", seed=5)
        if fmt != "none":
            quantize_model_params(m, fmt, ignore=["lm_head", "*.mlp.gate"])
        return m

    ra, _ = _both(make, qdirs[name])
    assert ra.inline_items > 0 and ra.source_layout != "plain"


# ---- the pieces underneath ---------------------------------------------------------------------


def test_locate_tensor_finds_the_bytes_or_declines():
    cases = [
        torch.arange(12, dtype=torch.bfloat16).view(3, 4),
        torch.randn(6, 5)[2:4],  # a slice of a bigger storage: its offset inside the record
        torch.randn(2, 3, 4, dtype=torch.float16),
        torch.zeros(0, 3),
    ]
    for t in cases:
        buf = io.BytesIO()
        torch.save(t, buf)
        raw = buf.getvalue()
        st = locate_tensor(lambda p, n, raw=raw: raw[p : p + n], len(raw), "f", 1000)
        assert st is not None and st.shape == tuple(t.shape) and st.dtype == t.dtype
        got = raw[st.offset - 1000 : st.offset - 1000 + st.nbytes]
        assert got == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    buf = io.BytesIO()
    torch.save(torch.randn(4, 5).t(), buf)  # not row-major
    raw = buf.getvalue()
    assert locate_tensor(lambda p, n: raw[p : p + n], len(raw), "f", 0) is None


def test_locate_tensor_on_damaged_archives_declines_or_stays_inside():
    buf = io.BytesIO()
    torch.save(torch.randn(8, 8), buf)
    good = buf.getvalue()
    rnd = random.Random(0)
    for _ in range(300):
        raw = bytearray(good)
        for _ in range(rnd.randint(1, 8)):
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        raw = bytes(raw[: rnd.randint(len(raw) // 2, len(raw))]) if rnd.random() < 0.3 else raw
        st = locate_tensor(lambda p, n, raw=raw: bytes(raw[p : p + n]), len(raw), "f", 0)
        assert st is None or 0 <= st.offset and st.offset + st.nbytes <= len(raw)


def test_short_read_names_the_file(tmp_path):
    f = tmp_path / "data.distcp"
    f.write_bytes(b"x" * 10)
    files = fast_io.Files()
    try:
        buf = memoryview(bytearray(16))
        with pytest.raises(CheckpointError, match=r"data\.distcp: truncated: 16 bytes expected"):
            fast_io.read_exact(files.fd(str(f)), buf, 0, str(f))
    finally:
        files.close()


def test_span_is_one_contiguous_run_of_elements_or_none():
    shape = (4, 6, 5)
    flat = torch.arange(4 * 6 * 5).view(shape)
    cases = [
        ((1, 2, 0), (1, 3, 5)),  # rows of one expert: contiguous
        ((2, 0, 0), (2, 6, 5)),  # whole experts
        ((0, 0, 0), (4, 6, 5)),
        ((3, 5, 2), (1, 1, 3)),  # part of one row
        ((0, 0, 0), (0, 6, 5)),  # empty
        ((0, 1, 0), (2, 3, 5)),  # rows of two experts: not contiguous
        ((1, 0, 1), (1, 2, 4)),  # narrowed columns: not contiguous
    ]
    for offs, lens in cases:
        got = fast_spans.span(shape, offs, lens)
        region = flat[tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))]
        contiguous = region.numel() == 0 or (
            region.flatten().diff().eq(1).all().item()
            if region.numel() > 1
            else True  # one element
        )
        if region.numel() and contiguous:
            assert got == (int(region.flatten()[0]), region.numel()), (offs, lens)
        elif region.numel() == 0:
            assert got is not None and got[1] == 0
        else:
            assert got is None, (offs, lens)
    assert fast_spans.span((2, 3), (0,), (1,)) is None  # rank mismatch


def test_spans_merge_split_into_tasks_and_coalesce_into_stretches():
    spans: list = []
    fast_spans.add_span(spans, ("a", 100, 0, 10))
    fast_spans.add_span(spans, ("a", 110, 10, 6))  # continues both: merged
    fast_spans.add_span(spans, ("a", 500, 16, 4))  # continues the destination only
    fast_spans.add_span(spans, ("b", 520, 20, 4))  # another file
    assert spans == [("a", 100, 0, 16), ("a", 500, 16, 4), ("b", 520, 20, 4)]
    tasks = fast_spans.span_tasks(spans, 7)
    assert all(sum(s[3] for s in t) <= 7 for t in tasks)
    # every byte once, in order, each piece at its own file and destination offsets
    pieces = [s for t in tasks for s in t]
    assert sum(s[3] for s in pieces) == 24
    assert [s[2] for s in pieces] == sorted(s[2] for s in pieces)
    assert pieces[1] == ("a", 107, 7, 7)
    # back to back in one buffer, the destination-contiguous spans are one copy
    assert fast_spans.stretches(spans) == [(0, 0, 24)]
    assert fast_spans.stretches([("a", 0, 0, 4), ("a", 9, 8, 4)]) == [(0, 0, 4), (8, 4, 4)]


def test_fused_experts_are_read_as_runs_in_few_tasks(ckpts, monkeypatch):
    # the per-expert items of a fused parameter: one run, one planner resolve and commit, its
    # bytes read in fewer pool tasks than items (each task one pinned buffer on a device load)
    runs: list[tuple[int, int]] = []
    real = FastReadEngine._start_run

    def spy(self, *args):
        r = real(self, *args)
        if r is not None:
            runs.append((len(r.items), len(r.futures)))
        return r

    monkeypatch.setattr(FastReadEngine, "_start_run", spy)
    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 1 << 20)
    a, b = _moe("fp8"), _moe("fp8")
    load_checkpoint(a, ckpts / "moe-hf", reader="fast", read_threads=3)
    load_checkpoint(b, ckpts / "moe-hf", reader="plain")
    assert_same_model(a, b)
    multi = [(n, tasks) for n, tasks in runs if n > 1]
    assert multi and all(tasks < n for n, tasks in multi)


@pytest.mark.parametrize("fmt", ["none", "fp8"])
def test_plain_destinations_are_read_as_runs_into_their_own_tensors(ckpts, monkeypatch, fmt):
    # a BF16 parameter (every one with params none; norms, embeddings, lm_head otherwise) takes
    # its bytes in runs written straight into its own storage, not item by item: the item path
    # made a 61 GB BF16 read 2x slower than a quantized one on the H200
    per_item, run_bufs = [], []
    real_start, real_run = FastReadEngine._start, FastReadEngine._start_run

    def start(self, job, *args):
        per_item.append(job.item.dest_index.fqn)
        return real_start(self, job, *args)

    def start_run(self, jobs, i, planner, *args):
        r = real_run(self, jobs, i, planner, *args)
        if r is not None and r.buf is not None and not planner.streams(r.fqn):
            run_bufs.append((r.fqn, r.buf.data_ptr()))
        return r

    monkeypatch.setattr(FastReadEngine, "_start", start)
    monkeypatch.setattr(FastReadEngine, "_start_run", start_run)
    a, b = _moe(fmt), _moe(fmt)
    rep = load_checkpoint(a, ckpts / "moe-hf", reader="fast", read_threads=3)
    load_checkpoint(b, ckpts / "moe-hf", reader="plain")
    assert_same_model(a, b)
    assert per_item == [] and rep.inline_items == 0
    sd = a.state_dict()
    plain = {k for k, v in sd.items() if not hasattr(v, "qdata")}
    assert {f for f, _ in run_bufs} == plain
    assert all(sd[f].data_ptr() == ptr for f, ptr in run_bufs)
