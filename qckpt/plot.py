"""Figures: memory over a load (``qckpt load --plot``). matplotlib is imported only when drawing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from qckpt.errors import UsageError

if TYPE_CHECKING:
    from qckpt.load.loader import LoadReport


def plot_memory(reports: list[LoadReport] | LoadReport, path: str | os.PathLike) -> Path:
    """Draw transient memory (and host RSS) over each load, side by side, into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = list(reports) if isinstance(reports, list | tuple) else [reports]
    if not reports:
        raise UsageError("--plot: no load to draw")
    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4), squeeze=False)

    def rss_delta(r: LoadReport) -> list[float]:
        base = r.samples[0][2] if r.samples else 0
        return [(s[2] - base) / 2**20 if s[2] else 0.0 for s in r.samples]

    # one y scale for all panels, so bulk and stream compare at a glance
    top = max(
        [s[1] / 2**20 for r in reports for s in r.samples]
        + [v for r in reports for v in rss_delta(r)]
        + [r.predicted_transient_bytes / 2**20 for r in reports],
        default=1.0,
    )
    for ax, r in zip(axes[0], reports, strict=True):
        t = [s[0] for s in r.samples]
        # levels change at the sampled events and stay until the next: draw steps
        ax.step(t, [s[1] / 2**20 for s in r.samples], where="post", label="transient (MiB)")
        if any(s[2] for s in r.samples):
            ax.step(t, rss_delta(r), where="post", label="host RSS - start (MiB)", alpha=0.6)
        ax.axhline(r.predicted_transient_bytes / 2**20, ls="--", c="gray", label="2·max(numel)")
        ax.set_title(
            f"{'stream' if r.stream else 'bulk'}: peak transient "
            f"{r.transient_bytes / 2**20:.1f} MiB, {r.seconds:.2f} s"
        )
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0, top=max(top * 1.1, 1.0))
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
