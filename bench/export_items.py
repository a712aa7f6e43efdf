"""Per-item cost of the export's quantize stage, in process: many small tensors, no start-up.

    python -m bench.export_items                          # a 0.1 GB Llama of 256-wide layers
    python -m bench.export_items --src DIR --calib FILE --device cuda --repeat 3

Runs the export (``qckpt.pipeline.export.export``) ``--repeat`` times into a temp dir and prints,
per run, the export seconds and milliseconds per source tensor (wall, the process's CPU time,
and the quantize threads' busy time: the per-tensor work itself), and (``--count``) how many times the
quantize threads read a tensor's value on the host per source tensor (``aten._local_scalar_dense``
and ``tolist``: on a GPU each is a wait for the device; counted with a dispatch mode entered
on each quantize thread). The synthetic checkpoint is bench.export's (``--hidden``,
``--intermediate``: small layers make the per-tensor cost dominate the bytes).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path


def _counting(counts: dict[str, int], lock: threading.Lock):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                with lock:
                    counts["scalar_reads"] += 1
            return func(*args, **(kwargs or {}))

    return Count


def _wrap_process(counts: dict[str, int]):
    """Run every quantize job under a counting dispatch mode (modes are per thread)."""
    import torch

    from qckpt.export.stages import Pipeline

    lock = threading.Lock()
    mode = _counting(counts, lock)
    real = Pipeline._process
    real_tolist = torch.Tensor.tolist

    def process(self, *args):
        with mode():
            return real(self, *args)

    def tolist(t):
        if threading.current_thread().name.startswith("qckpt-quantize"):
            with lock:
                counts["scalar_reads"] += 1
        return real_tolist(t)

    real_run = Pipeline._process_run

    def process_run(self, *args):  # a run of the bulk path
        with mode():
            return real_run(self, *args)

    Pipeline._process = process
    Pipeline._process_run = process_run
    torch.Tensor.tolist = tolist


def _keep_stats() -> list:
    """Every pipeline's WriteStats, appended when its run ends."""
    from qckpt.export.stages import Pipeline

    kept: list = []
    real = Pipeline.run

    def run(self, *args):
        try:
            return real(self, *args)
        finally:
            kept.append(self.stats)

    Pipeline.run = run
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=None)
    ap.add_argument("--calib", default=None)
    ap.add_argument("--size-gb", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's)")
    ap.add_argument("--count", action="store_true", help="count host reads (slows every op)")
    a = ap.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="export-items-"))
    if a.src is None:
        from bench.export import make_checkpoint

        if not (work / "src").exists():  # made once per workdir, reused by the next run
            make_checkpoint(work, a.size_gb, a.hidden, a.intermediate, 1000)
        a.src, a.calib = str(work / "src"), str(work / "calib.safetensors")
    import torch

    from qckpt.pipeline.export import export

    if a.threads:  # 1: steadier figures on a shared machine (no spinning of idle op threads)
        torch.set_num_threads(a.threads)
    from qckpt import recipe_from_dict

    counts = {"scalar_reads": 0}
    stats = _keep_stats()
    if a.count:
        _wrap_process(counts)
    secs: list[float] = []
    cpu: list[float] = []
    busy: list[float] = []  # the quantize threads' busy seconds (WriteStats.quantize_seconds)
    for r in range(a.repeat):
        out = work / "out"  # overwritten by each run: one export on disk at a time
        recipe = recipe_from_dict(
            {
                "model": {"source": a.src},
                "checkpoint": {"path": a.src, "format": "safetensors"},
                "calibrate": {"output": a.calib},
                "export": {"output": str(out), "device": a.device, "overwrite": True},
            }
        )
        counts["scalar_reads"] = 0
        t0, c0 = time.perf_counter(), time.process_time()
        rep = export(recipe)
        secs.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        n = rep.source_tensors
        reads = counts["scalar_reads"] / n
        busy.append(stats[-1].quantize_seconds)
        print(
            f"run {r}: {secs[-1]:.3f} s ({1e3 * secs[-1] / n:.3f} ms per source tensor), "
            f"process CPU {cpu[-1]:.3f} s ({1e3 * cpu[-1] / n:.3f} ms per tensor), "
            f"quantize stage busy {1e3 * busy[-1] / n:.3f} ms per tensor, {n} tensors"
            + (f", {reads:.2f} host reads of a tensor value per tensor" if a.count else ""),
            flush=True,
        )
    print(
        f"median {statistics.median(secs):.3f} s, process CPU {statistics.median(cpu):.3f} s, "
        f"quantize busy {statistics.median(busy):.3f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
