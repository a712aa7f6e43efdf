"""The export's overlapped writer: same files whatever the threads, bounded host memory, the
ranks' byte-balanced shares of tensors, positional shard writes into shared files, the main
rank's whole-file check, one-line refusals of its settings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from qckpt.errors import RecipeError, UsageError
from qckpt.export.writer import WriteOptions, export_checkpoint
from qckpt.recipe import ExportConfig
from tests.export_fixtures import make_calibration, quant_config, run_export, saved_model

MiB = 2**20


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _open_at_once(log: list[str]) -> int:
    """The most shard files written at once: a file is open from its first write to its last."""
    span = {f: (log.index(f), len(log) - 1 - log[::-1].index(f)) for f in set(log)}
    return max(sum(a <= i <= b for a, b in span.values()) for i in range(len(log)))


def test_files_are_the_same_whatever_the_threads_and_lanes(tmp_path, monkeypatch):
    """Same files for any thread counts and any number of files written at once (lanes). One
    lane and one writer write one file after another (plan order); with lanes, that many
    files take writes at once (a write into one file holds its lock while it copies)."""
    from qckpt.export.stages import LANES
    from qckpt.storage.shards import ShardFile

    log: list[str] = []
    real_write, real_span = ShardFile.write, ShardFile.write_span

    def write(self, name, t):
        log.append(self.path.name)
        return real_write(self, name, t)

    def write_span(self, names, views):
        log.append(self.path.name)
        return real_span(self, names, views)

    monkeypatch.setattr(ShardFile, "write", write)
    monkeypatch.setattr(ShardFile, "write_span", write_span)
    model, hf_dir = saved_model(tmp_path, "tiny-moe")
    q = quant_config("channel", "token")
    cal = make_calibration(model, q)
    outs = []
    configs = [
        (1, 1, 1, 1),
        (4, 8, 3, 3),
        (2, 3, None, None),
    ]  # readers, writers, quantizers, lanes
    for i, (readers, writers, quantizers, lanes) in enumerate(configs):
        out = tmp_path / f"out-{i}"
        log.clear()
        rep = export_checkpoint(
            source=hf_dir,
            calibration=cal,
            output=out,
            model_type="qwen3_moe",
            model_config=model.config,
            quant=q,
            export=ExportConfig(max_shard_size="20KB"),
            options=WriteOptions(
                readers=readers, writers=writers, quantizers=quantizers, lanes=lanes
            ),
        )
        assert rep.shards > 5 and rep.tensors_written > 100
        assert rep.lanes == min(lanes or LANES, rep.shards)
        if lanes == 1:  # one file after another, in plan order
            assert log == sorted(log) and _open_at_once(log) == 1
        else:
            assert _open_at_once(log) >= rep.lanes, log
        outs.append(_tree(out))
    assert outs[0] == outs[1] == outs[2]


def test_host_memory_in_flight_is_bounded(tmp_path):
    """256 MiB of weights, the largest tensor 16 MiB: the write holds about 2 x 16 MiB of
    tensors at a time (reading everything first would hold > 256 MiB)."""
    from bench.export import make_checkpoint
    from qckpt.models.build import load_config

    info = make_checkpoint(tmp_path, 0.25, 1024, 4096, 8192)
    largest = info["largest_tensor_bytes"]
    assert largest == 16 * MiB and info["source_bytes"] > 14 * largest
    cfg = load_config(info["src"])
    rep = export_checkpoint(
        source=info["src"],
        calibration=info["calib"],
        output=tmp_path / "out",
        model_type="llama",
        model_config=cfg,
        quant=quant_config(),
        export=ExportConfig(max_shard_size="64MB"),
        options=WriteOptions(unmap_large_allocations=True),  # as the command runs it
    )
    # every tensor read once (the files' headers are not tensor data)
    assert rep.largest_tensor_bytes == largest
    assert 0.999 * info["source_bytes"] < rep.bytes_read < info["source_bytes"]
    assert rep.host_bound_bytes == 2 * largest + 256 * MiB
    print(f"anon rise during the write {rep.write_rss_anon_bytes / MiB:.0f} MiB")
    assert 0 < rep.write_rss_anon_bytes <= 2 * largest + 64 * MiB
    shutil.rmtree(tmp_path / "out")


def test_split_balanced_shares_are_within_one_item_of_equal():
    import random

    from qckpt.export.shares import split_balanced

    rng = random.Random(0)
    cases = [[9, 1, 5, 5, 3, 7, 2, 8], [100, 1, 1, 1], [0, 0, 5], [4], []]
    cases += [[rng.choice([1, 3, 50, 800]) for _ in range(rng.randint(1, 60))] for _ in range(200)]
    for sizes in cases:
        for world in (1, 2, 3, 4, 7):
            runs = split_balanced(sizes, world)
            assert runs == split_balanced(sizes, world) and len(runs) == world
            # contiguous, in order, every item once
            assert [i for r in runs for i in r] == list(range(len(sizes)))
            total, big = sum(sizes), max(sizes, default=0)
            for r in runs:
                share = sum(sizes[i] for i in r)
                assert abs(share * world - total) <= big * world, (sizes, world, runs)
    # the cut nearest to half the bytes: 9 1 5 5 | 3 7 2 8 (20 each)
    assert split_balanced([9, 1, 5, 5, 3, 7, 2, 8], 2) == [range(0, 4), range(4, 8)]
    # cuts nearest to 0.75, 1.5, 2.25 of prefix sums 0 1 3: 1, 1, 2 (empty runs are fine)
    assert split_balanced([1, 2], 4) == [range(0, 1), range(1, 1), range(1, 2), range(2, 2)]


def _uneven_plan(tmp_path: Path):
    """A real plan of tiny-moe whose shard files are uneven (a 12 KB cap; the embeddings, 32 KB,
    get a file of their own)."""
    from qckpt.export.plan import plan_export
    from qckpt.storage.shards import spec_nbytes

    model, hf_dir = saved_model(tmp_path, "tiny-moe")
    q = quant_config(kv=True)
    plan = plan_export(
        source=hf_dir,
        calibration=make_calibration(model, q),
        output=tmp_path / "never",
        model_type="qwen3_moe",
        model_config=model.config,
        quant=q,
        export=ExportConfig(max_shard_size="12KB"),
    )
    sizes = [sum(spec_nbytes(s) for s in specs) for specs in plan.shards.specs]
    assert len(sizes) > 8 and max(sizes) > 2 * min(sizes), sizes
    return plan


def test_lane_order_takes_equal_lanes_by_turns_each_in_plan_order():
    from qckpt.export.shares import lane_order, split_balanced

    costs = [4, 4, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1]
    files = [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    # lanes of 12 bytes each: units 0-2 (files 0, 1) and 3-11 (files 1-3); each time the lane
    # that has done the smaller part of its bytes goes (ties: the first)
    assert lane_order(costs, files, 2) == [0, 3, 1, 4, 5, 6, 7, 2, 8, 9, 10, 11]
    assert lane_order(costs, files, 1) == list(range(12))
    assert lane_order(costs, [5] * 12, 3) == list(range(12))  # one file: nothing to gain
    assert lane_order([], [], 2) == []
    for lanes in (3, 4, 9):  # never more lanes than files
        order = lane_order(costs, files, lanes)
        assert sorted(order) == list(range(12))
        n = min(lanes, 4)
        starts = [r.start for r in split_balanced(costs, n)]
        lane_of = [sum(i >= s for s in starts) - 1 for i in range(12)]
        for j in range(n):  # every lane in plan order, and every lane starts early
            mine = [i for i in order if lane_of[i] == j]
            assert mine == sorted(mine) and order.index(mine[0]) < n
    # zero-cost units (the KV scales) and an empty lane do not stop the others
    assert sorted(lane_order([0, 0, 5, 5], [0, 0, 1, 1], 2)) == [0, 1, 2, 3]


def test_assign_items_balances_bytes_moved_over_ranks_sharing_files(tmp_path):
    from qckpt.export.shares import assign_items, plan_items

    plan = _uneven_plan(tmp_path)
    items = plan_items(plan)
    assert items[-1].entry is None  # the KV scales: an item like any other, last
    assert sum(it.nbytes for it in items) == plan.shards.total_size
    # balanced on bytes moved: every stored tensor read once, every planned byte written once
    total = plan.shards.total_size + sum(e.nbytes for e in plan.source.entries())
    big = max(it.cost for it in items)
    assert sum(it.cost for it in items) == total
    assert big < total / 5  # so the bound below says something
    cut_files = []
    for world in (1, 2, 3, 4):
        shares = assign_items(plan, world)
        for sh in shares:
            assert abs(sh.cost - total / world) <= big, (world, [s.cost for s in shares])
        # every planned tensor is in exactly one share, in its planned file
        named = [(f, n) for sh in shares for f, ns in sh.names().items() for n in ns]
        planned = [(f, s.name) for f, specs in enumerate(plan.shards.specs) for s in specs]
        assert sorted(named) == sorted(planned)
        touched = [set(sh.names()) for sh in shares]
        cut_files += [touched[r] & touched[r + 1] for r in range(world - 1)]
    assert any(cut_files)  # files are cut between ranks where balance asks for it


def test_a_file_missing_a_slot_is_refused_by_the_main_rank(tmp_path, monkeypatch):
    """A share left out of the assignment (every rank's own close passes: it wrote what it was
    given): the main rank's whole-file check refuses the export, nothing is left."""
    import qckpt.export.writer as ex
    from qckpt.errors import ExportError
    from qckpt.export.shares import check_written

    plan = _uneven_plan(tmp_path)
    real = ex.assign_items

    def drop_one(plan, world):
        shares = real(plan, world)
        del shares[0].items[3]
        return shares

    monkeypatch.setattr(ex, "assign_items", drop_one)
    with pytest.raises(
        ExportError, match=r"^model-\d+-of-\d+\.safetensors: tensor \S+ .*never written"
    ):
        ex.write_export(plan)
    assert not plan.target.exists()
    assert not [p for p in tmp_path.iterdir() if ".qckpt-" in p.name]
    # and a slot written twice (two ranks given the same tensor) is refused too
    fname, n = plan.shards.files[0], len(plan.shards.specs[0])
    full = {fname: (1 << n) - 1}
    with pytest.raises(ExportError, match=f"^{fname}: a tensor was written by two ranks$"):
        check_written(plan, [full, {fname: 1}])


