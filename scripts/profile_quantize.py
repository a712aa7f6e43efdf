"""Where one Triton-path ``quantize_`` of a large tensor spends its time: host overhead vs GPU.

    python scripts/profile_quantize.py [--mib 512] [--trace DIR]

For fp8 and mxfp8: the wall time of ``quantize_`` on a 1024-element tensor (host overhead, the
kernels are negligible there), and a torch.profiler run over 5 calls on the large tensor: each
call's GPU kernels and the host time before the first of them is launched.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qckpt.formats import quantize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, default=512.0)
    p.add_argument("--trace", type=Path, default=None)
    a = p.parse_args()
    x = torch.randn(int(a.mib * 2**20) // 2 // 8192, 8192, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    for fmt in ("fp8", "mxfp8"):
        qs, q = quantize(small, fmt), quantize(x, fmt)
        ts = []
        for _ in range(50):
            torch.cuda.synchronize()
            t = time.perf_counter()
            qs.quantize_(small, update_state=False)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        print(f"{fmt}: quantize_ of 1024 elements {statistics.median(ts) * 1e6:.1f} us (host)")
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                torch.cuda.synchronize()
                with torch.profiler.record_function("quantize_"):
                    q.quantize_(x, update_state=False)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if a.trace:
            a.trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(a.trace / f"{fmt}.json"))


if __name__ == "__main__":
    main()
