"""The fast read path's knobs, side by side in one process: which one limits the read?

    python -m bench.read_knobs RECIPE [--set k=v ...] --json knobs.json

Each variant builds the recipe's model (meta, then its quantized parameters) and reads the
checkpoint into it with ``load_checkpoint``, timed from the call to a device synchronize. The
interpreter starts once, so start-up is not in the figures. Per variant: seconds, GB/s, and the
calling thread's CPU seconds over that time (near 1.0: the calling thread, which starts and
completes every item, is what the read waits for; low: it waits for the readers or the disk).
Variants change the reader threads, ``max_inflight``, the read-ahead's staging bytes, the piece
size and the interpreter's switch interval (how long a thread may keep the GIL when another
asks for it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VARIANTS = [
    {"name": "default"},
    {"name": "default again"},
    {"name": "threads 2", "threads": 2},
    {"name": "threads 4", "threads": 4},
    {"name": "threads 8", "threads": 8},
    {"name": "threads 16", "threads": 16},
    {"name": "switch 0.5 ms", "switch": 0.0005},
    {"name": "switch 50 ms", "switch": 0.05},
    {"name": "inflight 2", "inflight": 2},
    {"name": "inflight 4", "inflight": 4},
    {"name": "ahead 0", "ahead": 0},  # no read-ahead: the next destination waits for a scratch
    {"name": "ahead 64 MiB", "ahead": 64 << 20},
    {"name": "ahead 1 GiB", "ahead": 1 << 30},
    {"name": "chunk 64 MiB", "chunk": 64 << 20},
    {"name": "plain reader", "reader": "plain"},
]


def run_variant(recipe, v: dict) -> dict:
    import torch

    from qckpt import LoadOptions, init_mesh, load_checkpoint
    from qckpt.pipeline.load import build_for_load
    from qckpt.read import fast_read

    old_switch, old_chunk = sys.getswitchinterval(), fast_read.CHUNK_BYTES
    old_ahead = fast_read.READ_AHEAD_BYTES
    # the mesh the CLI makes: its device is where the model is built and the params live
    built = build_for_load(recipe, init_mesh(device=recipe.load.device))
    device = str(next(built.model.parameters()).device)
    sys.setswitchinterval(v.get("switch", old_switch))
    fast_read.CHUNK_BYTES = v.get("chunk", old_chunk)
    fast_read.READ_AHEAD_BYTES = v.get("ahead", old_ahead)
    try:
        t0, c0 = time.perf_counter(), time.thread_time()
        opts = LoadOptions(
            format=recipe.checkpoint.format,
            reader=v.get("reader", "fast"),
            max_inflight=v.get("inflight", recipe.load.max_inflight),
            read_threads=v.get("threads"),
        )
        rep = load_checkpoint(built.model, recipe.checkpoint.path, opts)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        sys.setswitchinterval(old_switch)
        fast_read.CHUNK_BYTES = old_chunk
        fast_read.READ_AHEAD_BYTES = old_ahead
    nbytes = getattr(rep, "bytes_read", 0) or 0
    del built
    return {
        "name": v["name"],
        "device": device,
        "seconds": round(wall, 3),
        "gbps": round(nbytes / wall / 1e9, 3) if nbytes else None,
        "main_cpu_fraction": round(cpu / wall, 3),
        "read_ahead_bytes": getattr(rep, "read_ahead_bytes", 0),
        "transient_bytes": getattr(rep, "transient_bytes", 0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from qckpt import load_recipe

    recipe = load_recipe(args.recipe, args.sets)
    keep = None if args.only is None else set(args.only.split(","))
    rows = [run_variant(recipe, v) for v in VARIANTS if keep is None or v["name"] in keep]
    for r in rows:
        print(
            f"{r['name']:>16}  {r['device']}  {r['seconds']:7.2f} s  {r['gbps'] or 0:6.2f} GB/s  "
            f"main thread CPU {r['main_cpu_fraction']:.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
