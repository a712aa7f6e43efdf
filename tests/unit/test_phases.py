"""Where a command's time and memory go (issues 17 and 18): the phase recorder, the phase
breakdown and whole-command peaks in every command's ``--json``, and peaks never reset."""

from __future__ import annotations

import json
import re
import time

import pytest

from qckpt import phases
from tests.conftest import ROOT, run_qckpt


@pytest.fixture
def recorder():
    rec = phases.begin(sample_anon_s=None)
    yield rec
    phases.end()


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_nested_phases_are_exclusive_and_sum_to_the_total(recorder):
    with phases.phase(phases.READ):
        _spin(0.05)
        with phases.phase(phases.SYNC):
            _spin(0.05)
    with phases.phase(phases.WRITE):
        _spin(0.02)
    got = recorder.phases()
    # the sync inside the read is charged to sync only
    assert 0.045 <= got["sync"] < 0.045 + 0.5
    assert 0.045 <= got["read"] < got["read"] + got["sync"] < 0.1 + 0.5
    assert got["write"] >= 0.015
    parts = sum(v for k, v in got.items() if k != "total")
    assert parts == pytest.approx(got["total"], abs=1e-3)
    assert got["startup"] > 0  # the process started before the recorder


def test_an_open_phase_counts_up_to_now_and_the_startup_ends_at_the_first_phase(recorder):
    _spin(0.03)
    with phases.phase(phases.BUILD):
        _spin(0.03)
        mid = recorder.phases()
    assert mid["build"] >= 0.025 and mid["startup"] >= 0.025
    # start-up time is not charged again once the work began
    assert recorder.phases()["startup"] == pytest.approx(mid["startup"], abs=1e-3)


def test_startup_parts_divide_the_startup_without_ending_it(recorder):
    with phases.startup_part(phases.TORCH):
        _spin(0.03)
        with phases.startup_part(phases.MODEL_CODE):  # parts do not nest: counted once
            _spin(0.02)
    _spin(0.01)
    mid = recorder.startup_parts()
    assert mid[phases.TORCH] >= 0.045 and phases.MODEL_CODE not in mid
    assert mid[phases.BEFORE_MAIN] == pytest.approx(recorder.age_at_begin, abs=1e-3)
    with phases.phase(phases.BUILD):  # the start-up ends here; a part inside it counts nothing
        with phases.startup_part(phases.RECIPE):
            _spin(0.02)
    parts, ph = recorder.startup_parts(), recorder.phases()
    assert phases.RECIPE not in parts and ph["build"] >= 0.015
    # the parts and their "other" are the start-up, no more and no less
    assert sum(parts.values()) == pytest.approx(ph["startup"], abs=2e-3)
    assert parts["other"] >= 0.005  # the spin outside any part
    assert set(parts) <= set(phases.PART_NAMES) | {"other"}


def test_phase_is_free_and_silent_without_a_recorder():
    phases.end()
    with phases.phase(phases.READ):
        pass
    assert phases.summary() == {}


def test_timed_charges_every_call(recorder):
    @phases.timed(phases.SYNC)
    def f(x):
        _spin(0.01)
        return x + 1

    assert f(1) == 2 and f(2) == 3
    assert recorder.phases()["sync"] >= 0.018


# ---- peaks are never reset ---------------------------------------------------------------------

_RESETS = re.compile(r"reset_peak_memory_stats|reset_max_memory_(allocated|cached)|clear_refs")


def test_no_peak_counter_is_reset_anywhere_in_qckpt():
    """A reset mid-command would make the whole-command peaks of every report a lie."""
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "qckpt").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if _RESETS.search(line)
    ]
    assert not hits, hits


class _FakeAllocator:
    """torch.cuda's counters as the meter reads them; a reset raises."""

    def __init__(self, alloc: int, high: int) -> None:
        self.alloc, self.high = alloc, high

    def to(self, n: int) -> None:
        self.alloc = n
        self.high = max(self.high, n)

    def install(self, monkeypatch) -> None:
        import torch

        def reset(*a, **k):
            raise AssertionError("peak counters reset mid-command")

        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.alloc)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.high)
        # what the load's meter reads (one stats call for both numbers)
        monkeypatch.setattr(
            torch.cuda,
            "memory_stats_as_nested_dict",
            lambda *a: {"allocated_bytes": {"all": {"current": self.alloc, "peak": self.high}}},
        )
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)


