"""How fast one process can write files in a directory (tmpfs by default): threads x files.

    python -m bench.write_ceiling                       # /dev/shm, 2 GB per case
    python -m bench.write_ceiling --dir /data/x --gb 4 --json ceiling.json

Why: a buffered write (``pwrite``) holds its file's inode lock while it copies, so threads
writing into one file take turns, and an export writing its shard files one after another
gets one copy at a time (``qckpt export``'s lanes, ``export_pipeline.lane_order``). Each case
writes ``--gb`` GB of one 64 MiB buffer (random bytes) in ``--chunk-mib`` pieces from
``threads`` threads into ``files`` files (thread ``t`` into file ``t % files``), each file made
empty at its full size first (``ftruncate``, as ``create_shard_file`` does); ``how``:

* ``pwrite``: what the export does;
* ``prealloc``: the same into files whose pages were allocated first (``posix_fallocate``, timed
  apart: ``alloc_s``), to tell the page allocation from the copy;
* ``mmap``: a shared mapping of the file, copied into with numpy (no inode lock, a page fault
  per page).

Reported per case: the best of ``--repeat`` runs (GB/s of the write alone, and with the
allocation for ``prealloc``) and the process's CPU seconds per wall second (1.0 with two threads
means they took turns). Files are removed after each run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MiB = 2**20
CASES = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4), (8, 8)]  # (threads, files)


def _one(root: Path, threads: int, files: int, how: str, total: int, chunk: int, buf) -> dict:
    per_file = total // files // chunk * chunk
    paths = [root / f"qckpt-ceiling-{i}" for i in range(files)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths]
    try:
        for fd in fds:
            os.ftruncate(fd, per_file)
        t0 = time.perf_counter()
        if how == "prealloc":
            for fd in fds:
                os.posix_fallocate(fd, 0, per_file)
        alloc_s = time.perf_counter() - t0
        maps = [mmap.mmap(fd, per_file) for fd in fds] if how == "mmap" else []
        pieces = [(f, off) for off in range(0, per_file, chunk) for f in range(files)]
        src = np.frombuffer(buf, dtype=np.uint8, count=chunk)
        view = memoryview(buf)[:chunk]

        def work(t: int) -> None:
            mine = [p for i, p in enumerate(pieces) if p[0] == t % files]
            mine = mine[t // files :: max(1, threads // files)] if threads > files else mine
            for f, off in mine:
                if maps:
                    np.copyto(np.frombuffer(maps[f], np.uint8, chunk, off), src)
                else:
                    os.pwrite(fds[f], view, off)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        c0, t0 = os.times(), time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        c1 = os.times()
        for m in maps:
            m.close()
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            p.unlink(missing_ok=True)
    written = per_file * files
    cpu = c1.user - c0.user + c1.system - c0.system
    return {
        "write_s": wall,
        "alloc_s": alloc_s,
        "gbps": written / wall / 1e9,
        "gbps_with_alloc": written / (wall + alloc_s) / 1e9,
        "cores": cpu / wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm", help="where the files go (default /dev/shm)")
    ap.add_argument("--gb", type=float, default=2.0, help="GB written per case")
    ap.add_argument("--chunk-mib", type=int, default=16, help="bytes per write call")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (the best is reported)")
    ap.add_argument("--how", default="pwrite,prealloc,mmap")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    chunk = args.chunk_mib * MiB
    total = int(args.gb * 1e9) // chunk * chunk
    buf = bytearray(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    root = Path(tempfile.mkdtemp(prefix="qckpt-ceiling-", dir=args.dir))
    rows = []
    try:
        for how in args.how.split(","):
            for threads, files in CASES:
                runs = [
                    _one(root, threads, files, how, total, chunk, buf) for _ in range(args.repeat)
                ]
                best = min(runs, key=lambda r: r["write_s"] + r["alloc_s"])
                row = {"how": how, "threads": threads, "files": files, **best}
                rows.append(row)
                print(
                    f"{how:>8} {threads} thread(s) -> {files} file(s): {row['gbps']:6.2f} GB/s"
                    + (
                        f" ({row['gbps_with_alloc']:.2f} with the allocation)"
                        if how == "prealloc"
                        else ""
                    )
                    + f", {row['cores']:.2f} cores",
                    flush=True,
                )
    finally:
        root.rmdir()
    if args.json:
        out = {"dir": args.dir, "bytes_per_case": total, "chunk_bytes": chunk, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
