"""The GPU export's per-tensor work without per-tensor waits (issue 18), checked on the CPU.

* the source-weight guard's verdict is computed without reading a value of the weight on the
  host (on a GPU each such read is a wait for the device), and agrees with the check that makes
  the message;
* the device path (jobs of several consecutive items, outputs and verdicts copied into one
  host block with one wait) runs on the CPU when the pipeline is told every quantized item goes
  to "the device": the files are byte-identical to the plain export's, every budget byte comes
  back, and a refused tensor inside a batch gives the same one-line error as alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qckpt.export.budget as budget
import qckpt.export.stages as pipe
from qckpt.errors import ExportError
from qckpt.export.guard import check_source_weight, refuse_source_weight
from qckpt.export.stages import Pipeline
from qckpt.export.writer import WriteOptions
from qckpt.layouts.export_layout import CHUNK_ELEMS
from tests.export_fixtures import (
    make_calibration,
    quant_config,
    run_export,
    saved_model,
    tampered,
)


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _refused(module, w, amax) -> bool:
    try:
        refuse_source_weight(module, w, amax)
    except ExportError:
        return True
    return False


def _cases():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16)
    per_t = w.float().abs().amax()
    per_row = w.float().abs().amax(dim=1, keepdim=True)
    tall = (torch.randn(CHUNK_ELEMS // 16 + 40, 32, generator=g)).to(torch.bfloat16)  # 2 chunks
    nan, inf, grown = w.clone(), w.clone(), w.clone()
    nan[3, 5] = float("nan")
    inf[60, 0] = float("-inf")
    grown[7].mul_(3.0)
    tall_bad = tall.clone()
    tall_bad[-1, -1] = 1e4
    return {
        "clean tensor": (w, per_t, False),
        "clean rows": (w, per_row, False),
        "nan": (nan, per_t, True),
        "inf rows": (inf, per_row, True),
        "grown tensor": (grown, per_t, True),
        "grown rows": (grown, per_row, True),
        "just under the tolerance": (w, per_t / 1.0624, False),
        "just over the tolerance": (w, per_t / 1.07, True),
        "nan amax refuses nothing": (w, torch.tensor(float("nan")), False),
        "two chunks clean": (tall, tall.float().abs().amax(), False),
        "two chunks, last row over": (tall_bad, tall.float().abs().amax(), True),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_the_guards_verdict_reads_nothing_of_the_weight_on_the_host_and_agrees_with_its_check(
    case,
):
    w, amax, bad = _cases()[case]
    # on the meta device a weight has no values: a verdict that read one of them (a wait for
    # the device on a GPU) would raise; the calibrated amax is on the host, as in an export
    with _HostReads() as reads:
        on_meta = check_source_weight("m", w.to("meta"), amax)
    assert on_meta.device.type == "meta" and on_meta.shape == () and on_meta.dtype == torch.bool
    assert reads.n <= 1  # at most the host amax's finiteness, read where it is
    verdict = check_source_weight("m", w, amax)
    assert verdict.dtype == torch.bool and verdict.shape == ()
    assert bool(verdict) is bad is _refused("m", w, amax)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    model, hf_dir = saved_model(root, "tiny-dense")
    return root, model, hf_dir


def _export(model, src, out, q, cal, quantizers=1):
    return run_export(model, src, cal, out, q, options=WriteOptions(quantizers=quantizers))


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture
def device_path(monkeypatch):
    """Every quantized item takes the device path (batches, one host block, deferred verdicts)
    while the device is the CPU; records each job's items and the budgets left at the end."""
    seen: dict[str, list] = {"jobs": [], "left": []}
    real_process, real_run = Pipeline._process, Pipeline.run

    def process(self, batch):
        seen["jobs"].append([it.entry.name for it, _ in batch if it.entry is not None])
        return real_process(self, batch)

    def run(self, *a):
        try:
            return real_run(self, *a)
        finally:
            seen["left"].append((self.budget.used, self.dev_budget.used))

    monkeypatch.setattr(Pipeline, "_on_device", lambda self, it: it.quantized_only)
    monkeypatch.setenv("QCKPT_EXPORT_BULK", "0")  # the per-item path (runs: test_export_bulk)
    monkeypatch.setattr(Pipeline, "_process", process)
    monkeypatch.setattr(Pipeline, "run", run)
    return seen


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_the_device_path_writes_the_same_files_and_gives_every_byte_back(
    dense, device_path, granularity
):
    root, model, hf_dir = dense
    q = quant_config(granularity, "static" if granularity == "tensor" else "token")
    cal = make_calibration(model, q)
    plain = root / f"plain-{granularity}"
    with pytest.MonkeyPatch.context() as m:  # the real CPU path, for the reference files
        m.setattr(Pipeline, "_on_device", lambda self, it: False)
        _export(model, hf_dir, plain, q, cal)
    out = root / f"device-{granularity}"
    _export(model, hf_dir, out, q, cal, quantizers=2)
    assert _digest(out) == _digest(plain)
    assert device_path["left"][-1] == (0, 0)
    assert sum(len(j) for j in device_path["jobs"][-100:]) >= 14


