"""Benchmark: the fast reader vs the plain one, streaming vs bulk, a plain BF16 load as yardstick.

One run builds a synthetic DCP checkpoint (default 48 x 8192x8192 BF16 = 6.44 GB), warms the
page cache, measures the host's own read ceiling on its files (``bench.read_ceiling``: a
parallel read into pinned memory, and on to the GPU, no parsing, no quantize), then loads it,
side by side in the same process, once per storage reader (``--readers plain,fast``):

  plain bf16 <reader>   params none (BF16), the speed yardstick of that reader
  <fmt> stream <reader> each --formats entry (default fp8, mxfp8) streamed
                        (each load is timed after one unmeasured load, which pays the
                        process's one-time costs such as the pinned buffers torch then keeps;
                        on the fast reader the best of --repeat, default 3)
  <fmt> bulk <reader>   the bulk baseline (on the last reader only unless --bulk)

and prints transient / peak memory and seconds with ratios and the issue's targets: fast
reader >= 3x the plain reader; on each reader stream time <= 1.1 x its plain BF16 load; stream
transient <= max_inflight x 2*max(numel) + 64 MiB (1 for the plain reader). On CUDA the
transient comes from the allocator's peak statistics.

    python -m bench.load                                   # on the H200: full size
    python -m bench.load --layers 8 --dim 1024 --device cpu  # CPU run
    python -m bench.load --json load.json --plot load.png
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from bench.read_ceiling import read_ceiling
from qckpt import formats
from qckpt.convert.dcp import save_model_dcp
from qckpt.load.loader import LoadReport, load_checkpoint
from qckpt.models.quantize_params import quantize_model_params
from qckpt.plot import plot_memory
from qckpt.read.fast_read import DEFAULT_MAX_INFLIGHT

MiB = 2**20
SLACK = 64 * MiB


class Stack(nn.Module):
    """``layers`` square bias-free linears: the shape of a large model's weights, nothing else."""

    def __init__(self, layers: int, dim: int, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16, device="meta")
            for _ in range(layers)
        )
        if str(device) != "meta":
            # no init kernels: zeros are enough for a destination that the load overwrites
            self.to_empty(device=device)
            with torch.no_grad():
                for p in self.parameters():
                    p.zero_()


def make_checkpoint(path: Path, layers: int, dim: int, seed: int = 0) -> int:
    """Random BF16 weights (rows of different magnitude, so per-tensor scales matter)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(layers):
        w = torch.randn(dim, dim, generator=g, dtype=torch.float32)
        w *= 2.0 ** ((torch.arange(dim) % 8) - 4).float().view(-1, 1)
        sd[f"layers.{i}.weight"] = w.to(torch.bfloat16)
        del w
    save_model_dcp(sd, path)
    return sum(t.numel() * t.element_size() for t in sd.values())


def warm_page_cache(path: Path) -> None:
    for f in sorted(path.iterdir()):
        with open(f, "rb") as fh:
            while fh.read(64 * MiB):
                pass


def build(
    layers: int, dim: int, device: torch.device, fmt: str, backend: str = "native"
) -> nn.Module:
    m = Stack(layers, dim, device)
    quantize_model_params(m, fmt, backend=backend)
    return m


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def warm_kernels(fmts: list[str], dim: int, device: torch.device) -> None:
    """Compile (on CUDA) every kernel a load will run, at the load's shapes, before timing."""
    x = torch.randn(dim, dim, device=device).to(torch.bfloat16)
    for fmt in fmts:
        q = formats.quantize(x, fmt)
        q.dequantize(torch.bfloat16)
        q.quantize_(x, update_state=False)
    del x
    release(device)


