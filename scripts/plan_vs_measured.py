"""Put ``qckpt plan``'s predictions next to a command's measured peaks (issue 17's GPU check).

    python scripts/plan_vs_measured.py plan.json load load.json
    python scripts/plan_vs_measured.py plan.json calibrate calib.json
    python scripts/plan_vs_measured.py plan.json export export.json

``plan.json``: ``qckpt plan ... --json`` for the same recipe, --set values and world size as the
measured run; the other file: that command's ``--json``. Prints, per rank it can match, the
predicted peak (device; export: host) beside the measured whole-command peak and their ratio.
Rank 0's ``peaks`` come from the top level of the command's JSON; per-rank rows (a sharded
load's ``runs[0].ranks``) where the command gives them.
"""

from __future__ import annotations

import json
import sys


def _measured(command: str, data: dict) -> dict[int, int]:
    """rank -> measured peak bytes (device for load/calibrate, anonymous host for export)."""
    peaks = data.get("peaks", {})
    key = "host_peak_anon_bytes" if command == "export" else "device_peak_bytes"
    out = {0: peaks.get(key)} if peaks.get(key) is not None else {}
    for run in data.get("runs", [])[:1]:
        for row in run.get("ranks", []):
            row_peaks = row.get("peaks", row)
            if row_peaks.get(key) is not None:
                out[int(row["rank"])] = row_peaks[key]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("load", "calibrate", "export"):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print(
            "usage: plan_vs_measured.py PLAN_JSON load|calibrate|export COMMAND_JSON",
            file=sys.stderr,
        )
        return 2
    plan = json.loads(open(argv[0]).read())
    command = argv[1]
    measured = _measured(command, json.loads(open(argv[2]).read()))
    gib = 2**30
    print(f"{command}: rank  predicted GiB  measured GiB  measured/predicted")
    for row in plan["commands"][command]:
        got = measured.get(row["rank"])
        pred = row["host_bytes"] if command == "export" else row["peak_bytes"]
        if got is None:
            continue
        print(
            f"{command}: {row['rank']:>4}  {pred / gib:13.2f}  {got / gib:12.2f}  {got / pred:18.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
