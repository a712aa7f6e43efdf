"""``--nproc-per-node N``: the recipe is checked before any rank starts, and a failed run shows
the first failing rank's one line with its exit code, never torchrun's traceback."""

import json

import pytest
import torch

from qckpt.cli.launch import LAUNCHER_FILE, first_failure
from tests.conftest import run_qckpt

_TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "OMP_NUM_THREADS", "torch/distributed", "====")


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert not any(n in r.stderr for n in _TORCHRUN_NOISE), r.stderr
    return lines[0]


@pytest.mark.parametrize("cmd", ["calibrate", "load"])
def test_recipe_error_exits_2_before_any_rank_starts(tmp_path, cmd):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("parallel:\n  timeout_s: .nan\n")
    r = run_qckpt(cmd, str(recipe), "--nproc-per-node", "2", timeout=120)
    assert r.returncode == 2
    line = _one_line(r)
    assert (
        line == "qckpt: error: parallel.timeout_s: expected a finite number (|x| <= 1e300), got nan"
    )


def test_world_size_is_checked_against_nproc_before_relaunch():
    r = run_qckpt(
        "calibrate", "configs/tiny-moe.yaml", "--nproc-per-node", "3", "--set", "parallel.ep=2"
    )
    assert r.returncode == 2
    assert _one_line(r) == "qckpt: error: parallel.ep: must divide the world size 3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_failing_ranks_show_one_line_and_the_ranks_exit_code(tmp_path):
    # valid recipe, so the parent relaunches; every rank then fails with a usage error (exit 2)
    r = run_qckpt(
        "load",
        "configs/tiny-dense.yaml",
        "--nproc-per-node",
        "2",
        "--set",
        "load.device=cuda",
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    line = _one_line(r)
    assert line.startswith("qckpt: error (rank ")
    assert line.endswith("load.device: cuda asked for but no CUDA device is available")


def _rank(d, rank, t, code, line):
    (d / f"rank-{rank}.json").write_text(json.dumps({"time": t, "code": code, "line": line}))


def test_first_failure_is_the_earliest_real_one(tmp_path):
    _rank(tmp_path, 0, 10.0, 130, "qckpt: interrupted")  # stopped by torchrun after rank 1 failed
    _rank(tmp_path, 1, 12.0, 1, "qckpt: error (rank 1): boom")
    _rank(tmp_path, 2, 13.0, 2, "qckpt: error (rank 2): later")
    assert first_failure(tmp_path, 1) == ("qckpt: error (rank 1): boom", 1)


def test_a_rank_that_dies_without_a_word_is_named_with_its_signal(tmp_path):
    (tmp_path / LAUNCHER_FILE).write_text(json.dumps({"1": -9, "0": -15}))
    assert first_failure(tmp_path, 1) == ("qckpt: error (rank 1): killed by SIGKILL", 137)
    assert first_failure(tmp_path / "nothing", 1)[1] == 1


def test_a_good_run_streams_rank_0s_lines_and_nothing_of_torchrun(tmp_path):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    save_model_dcp(build_model("tiny-dense"), tmp_path / "dcp")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: {source: tiny-dense}\n"
        f"checkpoint: {{path: {tmp_path / 'dcp'}}}\n"
        "load: {device: cpu}\n"
        f"calibrate: {{output: {tmp_path / 'calib.safetensors'}, "
        "data: {num_samples: 8, seq_len: 16, batch_size: 2}}\n"
        "parallel: {timeout_s: 60}\n"
    )
    r = run_qckpt("calibrate", str(recipe), "--nproc-per-node", "2", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("amax values from 2 rank(s)")
    assert r.stderr.count("calibrate: ") == 1  # rank 0 speaks, once
    assert not any(n in r.stderr for n in _TORCHRUN_NOISE), r.stderr
    assert (tmp_path / "calib.safetensors").is_file()


def _spawn(tmp_path, code: str) -> tuple[int, float]:
    import os
    import time

    from qckpt.cli.launch import spawn_ranks

    t0 = time.monotonic()
    rc = spawn_ranks(2, ["-c", code], dict(os.environ), tmp_path)
    return rc, time.monotonic() - t0


def test_a_rank_killed_stops_the_others_at_once_and_is_named(tmp_path):
    # rank 1 dies by SIGKILL; rank 0 would sleep a minute: the launcher stops it right away
    code = (
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    rc, seconds = _spawn(tmp_path, code)
    assert rc == 1 and seconds < 10, seconds
    summary = json.loads((tmp_path / LAUNCHER_FILE).read_text())
    assert list(summary.items())[0] == ("1", -9)  # the first failure first
    assert summary["0"] == -15  # stopped with SIGTERM
    assert first_failure(tmp_path, rc) == ("qckpt: error (rank 1): killed by SIGKILL", 137)


def test_ranks_get_torchruns_environment_and_a_good_run_leaves_no_summary(tmp_path):
    code = (
        "import json, os, pathlib\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "(d / ('env-' + os.environ['RANK'])).write_text(json.dumps([os.environ[k] for k in keys]))\n"
    )
    rc, _ = _spawn(tmp_path, code)
    assert rc == 0
    assert not (tmp_path / LAUNCHER_FILE).exists()
    for r in (0, 1):
        got = json.loads((tmp_path / f"env-{r}").read_text())
        assert got == [str(r), str(r), "2", "2", "127.0.0.1"]
