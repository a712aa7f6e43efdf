"""``qckpt plan``'s tables: one per command, ranks with equal figures on one row."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from qckpt.report import human_bytes

_COLUMNS = (
    ("parameter_bytes", "params"),
    ("transient_bytes", "transient"),
    ("activation_bytes", "activations"),
    ("forward_bytes", "forward"),
    ("peak_bytes", "peak"),
    ("bytes_read", "read"),
    ("host_bytes", "host"),
)


def _ranges(ranks: list[int]) -> str:
    out, start, prev = [], None, None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def grouped(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(rank ranges, figures) for each distinct set of figures, in rank order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        key = tuple(r[k] for k, _ in _COLUMNS) + (r["fits"], r.get("refused"))
        groups.setdefault(key, []).append(r)
    return [(_ranges([x["rank"] for x in g]), g[0]) for g in groups.values()]


def _fits(v: bool | None, refused: str | None = None) -> str:
    if refused:
        return "refused"
    return "-" if v is None else ("yes" if v else "does not fit")


def _short(n: int) -> str:
    return human_bytes(n).replace(".00 ", " ")


def table_lines(commands: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The per-rank table as aligned plain text (stdout stays greppable and unwrapped)."""
    head = ["command", "ranks", *(h for _, h in _COLUMNS), "fits"]
    body = [
        [cmd, ranks, *(_short(r[k]) for k, _ in _COLUMNS), _fits(r["fits"], r.get("refused"))]
        for cmd, rows in commands.items()
        for ranks, r in grouped(rows)
    ]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(row: list[str]) -> str:
        cells = [
            c.ljust(w) if i < 2 or i == len(row) - 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(head), *(line(r) for r in body)]


def suggestion_lines(data: dict[str, Any]) -> list[str]:
    """One line per command: fits as planned, or the smallest layout that does."""
    if data.get("gpu_memory_bytes") is None:
        return ["give --gpu-memory SIZE to check what fits and get a layout suggestion"]
    lines = []
    world = data["world_size"]
    for cmd, ok in data["fits"].items():
        sug = data["suggestion"].get(cmd)
        if ok:
            lines.append(f"{cmd}: fits with {data['layout']['label']}")
            continue
        worst = max(data["commands"][cmd], key=lambda r: r["peak_bytes"])
        need = (
            f"{cmd}: does not fit: rank {worst['rank']} needs {human_bytes(worst['peak_bytes'])}"
            f" of {human_bytes(data['gpu_memory_bytes'])}"
        )
        if worst.get("refused"):
            need = f"{cmd}: refused with {data['layout']['label']}"
        if sug is None:
            lines.append(f"{need}; no layout of {world} ranks fits")
        else:
            sets = " ".join(
                f"--set {s}" for s in sug["set"] if cmd == "calibrate" or "parallel" in s
            )
            lines.append(f"{need}; smallest layout that fits: {sug['label']} ({sets})")
    return lines


def scheme_lines(data: dict[str, Any]) -> list[str]:
    """One line per recipe scheme: what it quantizes and what the export stores of it."""
    rows = data.get("schemes") or []
    if not rows:
        return []
    out = [f"export: {human_bytes(data['export_bytes'])} in all; per scheme:"]
    for r in rows:
        what = r["weights"] if r["weights"] == r["inputs"] else f"{r['weights']} / {r['inputs']}"
        out.append(
            f"  {r['entry']}: {what}: {r['linears']} linears, "
            f"{human_bytes(r['export_bytes'])} ({r['bits_per_weight']:.2f} bits per weight), "
            f"{human_bytes(r['amax_bytes'])} of amaxes"
        )
    return out


def render_plan(data: dict[str, Any], console: Console) -> None:
    world, lay = data["world_size"], data["layout"]
    mem = data.get("gpu_memory_bytes")
    model = data["model"]
    console.print(
        f"plan: {model['source']} ({model['model_type']}, {model['parameters'] / 1e9:.3g} B "
        f"parameters, {human_bytes(model['bytes'])} at {model['dtype']}) on {world} rank(s) "
        f"({data['nproc_per_node']} x {data['nnodes']} node(s)), {lay['label']}, "
        f"dp={world // (lay['ep'] * lay['tp'])}; GPU memory "
        f"{human_bytes(mem) if mem is not None else 'not given'}"
        + (
            f", host memory {human_bytes(h)} per node"
            if (h := data.get("host_memory_bytes"))
            else ""
        ),
        markup=False,
        highlight=False,
    )
    tables = [(lay["label"], data["commands"]), *data.get("layouts", {}).items()]
    for label, cmds in tables:
        console.print(f"\nper rank, {label}:", markup=False, highlight=False)
        for line in table_lines(cmds):
            console.print(line, markup=False, highlight=False)
    console.print()
    for label, cmds in tables:
        for cmd, rows in cmds.items():
            why = next((r["refused"] for r in rows if r.get("refused")), None)
            if why:
                console.print(f"{cmd} refuses {label}: {why}", markup=False, highlight=False)
    for line in scheme_lines(data):
        console.print(line, markup=False, highlight=False)
    for note in data.get("notes", []):
        console.print(f"note: {note}", markup=False, highlight=False)
    for line in suggestion_lines(data):
        console.print(line, markup=False, highlight=False)
