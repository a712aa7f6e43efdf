"""Quantize throughput of each format next to a device-to-device copy of the same bytes.

    python -m bench.formats                                  # CUDA: 512 MiB bf16 input
    python -m bench.formats --sizes 64 512 2048 --json formats.json
    python -m bench.formats --device cpu --sizes 4 --iters 2  # smoke test on CPU (eager only)

For every format and mode (``eager``; ``compiled`` = the chunk kernels under torch.compile;
``triton`` = the hand-written Triton kernels of qckpt/formats/triton_kernels.py for fp8 / fp8_delayed
per-tensor and mxfp8 FLOOR, the compiled kernels elsewhere; all three by default on CUDA) it
times, in the same run as the copy:

* ``quantize(x, fmt)``: a fresh QuantizedTensor (allocates the output);
* ``q.quantize_(x)``: in place into an existing one (what a checkpoint load does).

``GB/s`` counts the bf16 input bytes over the wall time (the NaN/Inf check's one host sync
included), for the copy too, so ``vs copy`` = copy time / quantize time. Peak temporaries are
``max_memory_allocated`` above the live tensors during ``quantize_`` (CUDA only).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qckpt.formats import FORMATS, KernelPolicy, kernel_policy, kernels, numerics, quantize


def timer(device: torch.device):  # noqa: ANN202
    if device.type == "cuda":

        def run(fn, iters: int) -> list[float]:  # noqa: ANN001
            out = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            return out

    else:

        def run(fn, iters: int) -> list[float]:  # noqa: ANN001
            out = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
            return out

    return run


def bench(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    run = timer(device)
    modes = args.modes or (["eager", "compiled", "triton"] if device.type == "cuda" else ["eager"])
    rows: list[dict[str, Any]] = []
    for mib in args.sizes:
        numel = int(mib * 2**20) // 2
        cols = 8192 if numel >= 8192 * 128 else 256
        shape = (numel // cols, cols)
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        nbytes = x.numel() * x.element_size()
        copy = functools.partial(torch.empty_like(x).copy_, x)
        run(copy, 3)
        t_copy = statistics.median(run(copy, args.iters))
        copy = None
        rows.append(
            {
                "size_mib": mib,
                "format": "copy",
                "mode": "-",
                "op": "copy_",
                "seconds": t_copy,
                "gbps": nbytes / t_copy / 1e9,
                "vs_copy": 1.0,
                "temp_mib": 0.0,
            }
        )
        for fmt in args.formats:
            for mode in modes:
                comp = {"triton": "auto", "compiled": "always"}.get(mode, "never")
                policy = KernelPolicy(compile=comp, triton=mode == "triton")
                with kernel_policy(policy):
                    kernels.compile_failed.clear()
                    q = quantize(x, fmt)  # warm-up: compiles the chunk kernels
                    q.quantize_(x, update_state=False)
                    if mode == "compiled" and kernels.compile_failed:
                        print(f"# {fmt}: torch.compile failed, compiled = eager", file=sys.stderr)
                    if mode == "triton":
                        from qckpt.formats import triton_kernels

                        if not triton_kernels.available() or triton_kernels.failed:
                            print(
                                f"# {fmt}: triton not used: {triton_kernels.info()}",
                                file=sys.stderr,
                            )
                    for op in ("quantize", "quantize_"):
                        if op == "quantize":
                            fn = functools.partial(quantize, x, fmt)
                        else:
                            fn = functools.partial(q.quantize_, x, update_state=False)
                        run(fn, 2)
                        temp = 0.0
                        if device.type == "cuda" and op == "quantize_":
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                            fn()
                            torch.cuda.synchronize()
                            temp = (torch.cuda.max_memory_allocated() - base) / 2**20
                        t = statistics.median(run(fn, args.iters))
                        rows.append(
                            {
                                "size_mib": mib,
                                "format": fmt,
                                "mode": mode,
                                "op": op,
                                "seconds": t,
                                "gbps": nbytes / t / 1e9,
                                "vs_copy": t_copy / t,
                                "temp_mib": temp,
                            }
                        )
                    q = fn = None
        x = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    env = {
        "device": (
            torch.cuda.get_device_name()
            if device.type == "cuda"
            else f"cpu {platform.machine()} x{torch.get_num_threads()} threads"
        ),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "chunk_elems": numerics.CHUNK_ELEMS,
        "iters": args.iters,
    }
    return {"env": env, "rows": rows}


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


def table(res: dict[str, Any]) -> str:
    lines = [
        f"device: {res['env']['device']}, torch {res['env']['torch']}, "
        f"triton {res['env']['triton']}, "
        f"chunk {res['env']['chunk_elems']} elements, median of {res['env']['iters']}",
        "",
        "| input MiB | format | mode | op | ms | GB/s (input) | vs copy | quantize_ temps MiB |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['size_mib']:g} | {r['format']} | {r['mode']} | {r['op']} | "
            f"{r['seconds'] * 1e3:.3f} | {r['gbps']:.3g} | {r['vs_copy']:.2f} | "
            f"{r['temp_mib']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=float, nargs="+", default=None, help="input sizes, MiB of bf16")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--modes", nargs="+", choices=["eager", "compiled", "triton"], default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = [512.0] if args.device.startswith("cuda") else [4.0]
    res = bench(args)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