@pytest.mark.parametrize(
    ("earlier_high", "exact"),
    [(100, True), (1000, False)],
    ids=["load-raises-the-high", "load-under-an-earlier-high"],
)
def test_meter_measures_windows_without_resetting(monkeypatch, earlier_high, exact):
    from qckpt.load.meter import MemoryMeter

    a = _FakeAllocator(alloc=100, high=earlier_high)
    a.install(monkeypatch)
    m = MemoryMeter("cuda")
    m.open_window()
    a.to(300)  # the scratch
    m.sample(fresh=True)  # as the planner samples right after allocating a scratch
    a.to(350)  # a quantize temporary nobody samples
    a.to(100)
    m.close_window()
    if exact:  # the window raised the allocator's high: its peak is known exactly
        assert (m.transient, m.device_peak) == (250, 350)
        assert "lower bound" not in m.measured_by
    else:  # under the command's earlier high: what was sampled, said to be a bound
        assert (m.transient, m.device_peak, m.transient_bound) == (200, 300, 900)
        assert "lower bound" in m.measured_by and "900" in m.measured_by


# ---- every command's --json ----------------------------------------------------------------------

EXPECTED = {
    "convert": {"startup", "world", "build", "write"},
    "load": {"startup", "world", "build", "quantize", "read", "report"},
    "calibrate": {"startup", "world", "build", "data", "read", "forward", "sync", "write"},
    "export": {"startup", "plan", "write", "report"},
}


def _run(cmd: str, *args: str, cwd) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = run_qckpt(cmd, *args, "--json", f"{cmd}.json", cwd=cwd)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    assert "  time " in r.stderr and "  peak host RSS " in r.stderr  # the summary's lines
    return json.loads((cwd / f"{cmd}.json").read_text()), wall


def test_every_command_reports_its_phases_and_whole_command_peaks(tmp_path):
    recipe = str(ROOT / "configs" / "tiny-moe.yaml")
    sets = [
        "--set", "checkpoint.path=dcp",
        "--set", "calibrate.output=calib.safetensors",
        "--set", "export.output=fp8",
    ]  # fmt: skip
    runs = {
        "convert": _run("convert", recipe, "dcp", *sets, cwd=tmp_path),
        "load": _run("load", recipe, *sets, cwd=tmp_path),
        "calibrate": _run("calibrate", recipe, *sets, cwd=tmp_path),
        "export": _run("export", recipe, *sets, cwd=tmp_path),
    }
    for cmd, (data, wall) in runs.items():
        ph = data["phases"]
        assert EXPECTED[cmd] <= set(ph), (cmd, ph)
        assert set(ph) <= set(phases.NAMES) | {"other", "total"}, (cmd, ph)
        assert all(v >= 0 for v in ph.values()), (cmd, ph)
        parts = sum(v for k, v in ph.items() if k != "total")
        # from the process start, which came after this test started the clock
        assert parts <= ph["total"] + 1e-3 and ph["total"] <= wall, (cmd, ph, wall)
        assert ph["startup"] > 0.05, (cmd, ph)  # an interpreter and its imports take time
        # where the start-up went: its parts add up to it; torch and the model's code are there
        sp = data["startup_parts"]
        assert set(sp) <= set(phases.PART_NAMES) | {"other"}, (cmd, sp)
        assert sum(sp.values()) == pytest.approx(ph["startup"], abs=5e-3), (cmd, sp, ph)
        assert sp[phases.BEFORE_MAIN] > 0 and sp[phases.RECIPE] > 0, (cmd, sp)
        assert sp[phases.TORCH] > 0.05, (cmd, sp)
        if cmd == "export":  # the calibration file records the model: no model code imported
            assert phases.MODEL_CODE not in sp, (cmd, sp)
        else:
            assert sp[phases.MODEL_CODE] > 0.05, (cmd, sp)
        assert sp[phases.QCKPT_MODULES] > 0, (cmd, sp)
        assert data["compiled_at_import"]["modules"] >= 0, (cmd, data["compiled_at_import"])
        pk = data["peaks"]
        assert pk["device"] == "cpu" and pk["device_peak_bytes"] is None
        assert pk["host_peak_rss_bytes"] >= pk["host_peak_anon_bytes"] > 10 * 2**20, (cmd, pk)
    load, _ = runs["load"]
    run0 = load["runs"][0]
    # the whole command's peak holds the load window's (never reset in between)
    assert load["peaks"]["host_peak_rss_bytes"] >= run0["host_peak_rss_bytes"] > 0
    assert load["peaks"]["host_peak_rss_bytes"] >= run0["peak_bytes"]


def test_startup_counts_from_the_command_the_user_typed(monkeypatch):
    """A rank relaunched by ``--nproc-per-node`` counts from the relaunching command's start;
    a plain process from its own start (before this test ran, so older than the test)."""
    t_test = time.perf_counter()
    rec = phases.begin(sample_anon_s=None)
    own = rec.age_at_begin
    phases.end()
    assert own > time.perf_counter() - t_test and rec.started_at == "the process start"

    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv(phases.STARTED_ENV, f"{now - 5:.3f}")
    rec = phases.begin(sample_anon_s=None)
    phases.end()
    assert rec.started_at == "the relaunching command's start"
    assert 4.99 <= rec.age_at_begin < 5 + 60  # the env holds milliseconds
    assert rec.phases()["startup"] >= 4.99
