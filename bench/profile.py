"""Where a command's threads spend their time: a sampling profiler for any ``python -m`` module.

    python -m bench.profile --out prof.txt -- -m qckpt export RECIPE --json r.json

The module runs in this process (``runpy``) while a daemon thread looks at every other thread's
Python stack every ``--interval`` seconds (``sys._current_frames``). cProfile sees only the
calling thread and slows every call; sampling sees the read, quantize and write pools at once
and costs one stack walk per thread per sample. A thread blocked in C (a pwrite, a CUDA sync, a
lock) shows as the Python frame that called into C, which is what tells one wait from another.

The report, per thread group (a pool's threads together): samples, then the innermost frames
(``file:function``) and the innermost qckpt frames, each with its share of the group's samples.
"""

from __future__ import annotations

import argparse
import collections
import re
import runpy
import sys
import threading
import time
from pathlib import Path


def _where(frame) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{code.co_name}"


def _own(frame) -> str | None:
    """The innermost frame whose file is under a qckpt or bench directory."""
    while frame is not None:
        name = frame.f_code.co_filename
        if "/qckpt/" in name or "/bench/" in name:
            return f"{_where(frame)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class Sampler:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = re.sub(r"[_-]?\d+(_\d+)?$", "", names.get(ident, "?"))
                self.samples[group] += 1
                self.leaf[group][_where(frame)] += 1
                self.own[group][_own(frame) or "(outside qckpt)"] += 1

    def __enter__(self) -> Sampler:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.t0

    def report(self, top: int) -> str:
        lines = [f"wall {self.seconds:.2f} s, one sample per {self.interval * 1e3:.1f} ms"]
        for group, n in self.samples.most_common():
            lines.append(f"\n== {group}: {n} samples ({n * self.interval:.1f} thread-s)")
            for title, table in (("innermost", self.leaf[group]), ("qckpt", self.own[group])):
                lines.append(f"  -- {title}")
                for where, k in table.most_common(top):
                    lines.append(f"  {100 * k / n:5.1f}%  {where}")
        return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--interval", type=float, default=0.005)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- -m MODULE ARGS...")
    args = ap.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if len(rest) < 2 or rest[0] != "-m":
        ap.error("give the command as: -- -m MODULE [ARGS...]")
    sys.argv = [rest[1], *rest[2:]]
    rc = 0
    with Sampler(args.interval) as s:
        try:
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    args.out.write_text(s.report(args.top))
    print(f"profile: {args.out}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
