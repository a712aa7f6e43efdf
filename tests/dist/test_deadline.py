"""One deadline for a command's collectives: a stopped peer makes the survivor fail within about
``parallel.timeout_s``, not once per collective (forward, then sync, then report).

Real processes, as torchrun would start them (two ``python -m qckpt calibrate`` with the
torch.distributed environment), gloo, EP=2 so that the forward itself has collectives.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    d = tmp_path_factory.mktemp("deadline")
    save_model_dcp(build_model("tiny-moe"), d / "dcp")
    r = d / "r.yaml"
    # many small batches: the forward loop is still running when rank 1 is stopped
    r.write_text(
        "model: {source: tiny-moe}\n"
        f"checkpoint: {{path: {d / 'dcp'}}}\n"
        "load: {device: cpu}\n"
        "calibrate:\n"
        "  data: {source: synthetic, num_samples: 4000, seq_len: 16, batch_size: 2}\n"
        f"  output: {d / 'calib.safetensors'}\n"
        f"parallel: {{ep: 2, timeout_s: {TIMEOUT_S}}}\n"
    )
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, recipe) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    env.pop("QCKPT_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "qckpt", "calibrate", str(recipe), "--verbose"],
        cwd=recipe.parent,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """Every stderr line of ``proc`` as it comes (a thread drains the pipe so it never fills)."""
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stderr:
            q.put(line.rstrip("\n"))
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_for(q: queue.Queue, needle: str, limit_s: float) -> None:
    end = time.monotonic() + limit_s
    while True:
        line = q.get(timeout=max(0.1, end - time.monotonic()))
        assert line is not None, f"rank exited before printing {needle!r}"
        if needle in line:
            return


def test_stopped_peer_fails_the_survivor_within_the_timeout(recipe):
    port = _free_port()
    survivor, victim = _rank(0, port, recipe), _rank(1, port, recipe)
    try:
        out0, out1 = _lines(survivor), _lines(victim)
        _wait_for(out1, "calibrating on", limit_s=240)  # rank 1 is in its forward loop
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        rc = survivor.wait(timeout=6 * TIMEOUT_S)  # a hang fails here, not forever
        elapsed = time.monotonic() - t0
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.kill()
            p.wait()
    lines = []
    while (line := out0.get(timeout=10)) is not None:
        lines.append(line)
    errors = [ln for ln in lines if ln.startswith("qckpt: error")]
    assert rc == 1, lines
    assert elapsed < 1.5 * TIMEOUT_S, f"survivor took {elapsed:.1f} s; {lines}"
    assert len(errors) == 1 and not any("Traceback" in ln for ln in lines), lines
    assert errors[0].startswith("qckpt: error (rank 0): ")
    assert "died or timed out (parallel.timeout_s=10" in errors[0]
    assert not (recipe.parent / "calib.safetensors").exists()


def test_after_one_failed_collective_the_others_do_not_wait():
    from qckpt.errors import PeerError, SyncError
    from qckpt.parallel.deadline import Deadline

    calls = []

    def stuck():
        calls.append("stuck")
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete\nmore")

    dl = Deadline(10.0)
    with pytest.raises(PeerError, match=r"^forward failed: a rank died or timed out \("):
        dl.run("forward", stuck)
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="sync: not attempted, an earlier collective failed"):
        dl.run("sync", lambda: calls.append("sync"), error=SyncError)
    assert calls == ["stuck"] and time.monotonic() - t0 < 0.1