def test_a_refused_tensor_on_the_device_path_gives_the_first_ones_one_line_error(
    dense, device_path
):
    """Two bad weights; whether they share a batch or not, the first in plan order is named,
    with the message of the plain check, and nothing is left behind."""
    root, model, hf_dir = dense
    q = quant_config("tensor", "static")
    cal = make_calibration(model, q)
    first, second = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight"

    def spoil(sd):
        sd[first][7].mul_(3.0)
        sd[second][3, 5] = float("nan")

    bad = tampered(root, hf_dir, "two-bad", spoil)
    out = root / "out-two-bad"
    with pytest.raises(ExportError) as e:
        _export(model, bad, out, q, cal)
    msg = str(e.value)
    assert msg.startswith(f"{first}: amax ") and "exceeds the calibrated weight amax" in msg
    assert "\n" not in msg and not out.exists()

    nan = float("nan")
    only_nan = tampered(root, hf_dir, "nan-only", lambda sd: sd[second].__setitem__((3, 5), nan))
    with pytest.raises(ExportError) as e:
        _export(model, only_nan, out, q, cal)
    assert str(e.value) == (
        f"{second}: not finite (NaN or Inf in row 3) in the checkpoint; refusing to quantize it"
    )
    assert not out.exists()


class _Item:
    def __init__(self, n: int, dev: bool = True) -> None:
        self.host_bytes, self.out_bytes, self.quantized_only = n, n // 2, dev


class _Queue:
    """A ready queue whose items arrive one per ``get`` with a timeout after ``late`` of them
    were there at once (the rest come while the quantize threads are busy)."""

    def __init__(self, items: list, late: int = 0) -> None:
        self.items, self.late = items, late

    def get_nowait(self):
        if len(self.items) <= self.late:
            import queue

            raise queue.Empty
        return self.items.pop(0)

    def get(self, timeout):
        if self.late:
            self.late -= 1
            return self.items.pop(0)
        return self.get_nowait()


def _batch(queued: list, cap: int, busy: int = 0, late: int = 0):
    """_batch of a fake pipeline: ``busy``: how many times it finds every quantize thread busy."""
    fake = type("P", (), {})()
    fake._on_device = lambda it: it.quantized_only
    polls = iter([True] * busy)
    fake._pool_full = lambda: next(polls, False)
    fake.dev_budget = budget.HostBudget(cap)
    fake.ready, fake.back = _Queue(list(queued), late), []
    first = queued.pop(0)
    fake.ready.items.pop(0)
    return Pipeline._batch(fake, first), fake.back, fake.ready.items


def test_a_batch_takes_only_queued_device_items_within_its_bytes():
    mib = pipe.MiB
    f = cf.Future()
    small = [(_Item(2 * mib), f) for _ in range(20)]
    # 3 MiB each with outputs: ten fit 32 MiB; the 11th is put back, the rest stay queued
    batch, back, left = _batch(list(small), cap=1 << 40)
    assert len(batch) == 10 and back == [small[10]] and left == small[11:]
    # half the device budget bounds it too (two jobs on the device at once)
    batch, back, _ = _batch(list(small), cap=13 * mib)
    assert len(batch) == 2 and back == [small[2]]
    # an item that stays on the host, or the end of the queue, ends a batch and is put back
    host = (_Item(mib, dev=False), f)
    batch, back, _ = _batch([small[0], small[1], host, small[2]], cap=1 << 40)
    assert batch == small[:2] and back == [host]
    batch, back, _ = _batch([small[0], None], cap=1 << 40)
    assert batch == small[:1] and back == [None]
    # a first item that stays on the host is a job of its own
    batch, back, left = _batch([host, small[0]], cap=1 << 40)
    assert batch == [host] and back == [] and left == [small[0]]
    # nothing queued and a quantize thread free: the batch does not wait
    batch, back, _ = _batch([small[0]], cap=1 << 40)
    assert batch == small[:1] and back == []
    # every thread busy: the items that arrive meanwhile join the batch until one is free
    batch, back, left = _batch(list(small[:6]), cap=1 << 40, busy=3, late=5)
    assert batch == small[:4] and back == [] and left == small[4:6]


def test_a_pinned_read_is_counted_at_the_size_torch_pins():
    """torch's pinned allocator rounds a block up to a power of two: the host budget counts a
    GPU item's read at that size (a CPU export's reads are counted as they are)."""
    mib = pipe.MiB
    fake = type("P", (), {})()
    fake._on_device = lambda it: it.quantized_only
    fake._pinned = lambda it: Pipeline._pinned(fake, it)
    for device, n, want in [
        ("cuda", 3 * mib, 4 * mib),
        ("cuda", 4 * mib, 4 * mib),
        ("cuda", 4 * mib + 1, 8 * mib),
        ("cpu", 3 * mib, 3 * mib),
    ]:
        fake.device = torch.device(device)
        assert Pipeline._host_cost(fake, _Item(n)) == want
    fake.device = torch.device("cuda")
    assert Pipeline._host_cost(fake, _Item(3 * mib, dev=False)) == 3 * mib
