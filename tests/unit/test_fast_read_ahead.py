"""The fast reader's read-ahead: the bytes of the streamed destinations after the
``max_inflight`` live ones are read into host staging buffers before those destinations get
their scratch, so the reads go on while the previous destination is committed (quantized).

On the host it is off by default (``HOST_READ_AHEAD_BYTES``); these tests turn it on to run the
same code that a CUDA load runs with pinned staging buffers (``tests/gpu/test_fast_read_gpu.py``):
values equal to the plain reader, the next destinations' reads issued before the previous one
is committed while at most ``max_inflight`` scratches are ever live, and a failed read-ahead
naming its tensor without hanging the load.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import qckpt.read.fast_io as fast_io
import qckpt.read.fast_read as fast_read
import qckpt.read.fast_spans as fast_spans
import qckpt.read.fast_tasks as fast_tasks
from qckpt.convert.dcp import dcp_to_hf_dir, save_model_dcp
from qckpt.errors import CheckpointError
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model
from qckpt.models.quantize_params import quantize_model_params
from qckpt.read.fast_read import FastReadEngine
from qckpt.storage.torch_save import StoredTensor
from tests.toy import ALL_FORMATS, Toy, assert_same_model, toy_quantized

pytestmark = pytest.mark.timeout(60)  # a deadlock fails here, not after the suite's timeout


# ---- values: every format, DCP and HF, read ahead on the host ----------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("readahead")
    save_model_dcp(Toy(seed=1), root / "toy-dcp")
    moe = build_model("tiny-moe", seed=1)
    save_model_dcp(moe, root / "moe-dcp")
    # FP32 values: FP32 main params are buffers of the stored dtype, read as runs
    save_model_dcp({k: v.float() for k, v in moe.state_dict().items()}, root / "moe-fp32")
    dcp_to_hf_dir(root / "moe-dcp", root / "moe-hf", moe.config, max_shard_bytes=60_000)
    return root


def _moe(fmt: str) -> torch.nn.Module:
    m = build_model("tiny-moe", seed=7)
    if fmt != "none":
        quantize_model_params(m, fmt, ignore=["lm_head"])
    return m


def _staged_spy(monkeypatch) -> list[int]:
    """Counts the read-ahead tasks that read into a staging buffer."""
    staged: list[int] = []
    real = FastReadEngine._stage

    def spy(self, run, spans, sbuf):
        staged.append(sum(sp[3] for sp in spans))
        return real(self, run, spans, sbuf)

    monkeypatch.setattr(FastReadEngine, "_stage", spy)
    return staged


@pytest.mark.parametrize("inflight", [1, 2])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_read_ahead_equals_the_plain_reader(ckpts, monkeypatch, fmt, inflight):
    # 4 KiB pieces, 12 KiB of staging: every fused expert tensor read ahead in part, its
    # staging buffers reused, its later tasks waiting for them or for the admission
    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(fast_read, "HOST_READ_AHEAD_BYTES", 3 * 4096)
    staged = _staged_spy(monkeypatch)
    for path, make in ((ckpts / "moe-hf", lambda: _moe(fmt)), (ckpts / "toy-dcp", None)):
        make = make or (lambda: toy_quantized(fmt))
        a, b = make(), make()
        ra = load_checkpoint(a, path, reader="fast", read_threads=3, max_inflight=inflight)
        rb = load_checkpoint(b, path, reader="plain")
        assert_same_model(a, b)
        assert ra.read_ahead_bytes == 3 * 4096 and rb.read_ahead_bytes == 0
        assert ra.transient_bytes <= ra.predicted_transient_bytes
    assert staged


def test_read_ahead_with_fp32_main_params_equals_the_plain_reader(ckpts, monkeypatch):
    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(fast_read, "HOST_READ_AHEAD_BYTES", 3 * 4096)
    staged = _staged_spy(monkeypatch)
    a, b = _moe("fp8"), _moe("fp8")
    path = ckpts / "moe-fp32"
    ra = load_checkpoint(a, path, reader="fast", read_threads=3, main_params="fp32")
    rb = load_checkpoint(b, path, reader="plain", main_params="fp32")
    assert_same_model(a, b)
    assert ra.main_param_tensors.keys() == rb.main_param_tensors.keys()
    for k, v in ra.main_param_tensors.items():
        assert v.dtype == torch.float32 and torch.equal(v, rb.main_param_tensors[k]), k
    assert staged


def test_host_loads_do_not_read_ahead_by_default(ckpts, monkeypatch):
    # on the host the staged bytes would cost a second copy: today's behaviour stays
    staged = _staged_spy(monkeypatch)
    rep = load_checkpoint(_moe("fp8"), ckpts / "moe-hf", reader="fast", read_threads=3)
    assert not staged and rep.read_ahead_bytes == 0


# ---- the engine with a recording planner: the order it promises --------------------------------

ROWS, COLS, ITEM_ROWS = 64, 16, 8  # float32 destinations of 4 KiB, 8 items each


class Recorder:
    """A streaming planner that records what a user of its scratches would see: which scratches
    are live, what each committed destination held, and the calling thread's call order."""

    def __init__(self, names: list[str], before_commit=None) -> None:
        self.expected = {n: ROWS // ITEM_ROWS for n in names}
        self.done: Counter[str] = Counter()
        self.bufs: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[str, str]] = []
        self.threads: set[int] = set()
        self.peak_live = 0
        self.before_commit = before_commit

    def streams(self, fqn: str) -> bool:
        return True

    def run_layout(self, fqn: str):
        return torch.Size((ROWS, COLS)), torch.float32, torch.device("cpu")

    def resolve_run(self, fqn: str) -> torch.Tensor:
        self.threads.add(threading.get_ident())
        self.calls.append(("resolve", fqn))
        if fqn not in self.bufs:
            self.bufs[fqn] = torch.full((ROWS, COLS), float("nan"))
            self.peak_live = max(self.peak_live, len(self.bufs))
        return self.bufs[fqn]

    def resolve_tensor(self, item):
        raise AssertionError("every item here is one contiguous span: it goes in a run")

    def commit_tensor(self, item, tensor):
        raise AssertionError("every item here is one contiguous span: it goes in a run")

    def commit_run(self, items) -> None:
        self.threads.add(threading.get_ident())
        fqn = items[0].dest_index.fqn
        self.done[fqn] += len(items)
        if self.done[fqn] == self.expected[fqn]:
            if self.before_commit is not None:
                self.before_commit(fqn)
            self.calls.append(("commit", fqn))
            self.values[fqn] = self.bufs.pop(fqn).clone()


