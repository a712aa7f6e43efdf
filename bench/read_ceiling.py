"""The host's own ceiling for reading a checkpoint dir: every file's bytes read in parallel
(``os.preadv`` on a thread pool, 16 MiB pieces) into a ring of pinned host buffers, with no
parsing and no quantization; on CUDA also with each piece copied to the device (a ring of
device buffers), which is the most any loader can do on this host.

    python -m bench.read_ceiling DIR [--threads N] [--device cuda] [--warm]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from qckpt.read.fast_io import byte_view
from qckpt.read.read_sizes import CHUNK_BYTES, default_threads


def _data_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.iterdir() if p.is_file() and p.suffix in (".distcp", ".safetensors")
    )


def read_ceiling(
    root: str | os.PathLike, *, threads: int | None = None, device: str = "cpu", warm: bool = False
) -> dict:
    """GB/s of a parallel read of ``root``'s data files into pinned memory (and to ``device``
    when it is CUDA); ``warm``: one unmeasured pass first, so the page cache holds them."""
    files = _data_files(Path(root))
    threads = threads or default_threads()
    cuda = torch.device(device).type == "cuda"
    total = sum(f.stat().st_size for f in files)
    pieces = [
        (f, pos, min(CHUNK_BYTES, f.stat().st_size - pos))
        for f in files
        for pos in range(0, f.stat().st_size, CHUNK_BYTES)
    ]
    out = {"bytes": total, "files": len(files), "threads": threads}
    if warm:
        out["first_pass_gbps"] = _run(pieces, threads, total, None)
    out["host_gbps"] = _run(pieces, threads, total, None)
    if cuda:
        out["host_to_device_gbps"] = _run(pieces, threads, total, torch.device(device))
    return out


def _run(pieces: list, threads: int, total: int, device: torch.device | None) -> float:
    local = threading.local()
    fds = {f: os.open(f, os.O_RDONLY) for f in {p[0] for p in pieces}}
    stream = torch.cuda.Stream(device) if device is not None else None

    def one(piece: tuple[Path, int, int]) -> None:
        f, pos, n = piece
        if not hasattr(local, "buf"):
            local.buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=device is not None)
            if device is not None:
                local.dev = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=device)
                local.ev = None
        if device is not None and local.ev is not None:
            local.ev.synchronize()
        view = byte_view(local.buf[:n])
        done = 0
        while done < n:
            done += os.preadv(fds[f], [view[done:]], pos + done)
        if device is not None:
            with torch.cuda.stream(stream):
                local.dev[:n].copy_(local.buf[:n], non_blocking=True)
                local.ev = torch.cuda.Event()
                local.ev.record(stream)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, pieces))
        if device is not None:
            torch.cuda.synchronize(device)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        for fd in fds.values():
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dir")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warm", action="store_true", help="an unmeasured pass first (page cache)")
    a = p.parse_args(argv)
    res = read_ceiling(a.dir, threads=a.threads, device=a.device, warm=a.warm)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
