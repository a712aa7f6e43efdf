"""Real multi-process gloo worlds for tests: one-shot, or kept alive across scenarios.

Spawning a rank costs seconds (importing torch, and transformers for model tests) on shared CPUs,
so tests that only need a working world share one :class:`World` (``shared_world(n)``) and send
it scenarios: module-level functions ``fn(rank, world, *args)`` run on every rank at once. A
scenario that raises reports the error instead of killing the rank, so "every rank raises" is a
plain assertion on the outcomes. Tests that break the world on purpose (a rank that dies) use
:func:`run_once`, where each rank runs one function and exits non-zero if it raised.

Every process group is created with ``timeout_s`` (10 s by default), so a regression fails, not
hangs; on top of that the parent gives up after ``deadline_s``, kills the ranks and fails the
test with "hang". Ranks run with one intra-op thread: they share a few cores.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")


@dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None  # "ExcType: message"
    error_type: str | None = None
    seconds: float = 0.0
    exitcode: int | None = None  # run_once only
    traceback: str | None = None

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"error={self.error!r}"
        return f"<rank {self.rank} {state} {self.seconds:.2f}s exit={self.exitcode}>"


class Hang(AssertionError):
    """Ranks did not report back before the deadline: the thing the protocol must never do."""


def _init(rank: int, world: int, init_file: str, timeout_s: float, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _call(rank: int, world: int, fn: Callable, args: tuple) -> Outcome:
    t0 = time.monotonic()
    try:
        value = fn(rank, world, *args)
        return Outcome(rank, True, value=value, seconds=time.monotonic() - t0)
    except BaseException as exc:  # noqa: BLE001 - the point is to report it to the parent
        return Outcome(
            rank,
            False,
            error=f"{type(exc).__name__}: {exc}",
            error_type=type(exc).__name__,
            seconds=time.monotonic() - t0,
            traceback=traceback.format_exc(),
        )


def _serve(rank, world, init_file, timeout_s, env, tasks, results) -> None:
    os.environ.update(env)
    _init(rank, world, init_file, timeout_s)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        results.put(_call(rank, world, fn, args))
    import torch.distributed as dist

    dist.destroy_process_group()


def _once(rank, world, init_file, timeout_s, env, fn, args, results, backend="gloo") -> None:
    os.environ.update(env)
    _init(rank, world, init_file, timeout_s, backend)
    out = _call(rank, world, fn, args)
    results.put(out)
    # Queue.put hands the item to a feeder thread: flush it before os._exit kills the process
    results.close()
    results.join_thread()
    # a failed rank exits non-zero as a CLI would; no destroy_process_group, which can wait on
    # peers that are gone
    os._exit(0 if out.ok else 1)


_ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error"}


def _collect(procs, results, world: int, deadline_s: float, what: str) -> list[Outcome]:
    got: dict[int, Outcome] = {}
    end = time.monotonic() + deadline_s
    dead_since: dict[int, float] = {}
    while len(got) < world:
        try:
            o = results.get(timeout=0.1)
            got[o.rank] = o
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r not in got and p.exitcode is not None:
                # give its last message a moment to arrive before calling it dead
                if now - dead_since.setdefault(r, now) > 1.0:
                    got[r] = Outcome(
                        r,
                        False,
                        error=f"died with exit code {p.exitcode}",
                        error_type="Died",
                        exitcode=p.exitcode,
                    )
        if now > end:
            missing = sorted(set(range(world)) - set(got))
            raise Hang(f"{what}: ranks {missing} did not finish within {deadline_s:.0f}s: hang")
    return [got[r] for r in range(world)]


class World:
    """``n`` gloo ranks kept alive; :meth:`run` runs one scenario on all of them."""

    def __init__(self, n: int, *, timeout_s: float = 10.0, env: dict[str, str] | None = None):
        self.n = n
        self._dir = tempfile.TemporaryDirectory(prefix="qckpt-world-")
        init_file = os.path.join(self._dir.name, "store")
        self._tasks = [_CTX.Queue() for _ in range(n)]
        self._results = _CTX.Queue()
        e = {**_ENV, **(env or {})}
        self._procs = [
            _CTX.Process(
                target=_serve,
                args=(r, n, init_file, timeout_s, e, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(n)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable, *args: Any, deadline_s: float = 60.0) -> list[Outcome]:
        if self.broken:
            raise RuntimeError("this world is broken by an earlier hang or death")
        for q in self._tasks:
            q.put((fn, args))
        try:
            out = _collect(self._procs, self._results, self.n, deadline_s, fn.__name__)
        except Hang:
            self.close()
            raise
        if any(o.error_type == "Died" for o in out):
            self.close()
        return out

    def close(self) -> None:
        self.broken = True
        for q, p in zip(self._tasks, self._procs, strict=True):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


_SHARED: dict[int, World] = {}


def shared_world(n: int) -> World:
    """A live world of ``n`` ranks shared by every test of this pytest process."""
    w = _SHARED.get(n)
    if w is None or w.broken:
        w = _SHARED[n] = World(n)
    return w


@atexit.register
def _close_shared() -> None:
    for w in _SHARED.values():
        if not w.broken:
            w.close()


def run_once(
    fn: Callable,
    n: int,
    *args: Any,
    timeout_s: float = 10.0,
    deadline_s: float = 90.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
) -> list[Outcome]:
    """Spawn ``n`` fresh ranks, run ``fn(rank, n, *args)`` on each, exit; outcomes by rank.

    ``backend="nccl"`` puts rank r on CUDA device r (for tests/gpu).
    """
    with tempfile.TemporaryDirectory(prefix="qckpt-once-") as d:
        results = _CTX.Queue()
        e = {**_ENV, **(env or {})}
        procs = [
            _CTX.Process(
                target=_once,
                args=(r, n, os.path.join(d, "store"), timeout_s, e, fn, args, results, backend),
                daemon=True,
            )
            for r in range(n)
        ]
        for p in procs:
            p.start()
        try:
            out = _collect(procs, results, n, deadline_s, fn.__name__)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        for o, p in zip(out, procs, strict=True):
            o.exitcode = p.exitcode
        return out


def calibrate_tiny_moe(world: int, path, out, data: dict, hooks=None):  # noqa: ANN001
    """``qckpt calibrate``'s library call on the built-in tiny MoE, its checkpoint at ``path``
    (HF safetensors), over a gloo world of ``world`` ranks (none for one)."""
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.calibrate import calibrate
    from qckpt.recipe import recipe_from_dict

    recipe = recipe_from_dict(
        {
            "model": {"source": "tiny-moe"},
            "checkpoint": {"path": str(path), "format": "safetensors"},
            "calibrate": {"data": data, "output": str(out)},
            "parallel": {"timeout_s": 10},
        }
    )
    mesh = init_mesh(timeout_s=10, device="cpu") if world > 1 else Mesh()
    return calibrate(recipe, mesh) if hooks is None else calibrate(recipe, mesh, hooks=hooks)