def _files(tmp_path, names: list[str], short: str | None = None):
    """One file of ``names``' values (float32, ROWS x COLS each), in order; ``short``: the file
    ends inside that tensor's bytes (its reads fail as a truncated file's)."""
    g = torch.Generator().manual_seed(0)
    values = {n: torch.randn(ROWS, COLS, generator=g) for n in names}
    raw = b"".join(values[n].numpy().tobytes() for n in names)
    path = tmp_path / "data.bin"
    if short is not None:
        raw = raw[: names.index(short) * ROWS * COLS * 4 + 100]
    path.write_bytes(raw)
    return str(path), values


def _jobs(path: str, names: list[str]) -> list[fast_spans.Job]:
    jobs = []
    for k, n in enumerate(names):
        st = StoredTensor(path, k * ROWS * COLS * 4, torch.float32, (ROWS, COLS))
        for r in range(0, ROWS, ITEM_ROWS):
            item = ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(n, torch.Size((r, 0))),
                dest_offsets=torch.Size((r, 0)),
                storage_index=MetadataIndex(n, torch.Size((0, 0))),
                storage_offsets=torch.Size((r, 0)),
                lengths=torch.Size((ITEM_ROWS, COLS)),
            )
            jobs.append(fast_spans.Job(item, locate=lambda st=st: st))
    return jobs


def _engine(inflight: int, ahead: int) -> FastReadEngine:
    # 1 KiB pieces: each destination is 4 pool tasks; ``ahead`` bytes of staging
    files = fast_io.Files()
    return FastReadEngine(
        files=files, max_inflight=inflight, threads=3, chunk_bytes=1024, read_ahead=ahead
    )