def test_shard_file_written_out_of_order_equals_front_to_back(tmp_path):
    from qckpt.layouts.export_layout import OutSpec
    from qckpt.storage.shards import ShardFile, ShardWriter, create_shard_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        "c": torch.randn(4, generator=g),
    }
    specs = [OutSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    w = ShardWriter(tmp_path / "front.safetensors", specs, {"format": "pt"})
    for k, t in tensors.items():
        w.write(k, t)
    w.close()
    front = (tmp_path / "front.safetensors").read_bytes()
    create_shard_file(tmp_path / "any.safetensors", specs, {"format": "pt"})
    assert (tmp_path / "any.safetensors").stat().st_size == len(front)  # the full planned size
    f = ShardFile(tmp_path / "any.safetensors", specs, {"format": "pt"})
    for k in reversed(tensors):
        f.write(k, tensors[k])
    f.close()
    assert front == (tmp_path / "any.safetensors").read_bytes()
    # two writers sharing the file (two ranks), each closing its own share: the same bytes
    create_shard_file(tmp_path / "shared.safetensors", specs, {"format": "pt"})
    mine = [ShardFile(tmp_path / "shared.safetensors", specs, {"format": "pt"}, ns) for ns in
            (["c", "a"], ["b"])]  # fmt: skip
    for k in ("b", "c", "a"):
        mine[0 if k != "b" else 1].write(k, tensors[k])
    assert [m.written() for m in mine] == [0b101, 0b010]
    for m in mine:
        m.close()
    assert front == (tmp_path / "shared.safetensors").read_bytes()
    with pytest.raises(FileExistsError):  # the main rank makes each file once, in a new dir
        create_shard_file(tmp_path / "shared.safetensors", specs, {})
    create_shard_file(tmp_path / "half.safetensors", specs, {})
    half = ShardFile(tmp_path / "half.safetensors", specs, {}, ["a", "c"])
    half.write("a", tensors["a"])
    with pytest.raises(AssertionError, match="not this writer's"):
        half.write("b", tensors["b"])
    with pytest.raises(AssertionError, match=r"wrote 1 of 2 \(this writer's share\)"):
        half.close()
    half.abort()


def test_bad_writer_settings_are_one_line(tmp_path, monkeypatch):
    from qckpt.errors import ExportError
    from qckpt.recipe import recipe_from_dict

    with pytest.raises(
        ExportError,
        match=r"^readers, writers, quantizers and lanes must be 1\.\.64, got 2, 4, None, 0$",
    ):
        WriteOptions(lanes=0)
    # the benchmarks' switch: refused when the export starts, nothing left behind
    model, hf_dir = saved_model(tmp_path, "tiny-dense")
    q = quant_config()
    monkeypatch.setenv("QCKPT_EXPORT_LANES", "two")
    with pytest.raises(ExportError) as e:
        run_export(model, hf_dir, make_calibration(model, q), tmp_path / "lanes", q)
    assert str(e.value) == "QCKPT_EXPORT_LANES: must be a whole number 1 .. 64, got 'two'"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-dense-hf"]
    monkeypatch.delenv("QCKPT_EXPORT_LANES")

    for bad in ("0", "65"):
        with pytest.raises(RecipeError, match=rf"^export.writers: must be in 1 .. 64, got {bad}$"):
            recipe_from_dict({}, [f"export.writers={bad}"])
    with pytest.raises(RecipeError, match="export.device"):
        recipe_from_dict({}, ["export.device=tpu"])
    if not torch.cuda.is_available():
        from qckpt.pipeline.export import export

        r = recipe_from_dict({}, ["export.device=cuda", f"export.output={tmp_path / 'never'}"])
        with pytest.raises(UsageError, match="^export.device: cuda asked for but no CUDA device"):
            export(r)
        assert not (tmp_path / "never").exists()


def test_worker_threads_use_the_callers_kernel_policy(tmp_path, monkeypatch):
    """The CLI scopes the kernel policy (QCKPT_COMPILE, ...) in a context variable; the quantize
    threads must see it, as the one thread of a plain export did."""
    import qckpt.export.guard as guard
    from qckpt.kernel_policy import KernelPolicy, current_policy, kernel_policy

    model, hf_dir = saved_model(tmp_path, "tiny-dense")
    q = quant_config()
    seen = []
    real = guard.check_source_weight

    real_stack = guard.check_source_stack

    def spy(module, w, amax):
        seen.append(current_policy().compile)
        return real(module, w, amax)

    def spy_stack(w, amax, chunk):  # the bulk path: several weights at once
        seen.extend(current_policy().compile for _ in amax)
        return real_stack(w, amax, chunk)

    import qckpt.export.bulk as bulk
    import qckpt.export.stages as pipe

    monkeypatch.setattr(pipe, "check_source_weight", spy)
    monkeypatch.setattr(bulk, "check_source_stack", spy_stack)
    with kernel_policy(KernelPolicy(compile="never")):
        cal = make_calibration(model, q)
        run_export(model, hf_dir, cal, tmp_path / "out", q, options=WriteOptions(quantizers=2))
    assert len(seen) == 14 and set(seen) == {"never"}


def test_the_json_reports_rank_rows_keep_what_each_rank_wrote(monkeypatch):
    """``--json`` of a distributed export: each rank's row has its phases and peaks (gathered by
    the CLI) and still the files and bytes that rank wrote (from the export's agreement)."""
    from types import SimpleNamespace

    import qckpt.parallel.deadline as deadline
    from qckpt.cli import output

    def fake_gather(what, fn, box, mine, group=None):  # the other rank's row, as gathered
        box[0], box[1] = mine, {"rank": 1, "phases": {"total": 2.0}, "peaks": {}}

    monkeypatch.setattr(deadline, "collective", fake_gather)
    mine = {"phases": {"total": 1.0}, "peaks": {"host_peak_rss_bytes": 5}}
    monkeypatch.setattr(output.phases, "summary", lambda: mine)
    export_rows = [
        {"rank": 0, "files": ["model-00001-of-00002.safetensors"], "bytes_written": 10},
        {"rank": 1, "files": ["model-00001-of-00002.safetensors", "b"], "bytes_written": 11},
    ]
    mesh = SimpleNamespace(world_size=2, rank=0, world_group=None)
    got = output.with_phases({"ranks": export_rows}, mesh)["ranks"]
    assert [r["bytes_written"] for r in got] == [10, 11]
    assert got[1]["files"] == export_rows[1]["files"] and got[1]["phases"] == {"total": 2.0}
    assert got[0]["phases"] == {"total": 1.0} and got[0]["files"] == export_rows[0]["files"]


def test_a_failed_quantize_job_stops_the_rank_instead_of_hanging_it(tmp_path):
    """A share without the embeddings (budget 2 x a 16 KB weight): the gate_proj weight fails its
    amax guard and never gives its bytes back, and up_proj, as large, waits for them. The rank
    must raise the guard's error at once (it hung: the feeder on the budget, the calling thread
    on the feeder)."""
    import threading

    from qckpt.errors import ExportError
    from qckpt.export.plan import plan_export
    from qckpt.export.shares import Share, create_files, plan_items
    from qckpt.export.stages import write_share

    model, hf_dir = saved_model(tmp_path, "tiny-dense")
    q = quant_config()
    cal = make_calibration(model, q)
    cal.amax["model.layers.0.mlp.gate_proj.weight_amax"] /= 4
    kw = dict(model_type="llama", model_config=model.config, quant=q, export=ExportConfig())
    plan = plan_export(source=hf_dir, calibration=cal, output=tmp_path / "never", **kw)
    items = [it for it in plan_items(plan) if it.entry is None or "embed" not in it.entry.name]
    items = [it for it in items if it.entry is None or it.entry.name != "lm_head.weight"]
    names = [it.entry.name for it in items if it.entry is not None]
    gate = names.index("model.layers.0.mlp.gate_proj.weight")
    assert names[gate + 1] == "model.layers.0.mlp.up_proj.weight"
    (tmp_path / "tmp").mkdir()
    create_files(plan, tmp_path / "tmp")
    got: list[BaseException] = []

    def run() -> None:
        try:
            write_share(plan, tmp_path / "tmp", Share(rank=1, items=items))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the rank hung after a quantize job failed"
    assert len(got) == 1 and isinstance(got[0], ExportError), got
    assert "gate_proj.weight: amax" in str(got[0]) and "exceeds the calibrated" in str(got[0])


def test_a_full_disk_while_making_the_shard_files_is_one_line_and_leaves_nothing(
    tmp_path, monkeypatch
):
    import errno
    import os

    import qckpt.storage.shards as stio
    from qckpt.errors import OutputError

    plan = _uneven_plan(tmp_path)
    made, real = [], os.ftruncate

    def full(fd, size):
        made.append(size)
        if len(made) == 3:  # the third file: two are made and must go too
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, size)

    monkeypatch.setattr(stio.os, "ftruncate", full)
    from qckpt.export.writer import write_export

    with pytest.raises(OutputError, match=r"^export.output: cannot write .*: no space left"):
        write_export(plan)
    assert len(made) == 3 and not plan.target.exists()
    assert not [p for p in tmp_path.iterdir() if ".qckpt-" in p.name]
