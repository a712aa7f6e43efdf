"""Writing outputs as a user meets it, through the real CLI: two exports racing for one target,
Ctrl-C / SIGTERM in the middle of an export, ``overwrite`` onto a dir qckpt did not write, and
files that honour the umask. Every input is hashed before and after; nothing is left behind.

Exports pause mid-write through their progress callback (``_paused_cli.py``), so the
interruptions and the race happen at a known point, not after a sleep.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qckpt import EXPORT_MARKER
from tests.conftest import ROOT, run_qckpt

RECIPE = str(ROOT / "configs" / "tiny-dense.yaml")
DRIVER = str(Path(__file__).with_name("_paused_cli.py"))


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".qckpt-" in p.name)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _umask_027() -> None:
    os.umask(0o027)
    # a shell without job control starts background jobs with SIGINT ignored, and Python keeps
    # an ignored SIGINT so: the child gets the default a terminal user's qckpt has
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """An HF checkpoint (``convert --to hf``) and its calibration file, made once by the CLI
    under umask 027."""
    w = tmp_path_factory.mktemp("safety")
    inputs = w / "in"
    sets = [
        f"checkpoint.path={inputs / 'hf'}",
        f"calibrate.output={inputs / 'calib.safetensors'}",
        "calibrate.data.num_samples=4",
    ]
    sets = [a for s in sets for a in ("--set", s)]
    for cmd in (
        ["convert", RECIPE, str(inputs / "hf"), "--to", "hf", *sets],
        ["calibrate", RECIPE, *sets],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "qckpt", *cmd],
            cwd=w,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=_umask_027,
        )
        assert r.returncode == 0, r.stderr
    return w, inputs, sets


def _paused_export(w: Path, sets: list[str], out: Path, marker: Path, go: str, *extra: str):
    args = [RECIPE, *sets, "--set", f"export.output={out}", *extra]
    return subprocess.Popen(
        [sys.executable, DRIVER, str(marker), go, "--", "export", *args],
        cwd=w,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_umask_027,
    )


def _wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 180
    while not all(p.exists() for p in paths):
        for proc in procs:
            assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the export never reached its pause"
        time.sleep(0.05)


def test_calibration_file_and_convert_output_follow_the_umask(made):
    _, inputs, _ = made
    # safetensors alone writes 0600 files whatever the umask
    assert _mode(inputs / "calib.safetensors") == 0o640
    hf = inputs / "hf"
    assert (hf / "model.safetensors").is_file() and _mode(hf) == 0o750
    assert {_mode(p) for p in hf.iterdir()} == {0o640}
    assert _leftovers(inputs) == []


def test_two_exports_to_one_target_exactly_one_wins(made):
    w, inputs, sets = made
    before = _hashes(inputs)
    out = w / "race" / "fp8"
    markers = [w / "race-1", w / "race-2"]
    go = w / "race-go"
    procs = [_paused_export(w, sets, out, m, str(go)) for m in markers]
    _wait_for(markers, procs)  # both are mid-write: the target did not exist when they started
    assert len(_leftovers(out.parent)) == 2
    go.touch()
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    codes = sorted(rc for _, _, rc in results)
    assert codes == [0, 1], [err for _, err, _ in results]
    loser = next(err for _, err, rc in results if rc == 1)
    assert loser.strip().splitlines() == [
        f"qckpt: error: export.output: {out} appeared while this command wrote it "
        "(another run?); refusing to replace it"
    ]
    assert (out / EXPORT_MARKER).is_file() and (out / "config.json").is_file()
    assert _leftovers(out.parent) == [] and _hashes(inputs) == before
    # the export honours the umask too
    assert _mode(out) == 0o750
    assert {_mode(p) for p in out.iterdir()} == {0o640}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_interrupt_mid_export_says_so_and_leaves_nothing(made, sig):
    w, inputs, sets = made
    before = _hashes(inputs)
    out = w / f"int-{sig.name}" / "fp8"
    marker = w / f"paused-{sig.name}"
    proc = _paused_export(w, sets, out, marker, "-")
    _wait_for([marker], [proc])
    (tmp,) = [out.parent / n for n in _leftovers(out.parent)]
    assert any(tmp.glob("*.safetensors"))  # interrupted mid-write, for real
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = [line for line in err.strip().splitlines() if line.startswith("qckpt")]
    assert said == ["qckpt: interrupted"], err
    assert not out.exists() and _leftovers(out.parent) == []
    assert _hashes(inputs) == before


def test_overwrite_never_replaces_a_dir_qckpt_did_not_export(made):
    w, inputs, sets = made
    mine = w / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    before = _hashes(w)
    r = run_qckpt(
        "export", RECIPE, *sets, "--set", f"export.output={mine}", "--set",
        "export.overwrite=true", cwd=w,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"qckpt: error: export.output: {mine} exists and was not written by qckpt export "
        f"(no {EXPORT_MARKER}); export.overwrite only replaces qckpt exports, remove it "
        "yourself if it should go"
    ]
    assert _hashes(w) == before and _leftovers(w) == []