def _which(path: str, names: list[str]):
    """The destination a read at ``pos`` of ``path`` belongs to."""
    return lambda pos: names[pos // (ROWS * COLS * 4)]


def _track_reads(monkeypatch, path, names: list[str]) -> dict[str, threading.Event]:
    """An event per destination, set when the first read of its bytes starts."""
    which = _which(path, names)
    started = {n: threading.Event() for n in names}
    real = fast_io.read_exact

    def read_exact(fd, buf, pos, p):
        started[which(pos)].set()
        return real(fd, buf, pos, p)

    monkeypatch.setattr(fast_tasks, "read_exact", read_exact)
    return started


@pytest.mark.parametrize("inflight", [1, 2])
def test_next_destinations_are_read_before_the_previous_one_is_committed(
    tmp_path, monkeypatch, inflight
):
    names = [f"w{k}" for k in range(6)]
    path, values = _files(tmp_path, names)
    started = _track_reads(monkeypatch, path, names)

    seen: dict[str, bool] = {}

    def before_commit(fqn: str) -> None:
        # the destination max_inflight places on must be reading by now: its reads were issued
        # while this one was live, not after its commit
        k = names.index(fqn) + inflight
        if k < len(names):
            seen[fqn] = started[names[k]].wait(10)

    planner = Recorder(names, before_commit)
    engine = _engine(inflight, ahead=2 * 4096)
    engine.run(_jobs(path, names), planner)
    assert seen and all(seen.values()), seen
    # at most max_inflight scratches were ever live, and as many were
    assert planner.peak_live == inflight
    # the scratches were resolved, and the destinations committed, in plan order, here
    assert planner.threads == {threading.get_ident()}
    assert [n for c, n in planner.calls if c == "commit"] == names
    assert list(dict.fromkeys(n for c, n in planner.calls if c == "resolve")) == names
    for n in names:
        assert torch.equal(planner.values[n], values[n]), n
    # staging: the budget in 1 KiB buffers, never more
    assert engine.ahead_bytes == 2 * 4096 and engine._ahead._made <= 8


def test_without_read_ahead_the_next_destination_waits_for_the_commit(tmp_path, monkeypatch):
    # the behaviour read-ahead changes (and a host load keeps): no read of w1 before w0's commit
    names = ["w0", "w1", "w2"]
    path, values = _files(tmp_path, names)
    started = _track_reads(monkeypatch, path, names)

    early: list[str] = []

    def before_commit(fqn: str) -> None:
        k = names.index(fqn) + 1
        if k < len(names) and started[names[k]].wait(0.3):
            early.append(names[k])

    planner = Recorder(names, before_commit)
    engine = _engine(1, ahead=0)
    engine.run(_jobs(path, names), planner)
    assert early == [] and planner.peak_live == 1 and engine.ahead_bytes == 0
    assert all(torch.equal(planner.values[n], values[n]) for n in names)


def test_a_failed_read_ahead_names_the_tensor(tmp_path):
    names = ["w0", "w1", "w2", "w3"]
    path, _ = _files(tmp_path, names, short="w2")  # w2's bytes stop 100 bytes in
    planner = Recorder(names)
    with pytest.raises(CheckpointError, match=r"^w2: .*data\.bin: truncated: ") as err:
        _engine(1, ahead=2 * 4096).run(_jobs(path, names), planner)
    assert "\n" not in str(err.value)
    # what came before it was committed in order; nothing after it
    assert [n for c, n in planner.calls if c == "commit"] == ["w0", "w1"]


def test_a_failure_while_read_ahead_waits_for_staging_does_not_hang(tmp_path, monkeypatch):
    # w0 (live) fails while w1's tasks wait for the one staging buffer that w1 itself holds
    # until its admission: the load stops with w0's error instead of waiting forever
    names = ["w0", "w1"]
    path, _ = _files(tmp_path, names)
    blocked = threading.Event()
    real_acquire, real_read = fast_io.PinnedPool.acquire, fast_io.read_exact

    def acquire(self, until=None, *, hold=False):
        full = not self._free and self._made >= self._count
        if hold and (full or self._holds >= self._hold_cap):
            blocked.set()  # a read-ahead task is about to wait for a staging buffer
        return real_acquire(self, until, hold=hold)

    def read_exact(fd, buf, pos, p):
        if pos == 0:  # w0's first piece: fails once a read-ahead task waits
            assert blocked.wait(10)
            raise CheckpointError(f"{p}: cannot read (Input/output error)")
        return real_read(fd, buf, pos, p)

    monkeypatch.setattr(fast_io.PinnedPool, "acquire", acquire)
    monkeypatch.setattr(fast_tasks, "read_exact", read_exact)
    planner = Recorder(names)
    with pytest.raises(CheckpointError, match=r"^w0: .*data\.bin: cannot read \(Input/output"):
        _engine(1, ahead=1024).run(_jobs(path, names), planner)
    assert blocked.is_set() and not planner.values


def test_staging_keeps_at_most_its_share_of_a_shared_pool():
    # on CUDA the read-ahead stages in the pinned pool of the direct reads: whatever staging
    # keeps, the direct reads (which give their buffer back after queueing its copy) still get
    # buffers, so the window's head never waits for a later destination's admission
    pool = fast_io.PinnedPool(64, 2, pin=False)
    pool.add_holds(2)
    kept = [pool.acquire(hold=True) for _ in range(2)]
    assert pool.acquire(lambda: True, hold=True) is None  # it would wait: its share is kept
    direct = [pool.acquire(), pool.acquire()]
    assert all(b is not None for b in direct + kept)
    for b in direct:
        pool.release(b, None)
    assert pool.acquire(lambda: True, hold=True) is None  # free buffers, but not its share
    pool.release(kept.pop(), None, held=True)
    assert pool.acquire(lambda: True, hold=True) is not None
    assert pool._made == 4  # nothing made past the count
