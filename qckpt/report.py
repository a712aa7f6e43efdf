"""Memory, amax and export reports: rich tables on stderr; the same data goes to ``--json``."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from qckpt.term import err


def human_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _fmt(key: str, v: Any) -> str:
    if isinstance(v, float):
        if key.endswith("bytes"):
            return human_bytes(v)
        return f"{v:.4g}"
    if isinstance(v, int) and key.endswith("bytes"):
        return f"{human_bytes(v)} ({v:,})"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(k, x)}" for k, x in v.items()) or "-"
    if isinstance(v, list | tuple):
        return (
            ", ".join(map(str, v))
            if len(v) <= 8
            else f"{len(v)} items: {', '.join(map(str, v[:8]))}, ..."
        )
    return "-" if v is None else str(v)


def render_mapping(title: str, data: dict[str, Any], console: Console = err) -> None:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    for k, v in data.items():
        t.add_row(k, _fmt(k, v))
    console.print(t)


_LOAD_ROWS = (
    "stream",
    "tensors",
    "tensors_per_format",
    "transient_bytes",
    "predicted_transient_bytes",
    "peak_bytes",
    "peak_host_rss_bytes",
    "bytes_read",
    "seconds",
    "gbps",
    "measured_by",
)


def render_load_report(data: dict[str, Any], console: Console = err) -> None:
    runs = data.get("runs", [])
    world = data.get("world_size", 1)
    who = f"{world} rank(s)" if world <= 1 else f"rank 0 of {world}; every rank below"
    t = Table(title=f"load into {data.get('params')} params ({who})", title_justify="left")
    t.add_column("", style="bold")
    for r in runs:
        t.add_column("stream" if r.get("stream", True) else "bulk (baseline)")
    keys = [k for k in _LOAD_ROWS if any(k in r for r in runs)]
    keys += sorted({k for r in runs for k in r} - set(keys) - {"samples", "ranks"})
    for k in keys:
        t.add_row(k, *[_fmt(k, r.get(k)) for r in runs])
    if len(runs) == 2:
        a, b = runs
        if a.get("transient_bytes") and b.get("transient_bytes"):
            t.add_row("transient ratio", f"{a['transient_bytes'] / b['transient_bytes']:.3f}", "1")
    console.print(t)
    for r in runs:
        if len(r.get("ranks") or []) > 1:
            render_rank_rows(r["ranks"], "stream" if r.get("stream", True) else "bulk", console)


def _holds_cell(holds: dict[str, Any] | None) -> str:
    """'experts 0-63 of 128, tp 1/2' (an EP / TP block), or 'whole model'."""
    holds = holds or {}
    parts = []
    if "experts" in holds:
        a, b, n = holds["experts"]
        parts.append(f"experts {a}-{b - 1} of {n}")
    if "tp" in holds:
        parts.append(f"tp {holds['tp_rank']}/{holds['tp']}")
    return ", ".join(parts) or "whole model"


def render_rank_rows(rows: list[dict[str, Any]], mode: str, console: Console = err) -> None:
    """What each rank holds and read: one row per rank (the per-rank load report)."""
    t = Table(title=f"per rank ({mode})", title_justify="left")
    # the whole command's peaks of every rank: the top-level ``ranks`` (phases)
    cols = ("rank", "holds", "params", "read", "transient", "load peak", "seconds")
    for col in cols:
        t.add_column(col)
    for r in rows:
        t.add_row(
            str(r.get("rank")),
            _holds_cell(r.get("holds")),
            human_bytes(r.get("param_bytes")),
            human_bytes(r.get("bytes_read")),
            human_bytes(r.get("transient_bytes")),
            human_bytes(r.get("peak_bytes")),
            f"{r.get('seconds') or 0:.2f}",
        )
    console.print(t)


def render_amax_report(data: dict[str, Any], console: Console = err) -> None:
    layers = data.get("layers")
    if not isinstance(layers, dict | list):
        render_mapping("amax report", data, console)
        return
    items = (
        layers.items() if isinstance(layers, dict) else ((row.get("layer"), row) for row in layers)
    )
    t = Table(title="amax report", title_justify="left")
    t.add_column("layer", no_wrap=True)
    for c in ["calibrated", "experts with tokens", "amax min", "amax max", "shared", "zero"]:
        t.add_column(c)
    for name, row in items:
        t.add_row(
            str(name),
            f"{row.get('calibrated', '-')}/{row.get('total', '-')}",
            _experts_cell(row),
            _fmt("min", row.get("amax_min")),
            _fmt("max", row.get("amax_max")),
            _fmt("shared", row.get("shared", 0)),
            _fmt("zero", row.get("zero_amax", [])) if row.get("zero_amax") else "",
        )
    console.print(t)
    rest = {k: v for k, v in data.items() if k != "layers"}
    if rest:
        render_mapping("calibration", rest, console)


def _experts_cell(row: dict[str, Any]) -> str:
    """'8/8' experts that got tokens, then per rank how many got tokens there ('r0:8 r1:6')."""
    counts = row.get("expert_tokens")
    if not counts:
        return "-"
    hot = sum(1 for c in counts.values() if any(c))
    per_rank = [
        sum(1 for c in counts.values() if c[r]) for r in range(len(next(iter(counts.values()))))
    ]
    ranks = " ".join(f"r{r}:{n}" for r, n in enumerate(per_rank)) if len(per_rank) > 1 else ""
    cold = row.get("cold_experts") or []
    tail = f" cold: {', '.join(map(str, cold))}" if cold else ""
    return f"{hot}/{len(counts)} {ranks}{tail}".strip()


_EXPORT_RANK_COLS = ("files", "bytes_read", "bytes_written", "read_seconds",
                     "quantize_seconds", "write_seconds", "rss_anon_peak_bytes")  # fmt: skip


def render_export_report(data: dict[str, Any], console: Console = err) -> None:
    render_mapping("export", {k: v for k, v in data.items() if k != "ranks"}, console)
    ranks = data.get("ranks") or []
    if ranks:  # a distributed export: what each rank did
        t = Table(title="export per rank", title_justify="left")
        t.add_column("rank", style="bold")
        for c in _EXPORT_RANK_COLS:
            t.add_column(c)
        for r in ranks:
            files = r.get("files", [])
            cells = [
                f"{len(files)}" if c == "files" else _fmt(c, r.get(c)) for c in _EXPORT_RANK_COLS
            ]
            t.add_row(str(r.get("rank")), *cells)
        console.print(t)


def _render_startup(data: dict[str, Any], console: Console) -> None:
    """Where the start-up went (its parts), and a line when it compiled much source."""
    sp = data.get("startup_parts")
    if sp:
        parts = [f"{k.replace('_', ' ')} {v:.2f}" for k, v in sp.items() if v >= 0.005]
        console.print(f"[bold]start-up (s)[/bold]  {' · '.join(parts)}", soft_wrap=True)
    from qckpt.bytecode import advice

    note = advice(data.get("compiled_at_import") or {})
    if note:
        console.print(f"note: {note}", soft_wrap=True)  # one line, however narrow


def render_command(data: dict[str, Any], console: Console = err) -> None:
    """Two lines under a command's report: where its time went (seconds per phase, from the
    process start) and its whole-command peaks (never reset), beside the tables above."""
    ph = data.get("phases")
    if ph:
        parts = [f"{k} {v:.2f}" for k, v in ph.items() if k != "total" and v >= 0.005]
        console.print(f"[bold]time (s)[/bold]  {' · '.join(parts)}  = {ph['total']:.2f} total")
    _render_startup(data, console)
    pk = data.get("peaks")
    if pk:
        dev = (
            f"device {human_bytes(pk['device_peak_bytes'])} "
            f"(reserved {human_bytes(pk.get('device_peak_reserved_bytes'))}) · "
            if pk.get("device_peak_bytes") is not None
            else ""
        )
        anon = pk.get("host_peak_anon_bytes")
        console.print(
            f"[bold]whole-command peaks[/bold]  {dev}host RSS "
            f"{human_bytes(pk.get('host_peak_rss_bytes'))}"
            + (f" (anonymous {human_bytes(anon)})" if anon is not None else "")
        )
    ranks = data.get("ranks") or []
    if ranks:
        key = "device_peak_bytes" if pk and pk.get("device_peak_bytes") else "host_peak_rss_bytes"
        per = " · ".join(f"r{r['rank']} {human_bytes(r['peaks'].get(key))}" for r in ranks)
        console.print(f"[bold]per rank[/bold] ({key.split('_')[0]})  {per}")
