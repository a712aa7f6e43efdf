"""The few lines a person reads at the end of a command: what was done, where the output is,
bytes / seconds / GB/s, the whole-command peak against its bound, and a warning only when one is
deserved. Built from the same dicts that go to ``--json`` (nothing here is measured again); the
tables of every figure stay under ``--verbose`` (:mod:`qckpt.report`).

Torch-free (``check`` and ``inspect`` use it without torch); a device's capacity is read from
torch only when the command already imported it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from qckpt.report import human_bytes

# a whole-command peak above this share of its bound gets a warning line
NEAR_BOUND = 0.9


def _host_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _device_total(device: str) -> int | None:
    torch = sys.modules.get("torch")
    if torch is None or not device.startswith("cuda"):
        return None
    try:
        return int(torch.cuda.get_device_properties(int(device.split(":")[1])).total_memory)
    except Exception:  # noqa: BLE001 - a figure for a summary line, never a failure
        return None


def _worst(data: dict[str, Any], key: str) -> int | None:
    """The largest of ``peaks[key]`` over this rank and every rank gathered into ``ranks``."""
    vals = [(data.get("peaks") or {}).get(key)]
    vals += [
        (r.get("peaks") or {}).get(key) for r in data.get("ranks") or [] if isinstance(r, dict)
    ]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def peak_line(data: dict[str, Any]) -> tuple[str, str | None]:
    """'peak device 29.8 GiB of 139.8 GiB (21 %)' for the whole command (its worst rank), and a
    warning when it is near the bound (the GPU's memory, else the host's)."""
    pk = data.get("peaks") or {}
    dev = _worst(data, "device_peak_bytes")
    if dev is not None:
        what, peak, bound = "device", dev, _device_total(str(pk.get("device", "")))
    else:
        what, peak, bound = "host RSS", _worst(data, "host_peak_rss_bytes"), _host_total()
    if peak is None:
        return "peak memory: not measured", None
    ranks = len(data.get("ranks") or []) or 1
    who = f", worst of {ranks} ranks" if ranks > 1 else ""
    if not bound:
        return f"peak {what} {human_bytes(peak)}{who}", None
    share = peak / bound
    line = f"peak {what} {human_bytes(peak)} of {human_bytes(bound)} ({share:.0%}){who}"
    warn = (
        f"warning: the peak is {share:.0%} of the {what.split()[0]} memory"
        if share > NEAR_BOUND
        else None
    )
    return line, warn


def time_line(data: dict[str, Any]) -> str:
    ph = data.get("phases") or {}
    total = ph.get("total")
    if total is None:
        return ""
    return f"time {total:.2f} s (start-up {ph.get('startup', 0.0):.2f} s)"


def _rate(nbytes: int | float | None, seconds: float | None) -> str:
    if not nbytes or not seconds:
        return f"{human_bytes(nbytes)}"
    return f"{human_bytes(nbytes)} in {seconds:.2f} s ({nbytes / seconds / 1e9:.2f} GB/s)"


def _speed(nbytes: int | float | None, seconds: float | None) -> str:
    if not nbytes or not seconds:
        return ""
    return f" in {seconds:.2f} s ({nbytes / seconds / 1e9:.2f} GB/s of source)"


def finish(lines: list[str], data: dict[str, Any], warnings: list[str]) -> list[str]:
    """``lines`` and how every command's summary ends: the whole command's peak against its
    bound, its time, then the warnings (the peak's own last, when it is near the bound)."""
    peak, warn = peak_line(data)
    lines += [f"  {peak}", f"  {time_line(data)}"]
    lines += [w if w.startswith("warning:") else f"warning: {w}" for w in warnings]
    if warn:
        lines.append(warn)
    return [ln for ln in lines if ln.strip()]


def load_summary(data: dict[str, Any]) -> list[str]:
    runs = data.get("runs") or [{}]
    first = runs[0]
    world = data.get("world_size", 1)
    lines = [
        f"load: {first.get('tensors', '?')} tensors from {first.get('path')} into "
        f"{data.get('params')} params ({'stream' if first.get('stream', True) else 'bulk'}), "
        f"{world} rank(s)",
        f"  read {_rate(first.get('bytes_read'), first.get('seconds'))} (rank 0)",
    ]
    warnings = []
    t, bound = first.get("transient_bytes"), first.get("predicted_transient_bytes")
    if t is not None and bound:
        lines.append(
            f"  transient {human_bytes(t)} against its bound {human_bytes(bound)} "
            "(2 x the largest tensor)"
        )
        if first.get("stream", True) and t > bound * 1.05 + 4096:
            warnings.append(f"the transient memory is {t / bound:.2f}x its bound")
    if len(runs) == 2 and runs[1].get("transient_bytes") and t:
        b = runs[1]["transient_bytes"]
        lines.append(f"  bulk baseline: transient {human_bytes(b)} ({b / t:.1f}x the stream's)")
    return finish(lines, data, warnings)


def calibrate_summary(data: dict[str, Any], output: str, algorithm: str) -> list[str]:
    calibrated, total = data.get("calibrated", 0), data.get("quantizers", 0)
    lines = [
        f"calibrate: {calibrated}/{total} quantizers calibrated ({algorithm}) "
        f"on {data.get('world_size', 1)} rank(s), dp={data.get('dp', 1)} "
        f"ep={data.get('ep', 1)} tp={data.get('tp', 1)}",
        f"  output {output}",
    ]
    src = data.get("data") or {}
    fwd = data.get("forward_seconds")
    lines.append(
        f"  data {src.get('source', '?')}: {src.get('samples_used', '?')} samples, "
        f"{data.get('batches', '?')} batches here"
        + (f", forward {fwd:.2f} s" if isinstance(fwd, int | float) else "")
        + (f", sync {data['sync_seconds']:.3f} s" if "sync_seconds" in data else "")
    )
    moe = data.get("moe_forward") or {}
    if moe.get("used"):
        lines.append(f"  experts forward {_moe_forward(moe)}")
    warnings = []
    missing = data.get("uncalibrated") or []
    if missing:
        warnings.append(
            f"{len(missing)} quantizer(s) got no data: {', '.join(map(str, missing[:3]))}"
        )
    return finish(lines, data, warnings)


def _moe_forward(moe: dict[str, Any]) -> str:
    """calibrate.moe_forward as run, ``grouped (auto)`` or ``eager (auto: why)``, and the first
    experts call's seconds: auto's check and, on CUDA, the combine kernel's compile, paid once
    per process (inside the forward's first batch)."""
    asked, used, why = moe.get("asked"), moe["used"], moe.get("why")
    how = used if asked == used else f"{used} ({asked}{': ' + why if why else ''})"
    first = moe.get("first_call_seconds")
    return how + (f", first call {first:.2f} s" if isinstance(first, int | float) else "")


def export_summary(data: dict[str, Any]) -> list[str]:
    lines = [
        f"export: {data.get('quantized_linears', '?')} quantized linears, "
        f"{data.get('tensors_written', '?')} tensors ({data.get('layout')}) "
        f"on {data.get('world_size', 1)} rank(s)",
        f"  output {data.get('output')} ({data.get('shards', '?')} shard(s), "
        f"{human_bytes(data.get('bytes_written'))})",
        f"  {human_bytes(data.get('bytes_read'))} read, {human_bytes(data.get('bytes_written'))} "
        f"written{_speed(data.get('bytes_read'), data.get('seconds'))}",
    ]
    warnings = list(data.get("warnings") or [])
    held, bound = data.get("write_rss_anon_bytes"), data.get("host_bound_bytes")
    if held is not None and bound:
        lines.append(
            f"  host memory while writing {human_bytes(held)} against its bound "
            f"{human_bytes(bound)} (2 x the largest tensor + 256 MiB)"
        )
        if held > bound:
            warnings.append(f"the write held {held / bound:.2f}x its host bound")
    return finish(lines, data, warnings)


def convert_summary(data: dict[str, Any]) -> list[str]:
    lines = [f"convert: {data.get('src')} -> {data.get('dst')} ({data.get('to')})"]
    return finish(lines, data, [])


def figures(data: dict[str, Any]) -> list[str]:
    """The peak and time lines alone, for a command whose result says the rest (check)."""
    return finish([], data, [])


# what ``inspect`` says by default, of whatever its kind of path holds (the rest: --verbose)
_INSPECT_KEYS = ("framework", "version", "architecture", "layers", "routed_experts", "stacking",
                 "mapped_tensors", "leftover", "files", "tensors", "bytes", "dtypes", "model_type",
                 "quant_method", "quant_format", "schemes", "scales", "quantizers", "calibrated", "amax_min",
                 "amax_max")  # fmt: skip


def inspect_summary(info: dict[str, Any], path: str) -> list[str]:
    def cell(k: str, v: Any) -> str:
        if k == "bytes":
            return human_bytes(v)
        if isinstance(v, dict):
            return ", ".join(f"{a}={b}" for a, b in v.items())
        if isinstance(v, float):
            return f"{k} {v:.4g}"
        return f"{v} {k}" if isinstance(v, int) else f"{k} {v}"

    parts = [cell(k, info[k]) for k in _INSPECT_KEYS if info.get(k) not in (None, "", [], {})]
    return [f"{info.get('kind')}: {path}", "  " + "; ".join(parts)]
