"""qckpt.atomic: the one way qckpt writes a directory or a file.

Races between real processes (exactly one of two writers to one target wins, with the kernel's
RENAME_NOREPLACE and with the fallback), symlinked targets, failures and signals mid-write, write
errors from a real file-size limit, the umask, stale temps of dead processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qckpt import atomic
from qckpt.atomic import Interrupted, atomic_dir, atomic_file, write_bytes
from qckpt.errors import OutputError
from tests.conftest import run_qckpt


def _hidden_leftovers(parent: Path) -> list[str]:
    return sorted(
        p.name for p in parent.iterdir() if ".qckpt-tmp-" in p.name or ".qckpt-old-" in p.name
    )


def _racer(target: str, kind: str, me: int, barrier, fallback: bool) -> None:
    if fallback:
        atomic.renameat2 = lambda: None  # as on a kernel/filesystem without RENAME_NOREPLACE
    try:
        if kind == "dir":
            with atomic_dir(target, key="export.output") as tmp:
                (tmp / "who").write_text(str(me))
                barrier.wait(30)  # both are mid-write: neither target existed at the start
        else:
            with atomic_file(target, key="--json", replace=False) as tmp:
                tmp.write_text(str(me))
                barrier.wait(30)
    except OutputError as exc:
        ok = str(Path(target).resolve()) in str(exc) and "\n" not in str(exc)
        os._exit(3 if ok else 4)
    os._exit(0)


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("kind", ["dir", "file"])
def test_two_writers_race_exactly_one_wins(tmp_path, kind, fallback):
    target = tmp_path / "out"
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [
        ctx.Process(target=_racer, args=(str(target), kind, i, barrier, fallback)) for i in (1, 2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    codes = sorted(p.exitcode for p in procs)
    assert codes == [0, 3], codes  # one wins, the other refuses naming the target
    winner = [i for p, i in zip(procs, (1, 2), strict=True) if p.exitcode == 0][0]
    got = (target / "who") if kind == "dir" else target
    assert got.read_text() == str(winner)
    assert _hidden_leftovers(tmp_path) == []


def test_replace_through_a_symlink_keeps_the_link_and_leaves_nothing(tmp_path):
    real = tmp_path / "exports" / "v1"
    real.mkdir(parents=True)
    (real / "old.txt").write_text("old")
    link = tmp_path / "latest"
    link.symlink_to(real)
    asked = []
    with atomic_dir(link, replace=True, may_replace=asked.append) as tmp:
        (tmp / "new.txt").write_text("new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in real.iterdir()) == ["new.txt"]
    assert asked == [real]  # asked right before the swap, about the real dir
    assert _hidden_leftovers(tmp_path) == [] and _hidden_leftovers(real.parent) == []


def test_refused_replacement_leaves_the_target(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "mine").write_text("keep")

    def refuse(p: Path) -> None:
        raise OutputError(f"{p}: not ours")

    with pytest.raises(OutputError, match="not ours"):
        with atomic_dir(target, replace=True, may_replace=refuse) as tmp:
            (tmp / "x").write_text("x")
    assert [p.name for p in target.iterdir()] == ["mine"]
    assert _hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("how", ["error", "ctrl-c", "sigterm"])
def test_failure_or_signal_mid_write_removes_the_temp(tmp_path, how):
    target = tmp_path / "out"
    before = signal.getsignal(signal.SIGTERM)
    expected = {"error": RuntimeError, "ctrl-c": KeyboardInterrupt, "sigterm": Interrupted}[how]
    with pytest.raises(expected):
        with atomic_dir(target) as tmp:
            (tmp / "half.safetensors").write_bytes(b"x" * 1000)
            assert _hidden_leftovers(tmp_path) == [tmp.name]  # it was there, mid-write
            if how == "error":
                raise RuntimeError("boom")
            if how == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not interrupt the write")
    assert not target.exists() and _hidden_leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is scoped to the write


def test_a_full_disk_is_one_line_naming_the_output(tmp_path, monkeypatch):
    target = tmp_path / "calib.safetensors"
    target.write_bytes(b"the previous calibration")

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            self.f.write(data[:10])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "open", lambda p, m: Full(open(p, m)), raising=False)
    with pytest.raises(OutputError) as exc:
        write_bytes(target, b"y" * 4096, key="calibrate.output")
    assert str(exc.value) == (f"calibrate.output: cannot write {target}: no space left on device")
    assert target.read_bytes() == b"the previous calibration"  # untouched, nothing half-written
    assert _hidden_leftovers(tmp_path) == []


def test_a_read_only_parent_is_one_line_naming_the_output(tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: make mkdir fail as it would for a user
        real_mkdir = Path.mkdir

        def mkdir(self, *a, **k):
            if self.parent == parent:
                raise PermissionError(13, "Permission denied", str(self))
            return real_mkdir(self, *a, **k)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    else:
        parent.chmod(0o555)
    try:
        with pytest.raises(OutputError) as exc:
            with atomic_dir(parent / "fp8", key="export.output"):
                pass
    finally:
        parent.chmod(0o755)
    assert str(exc.value) == f"export.output: cannot write {parent / 'fp8'}: permission denied"
    assert list(parent.iterdir()) == []


def test_file_too_large_through_the_cli(tmp_path):
    """A real RLIMIT_FSIZE: the --json report cannot be written; one line, exit 1, the old report
    untouched and no temp left."""
    import resource

    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(tmp_path / "x.safetensors"))
    report = tmp_path / "report.json"
    report.write_text("{}\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "qckpt", "inspect", "x.safetensors", "--json", "report.json"],
        cwd=tmp_path,
        env=env,
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"qckpt: error: --json: cannot write {report}: file too large"
    ]
    assert report.read_text() == "{}\n" and _hidden_leftovers(tmp_path) == []


def test_files_and_dirs_get_the_mode_the_umask_asks_for(tmp_path):
    old = os.umask(0o027)
    try:
        f = write_bytes(tmp_path / "a.json", b"{}")
        with atomic_dir(tmp_path / "d") as tmp:
            fd = os.open(tmp / "shard.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)  # some writers (safetensors) create 0600 files whatever the umask
            (tmp / "sub").mkdir(mode=0o700)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(f) == 0o640
    assert mode(tmp_path / "d") == 0o750 and mode(tmp_path / "d" / "sub") == 0o750
    assert mode(tmp_path / "d" / "shard.safetensors") == 0o640


def test_stale_temps_of_dead_processes_go_others_stay(tmp_path):
    target = tmp_path / "fp8"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = atomic.host_tag()
    names = {
        "dead": f".fp8.qckpt-tmp-{host}-{dead.pid}-0000",
        "alive": f".fp8.qckpt-tmp-{host}-{os.getpid()}-0000",
        "other-host": f".fp8.qckpt-tmp-ffffffff-{dead.pid}-0000",
    }
    for n in names.values():
        (tmp_path / n).mkdir()
        (tmp_path / n / "half").write_text("x")
    with atomic_dir(target) as tmp:
        (tmp / "ok").write_text("ok")
    left = {p.name for p in tmp_path.iterdir()}
    assert names["dead"] not in left
    assert {names["alive"], names["other-host"], "fp8"} <= left


def test_json_onto_a_directory_is_refused_without_leftovers(tmp_path):
    d = tmp_path / "reports"
    d.mkdir()
    r = run_qckpt("inspect", str(tmp_path), "--json", str(d), cwd=tmp_path)
    # the guard refuses first (PATH contains it); the helper refuses a dir target by itself too
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(OutputError, match="is a directory; name a file"):
        write_bytes(d, b"{}", key="--json")
    assert list(d.iterdir()) == [] and _hidden_leftovers(tmp_path) == []


def test_a_file_where_a_parent_dir_should_be_is_one_line(tmp_path):
    (tmp_path / "runs").write_text("a file, not a dir")
    with pytest.raises(OutputError) as exc:
        write_bytes(tmp_path / "runs" / "report.json", b"{}", key="--json")
    assert str(exc.value) == (
        f"--json: cannot write {tmp_path / 'runs' / 'report.json'}: a file is in the way"
    )
    with pytest.raises(OutputError, match="a file is in the way"):
        with atomic_dir(tmp_path / "runs" / "fp8", key="export.output"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
