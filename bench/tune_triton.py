"""Launch shapes of the Triton kernels (qckpt/formats/triton_kernels.py), swept on one input, each
kernel timed alone next to a device-to-device copy of the same input in the same run.

    python -m bench.tune_triton                 # CUDA + triton; 512 MiB of bf16
    python -m bench.tune_triton --mib 2048 --json tune.json

Rows: the amax kernel (reads the input), the fp8 cast (reads it, writes 1 byte per element),
the mxfp8 kernel (reads it, writes codes and scales) and the whole ``quantize_`` of fp8 and
mxfp8 with the shapes that won. ``vs copy`` = copy time / kernel time; a kernel that moved
bytes at the copy's rate would read 2 (amax), 1.33 (fp8 cast) and 1.31 (mxfp8).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from bench.formats import timer
from qckpt import quantize
from qckpt.formats import triton_kernels


def _time(fn, iters: int) -> float:  # noqa: ANN001
    """Median seconds of ``fn`` by CUDA events, after one warm-up call (bench/formats.py's timer)."""
    fn()
    return statistics.median(timer(torch.device("cuda"))(fn, iters))


def sweep(mib: float, iters: int) -> dict[str, Any]:
    numel = int(mib * 2**20) // 2
    x = torch.randn(numel // 8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_copy = _time(lambda: torch.empty_like(x).copy_(x), iters)
    rows: list[dict[str, Any]] = []
    best: dict[str, tuple[float, dict[str, int]]] = {}

    def add(kernel: str, cfg: dict[str, int], t: float) -> None:
        rows.append({"kernel": kernel, **cfg, "ms": t * 1e3, "vs_copy": t_copy / t})
        if kernel not in best or t < best[kernel][0]:
            best[kernel] = (t, cfg)

    for block, tiles, warps in itertools.product((2048, 4096, 8192), (1, 2, 4, 8), (4, 8)):
        triton_kernels.AMAX_BLOCK, triton_kernels.AMAX_TILES, triton_kernels.AMAX_WARPS = (
            block,
            tiles,
            warps,
        )
        add(
            "amax",
            {"block": block, "tiles": tiles, "warps": warps},
            _time(lambda: triton_kernels.amax(x), iters),
        )
    a = triton_kernels.amax(x)
    s = torch.empty(1, dtype=torch.float32, device="cuda")
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    for block, tiles, warps in itertools.product((1024, 2048, 4096, 8192), (1, 2, 4), (4, 8)):
        triton_kernels.CAST_BLOCK, triton_kernels.CAST_TILES, triton_kernels.CAST_WARPS = (
            block,
            tiles,
            warps,
        )
        fn = lambda: triton_kernels.fp8_cast(x, out, amax=a, scale_out=s)  # noqa: E731
        add("fp8_cast", {"block": block, "tiles": tiles, "warps": warps}, _time(fn, iters))
    q2 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    s2 = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.uint8, device="cuda")
    for blocks, warps in itertools.product((32, 64, 128, 256, 512), (2, 4, 8)):
        triton_kernels.MX_BLOCKS, triton_kernels.MX_WARPS = blocks, warps
        fn = lambda: triton_kernels.mx_quantize(x, q2, s2, 8)  # noqa: E731
        add("mxfp8", {"blocks": blocks, "warps": warps}, _time(fn, iters))
    assert not triton_kernels.failed, triton_kernels.info()
    c = best["amax"][1]
    triton_kernels.AMAX_BLOCK, triton_kernels.AMAX_TILES, triton_kernels.AMAX_WARPS = (
        c["block"],
        c["tiles"],
        c["warps"],
    )
    c = best["fp8_cast"][1]
    triton_kernels.CAST_BLOCK, triton_kernels.CAST_TILES, triton_kernels.CAST_WARPS = (
        c["block"],
        c["tiles"],
        c["warps"],
    )
    c = best["mxfp8"][1]
    triton_kernels.MX_BLOCKS, triton_kernels.MX_WARPS = c["blocks"], c["warps"]
    for fmt in ("fp8", "mxfp8"):
        q = quantize(x, fmt)
        add(f"{fmt} quantize_", {}, _time(lambda q=q: q.quantize_(x, update_state=False), iters))
        add(f"{fmt} quantize", {}, _time(lambda fmt=fmt: quantize(x, fmt), iters))
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton_kernels.info()["triton"],
        "mib": mib,
        "copy_ms": t_copy * 1e3,
        "best": {k: v[1] for k, v in best.items()},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=float, default=512.0, help="input size, MiB of bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if not (torch.cuda.is_available() and triton_kernels.available()):
        print("tune_triton: needs CUDA (sm_89+) and triton", file=sys.stderr)
        return 2
    res = sweep(a.mib, a.iters)
    print(
        f"{res['device']}, torch {res['torch']}, triton {res['triton']}, {a.mib:g} MiB bf16, "
        f"copy {res['copy_ms']:.3f} ms, median of {a.iters}"
    )
    for r in res["rows"]:
        cfg = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("kernel", "ms", "vs_copy"))
        print(f"{r['kernel']:18s} {cfg:30s} {r['ms']:8.3f} ms  {r['vs_copy']:.2f} x copy")
    print("best:", res["best"])
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
