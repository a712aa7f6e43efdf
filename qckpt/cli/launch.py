"""``--nproc-per-node N``: relaunch the same command as N ranks on this machine.

The caller validates everything it can first (the recipe, the world size, output paths, model
sources), so a bad recipe is one line and exit 2 without starting a rank. Then this process
starts the N ranks itself (:func:`spawn_ranks`: the environment torchrun would give them, a
free port on the loopback for the process group's store) and watches them: when one fails the
others are stopped, as torchrun stops them. Not torchrun itself, by default: its launcher
imports torch and runs an elastic agent before any rank starts, 2-4 s of every distributed
command's start-up for features a one-machine run does not use (restarts, rendezvous).
``QCKPT_LAUNCHER=torchrun`` runs the ranks under :mod:`qckpt.cli._torchrun` (torchrun with its
own output silenced) instead; a user may also run ``torchrun ... -m qckpt ...``. Each rank that fails
writes its one-line error and exit code to a file of its own in a temp dir
(:func:`rank_error`) instead of printing it; the parent prints the first failure's line and
exits with that rank's code. A rank that dies without a word (a signal, the OOM killer) is
reported from the launcher's summary: its rank and exit code or signal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qckpt.phases import STARTED_ENV, process_started_at

RANK_ERRORS_ENV = "QCKPT_RANK_ERRORS"
LAUNCHER_FILE = "launcher.json"
_INTERRUPTED = (130, 143)  # a rank stopped by torchrun because another one failed first


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _strip_nproc(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        out.append(a)
    return out


def will_relaunch(nproc: int) -> bool:
    return nproc > 1 and not under_torchrun()


def relaunch(nproc: int) -> int | None:
    """Run this very command under torchrun with ``nproc`` ranks; None when nothing to do."""
    if not will_relaunch(nproc):
        return None
    with tempfile.TemporaryDirectory(prefix="qckpt-ranks-") as errors:
        args = ["-m", "qckpt", *_strip_nproc(sys.argv[1:])]
        env = {**os.environ, RANK_ERRORS_ENV: errors}
        started = process_started_at()
        if started is not None:  # the ranks' start-up phase counts from this command's start
            env[STARTED_ENV] = f"{started:.3f}"
        if os.environ.get("QCKPT_LAUNCHER", "") == "torchrun":
            # what torchrun would set for several ranks per node, set before it prints a banner
            env.setdefault("OMP_NUM_THREADS", "1")
            cmd = [sys.executable, "-m", "qckpt.cli._torchrun", "--standalone"]
            cmd += [f"--nproc-per-node={nproc}", *args]
            code = _wait(subprocess.Popen(cmd, env=env))
        else:
            code = spawn_ranks(nproc, args, env, Path(errors))
        if code == 0:
            return 0
        line, code = first_failure(Path(errors), code)
        print(line, file=sys.stderr)
        return code


# how long ranks stopped because another failed get to exit before they are killed
STOP_GRACE_S = 30.0


def _free_port() -> int:
    """A TCP port free on the loopback now (rank 0's store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun's ``--standalone`` gives rank ``rank`` of one node (the names
    ``torch.distributed``'s ``env://`` init reads, and the local ones)."""
    out = dict(env)
    out.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks per node
    for k, v in (
        ("RANK", rank),
        ("LOCAL_RANK", rank),
        ("GROUP_RANK", 0),
        ("ROLE_RANK", rank),
        ("WORLD_SIZE", nproc),
        ("LOCAL_WORLD_SIZE", nproc),
        ("ROLE_WORLD_SIZE", nproc),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port),
    ):
        out[k] = str(v)
    return out


def spawn_ranks(nproc: int, args: list[str], env: dict[str, str], errors: Path) -> int:
    """Run ``python ARGS`` as ``nproc`` ranks; 0 when every rank exits 0. When one fails the
    others get SIGTERM (SIGKILL after :data:`STOP_GRACE_S`), and the ranks' exit codes, the
    first failure first, go to the launcher file that :func:`first_failure` reads."""
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, *args], env=_rank_env(env, r, nproc, port))
        for r in range(nproc)
    ]
    failures: dict[int, int] = {}
    try:
        while any(p.poll() is None for p in procs) and not failures:
            failures = {r: p.returncode for r, p in enumerate(procs) if p.poll() not in (None, 0)}
            time.sleep(0.05)
        failures = failures or {
            r: p.returncode for r, p in enumerate(procs) if p.returncode not in (None, 0)
        }
        if failures:
            _stop(procs)
            failures.update(
                (r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (0, None)
            )
    except BaseException:  # Ctrl-C or SIGTERM here: the ranks stop too, then it re-raises
        _stop(procs)
        raise
    if not failures:
        return 0
    (errors / LAUNCHER_FILE).write_text(json.dumps({str(r): c for r, c in failures.items()}))
    return 1


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after the grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait(proc: subprocess.Popen) -> int:
    """Wait for the launcher; on Ctrl-C or SIGTERM here, let it stop its ranks, then re-raise.

    Killing it outright would orphan the ranks, so it gets SIGTERM (torchrun then terminates
    the ranks, and kills them after its own grace period) and is waited for.
    """
    try:
        return proc.wait()
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise


def rank_error(line: str, code: int) -> bool:
    """Under our launcher, file this rank's one-line error for the parent; False otherwise."""
    d = os.environ.get(RANK_ERRORS_ENV)
    if not d or not under_torchrun():
        return False
    rank = os.environ.get("RANK", "0")
    try:
        tmp = Path(d) / f".rank-{rank}.tmp"
        tmp.write_text(json.dumps({"time": time.time(), "code": code, "line": line}))
        os.replace(tmp, Path(d) / f"rank-{rank}.json")
    except OSError:
        return False
    return True


def first_failure(errors: Path, launcher_code: int) -> tuple[str, int]:
    """The line and exit code to show for a failed run: the earliest rank error, preferring a
    real failure over ranks that were only stopped because of it."""
    found = []
    for f in errors.glob("rank-*.json"):
        try:
            e = json.loads(f.read_text())
            found.append((int(e["code"]) in _INTERRUPTED, float(e["time"]), e["line"], e["code"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if found:
        _, _, line, code = min(found)
        return str(line), int(code)
    try:
        failures = json.loads((errors / LAUNCHER_FILE).read_text())
        rank, code = next(iter(failures.items()))
    except (OSError, ValueError, StopIteration):
        return f"qckpt: error: the ranks' launcher failed (exit code {launcher_code})", (
            launcher_code or 1
        )
    code = int(code)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"qckpt: error (rank {rank}): killed by {name}", 128 - code
    return f"qckpt: error (rank {rank}): exited with code {code} without a message", code