def stock_dcp_seconds(ckpt: Path, layers: int, dim: int, device: torch.device) -> float:
    """DCP's own load (DefaultLoadPlanner, per-file reader, safe metadata) into BF16 params."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from qckpt.storage.dcp_metadata import SafeFileSystemReader

    m = Stack(layers, dim, device)
    release(device)
    t0 = time.perf_counter()
    dcp.load(
        m.state_dict(),
        storage_reader=SafeFileSystemReader(str(ckpt)),
        planner=DefaultLoadPlanner(),
        no_dist=True,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    del m
    release(device)
    return dt


def same_params(a: nn.Module, b: nn.Module) -> bool:
    from qckpt.formats.te import is_te_quantized

    for (_, x), (_, y) in zip(
        a.state_dict(keep_vars=True).items(), b.state_dict(keep_vars=True).items(), strict=True
    ):
        if not isinstance(x, torch.Tensor):  # TE's _extra_state
            continue
        if is_te_quantized(x):
            if not torch.equal(x.dequantize(), y.dequantize()):
                return False
        elif formats.is_quantized(x):
            for k, v in x.fields().items():
                w = y.fields()[k]
                if not torch.equal(
                    v.view(torch.uint8) if v.element_size() == 1 else v,
                    w.view(torch.uint8) if w.element_size() == 1 else w,
                ):
                    return False
        elif not torch.equal(x, y):
            return False
    return True


def _device(args: argparse.Namespace) -> torch.device:
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _checkpoint(args: argparse.Namespace) -> tuple[Path, Path, int]:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="qckpt-bench-"))
    ckpt = root / f"stack-{args.layers}x{args.dim}"
    t0 = time.perf_counter()
    if not (ckpt / ".metadata").is_file():
        nbytes = make_checkpoint(ckpt, args.layers, args.dim)
        print(
            f"wrote {nbytes / 1e9:.2f} GB checkpoint to {ckpt} in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    else:
        nbytes = args.layers * args.dim * args.dim * 2
    return root, ckpt, nbytes


def _loads(args, fmts, readers, device, ckpt) -> list[tuple[str, LoadReport]]:  # noqa: ANN001
    """Every load of the run, named "<fmt> <stream|bulk> <reader>" ("plain bf16 <reader>")."""
    rows: list[tuple[str, LoadReport]] = []
    checks: dict[str, bool] = {}

    def load(fmt: str, stream: bool, reader: str) -> tuple[nn.Module, LoadReport]:
        m = build(args.layers, args.dim, device, fmt, args.backend if fmt != "none" else "native")
        release(device)
        rep = load_checkpoint(
            m,
            ckpt,
            stream=stream,
            reader=reader,
            max_inflight=args.max_inflight,
            read_threads=args.threads,
        )
        return m, rep

    def best(fmt: str, reader: str) -> tuple[nn.Module, LoadReport]:
        """The fastest of ``--repeat`` loads after one unmeasured (the first in the process
        pays one-time costs: allocator, pinned buffers torch then keeps, the read-ahead's
        staging); a fast-reader load takes ~0.2 s, so one sample is at the mercy of jitter.
        The slow plain reader is loaded once after the warm-up."""
        m, _ = load(fmt, True, reader)
        got = None
        for _ in range(args.repeat if reader == "fast" else 1):
            del m
            release(device)
            m, rep = load(fmt, True, reader)
            got = rep if got is None or rep.seconds < got.seconds else got
        return m, got

    for reader in readers:
        m, plain = best("none", reader)
        del m
        release(device)
        rows.append((f"plain bf16 {reader}", plain))
        for fmt in fmts:
            ms, rs = best(fmt, reader)
            rows.append((f"{fmt} stream {reader}", rs))
            if args.bulk or reader == readers[-1]:
                mb, rb = load(fmt, False, reader)
                checks[f"{fmt} {reader}: stream == bulk params"] = same_params(ms, mb)
                rows.append((f"{fmt} bulk {reader}", rb))
                del mb
            del ms
            release(device)
    _loads.checks = checks  # type: ignore[attr-defined]
    return rows


def _table(rows, nbytes, args, device, numel) -> None:  # noqa: ANN001
    by = dict(rows)
    hdr = (
        f"{'load':<22}{'transient MiB':>14}{'predicted MiB':>14}{'peak MiB':>11}{'seconds':>9}"
        f"{'GB/s':>7}{'tr/bulk':>9}{'t/plain':>9}"
    )
    print(
        f"\ncheckpoint {nbytes / 1e9:.2f} GB: {args.layers} x {args.dim}x{args.dim} bf16 on "
        f"{device}; 2*max(numel) = {2 * numel / MiB:.1f} MiB; max_inflight {args.max_inflight}"
        f"; fast reader's read-ahead {max(r.read_ahead_bytes for _, r in rows) / MiB:.0f} MiB"
    )
    print(f"measured by: {rows[0][1].measured_by}")
    print(hdr)
    for name, r in rows:
        fmt, _, reader = name.split()
        bulk = by.get(f"{fmt} bulk {reader}")
        plain = by[f"plain bf16 {reader}"]
        tr = (
            f"{r.transient_bytes / bulk.transient_bytes:.3f}"
            if bulk and bulk.transient_bytes
            else "-"
        )
        print(
            f"{name:<22}{r.transient_bytes / MiB:>14.1f}{r.predicted_transient_bytes / MiB:>14.1f}"
            f"{r.peak_bytes / MiB:>11.0f}{r.seconds:>9.2f}{r.gbps:>7.2f}{tr:>9}"
            f"{r.seconds / plain.seconds:>9.2f}"
        )


def _checks(rows, fmts, readers, args, numel) -> dict[str, bool]:  # noqa: ANN001
    by = dict(rows)
    checks: dict[str, bool] = dict(getattr(_loads, "checks", {}))
    for reader in readers:
        inflight = args.max_inflight if reader == "fast" else 1
        plain = by[f"plain bf16 {reader}"]
        for fmt in fmts:
            rs = by[f"{fmt} stream {reader}"]
            checks[f"{fmt} {reader}: stream transient <= {inflight} x 2*max(numel) + 64 MiB"] = (
                rs.transient_bytes <= inflight * 2 * numel + SLACK
            )
            checks[f"{fmt} {reader}: stream time <= 1.1 x plain bf16 ({reader} reader)"] = (
                rs.seconds <= 1.1 * plain.seconds
            )
    if {"fast", "plain"} <= set(readers):
        for fmt in ["plain"] + fmts:
            a = "plain bf16" if fmt == "plain" else f"{fmt} stream"
            checks[f"{a}: fast reader >= 3x the plain reader"] = (
                by[f"{a} plain"].seconds >= 3 * by[f"{a} fast"].seconds
            )
    return checks


def run(args: argparse.Namespace) -> dict:
    device = _device(args)
    if args.formats is None:
        args.formats = "fp8_delayed,fp8_block" if args.backend == "te" else "fp8,mxfp8"
    fmts = [f for f in args.formats.split(",") if f]
    missing = [f for f in fmts if f not in formats.FORMATS and args.backend == "native"]
    if missing:
        raise SystemExit(f"formats not available: {missing} (have {sorted(formats.FORMATS)})")
    readers = [r for r in args.readers.split(",") if r]
    root, ckpt, nbytes = _checkpoint(args)
    warm_page_cache(ckpt)
    if args.backend == "native":
        warm_kernels(fmts, args.dim, device)
    numel = args.dim * args.dim
    ceiling = read_ceiling(ckpt, threads=args.threads, device=str(device))
    rows = _loads(args, fmts, readers, device, ckpt)
    stock = stock_dcp_seconds(ckpt, args.layers, args.dim, device)
    _table(rows, nbytes, args, device, numel)
    checks = _checks(rows, fmts, readers, args, numel)
    by = dict(rows)
    print(
        f"host ceiling (parallel read of the files, {ceiling['threads']} threads, no parsing or "
        f"quantize): {ceiling['host_gbps']:.2f} GB/s into host memory"
        + (
            f", {ceiling['host_to_device_gbps']:.2f} GB/s on to {device}"
            if "host_to_device_gbps" in ceiling
            else ""
        )
    )
    print(
        f"dcp.load with DefaultLoadPlanner (stock per-file reader), bf16: {stock:.2f} s "
        f"({nbytes / stock / 1e9:.2f} GB/s)"
    )
    print()
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'}  {k}")
    result = {
        "device": str(device),
        "backend": args.backend,
        "torch": torch.__version__,
        "layers": args.layers,
        "dim": args.dim,
        "max_inflight": args.max_inflight,
        "checkpoint_bytes": nbytes,
        "two_max_numel_bytes": 2 * numel,
        "runs": {
            name: {k: v for k, v in r.to_dict().items() if k != "samples" or args.samples}
            for name, r in rows
        },
        "ratios": _ratios(by, fmts, readers),
        "host_ceiling": ceiling,
        "stock_dcp_bf16_seconds": stock,
        "checks": checks,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot_memory([r for n, r in rows if not n.startswith("plain bf16")], args.plot)
    if not args.dir and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _ratios(by: dict, fmts: list[str], readers: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for reader in readers:
        plain = by[f"plain bf16 {reader}"]
        for f in fmts:
            out[f"{f} time stream/plain ({reader})"] = (
                by[f"{f} stream {reader}"].seconds / plain.seconds
            )
            bulk = by.get(f"{f} bulk {reader}")
            if bulk is not None:
                out[f"{f} transient stream/bulk ({reader})"] = by[
                    f"{f} stream {reader}"
                ].transient_bytes / max(bulk.transient_bytes, 1)
    if {"fast", "plain"} <= set(readers):
        out["plain bf16 time plain/fast reader"] = (
            by["plain bf16 plain"].seconds / by["plain bf16 fast"].seconds
        )
        for f in fmts:
            out[f"{f} stream time plain/fast reader"] = (
                by[f"{f} stream plain"].seconds / by[f"{f} stream fast"].seconds
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument(
        "--formats",
        default=None,
        help="comma-separated param formats (default fp8,mxfp8; with --backend te fp8_delayed,fp8_block)",
    )
    p.add_argument(
        "--backend",
        default="native",
        choices=["native", "te"],
        help="te: Transformer Engine params",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--readers", default="plain,fast", help="storage readers to compare (plain,fast)"
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=DEFAULT_MAX_INFLIGHT,
        help=f"load.max_inflight (fast reader; default {DEFAULT_MAX_INFLIGHT}, the load's)",
    )
    p.add_argument("--threads", type=int, default=None, help="fast reader threads (default: cores)")
    p.add_argument(
        "--repeat", type=int, default=3, help="fast-reader loads timed after the warm-up (the best)"
    )
    p.add_argument(
        "--bulk", action="store_true", help="bulk loads on every reader (default: the last one)"
    )
    p.add_argument(
        "--dir", help="where the checkpoint lives (reused if present); default a temp dir"
    )
    p.add_argument("--keep", action="store_true", help="keep the temp checkpoint")
    p.add_argument("--json", help="write the figures as JSON")
    p.add_argument("--plot", help="write a PNG of memory over the loads")
    p.add_argument("--samples", action="store_true", help="include per-item samples in --json")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    res = run(args)
    return 0 if all(res["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
