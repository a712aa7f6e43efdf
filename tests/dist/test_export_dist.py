"""Distributed export: 2 and 3 gloo ranks, sharing the shard files, write the same files as one
process for every layout, each rank an equal share of the bytes read and written (to within one
source tensor); a rank that fails or dies leaves no target and no temp dir, and the others fail
promptly.

One live world of 3 ranks serves the equality test (its ranks 0 and 1 also form a 2-rank
export, rank 2 idling); the deaths are real CLI rank processes (``_export_fault.py`` makes one
rank ``os._exit`` right after a tensor write), as torchrun would start them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.dist.harness import World

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 10.0
SHARD = "24KB"  # several shard files even for the tiny models, so every rank has some

# name: (export.format, quant_config kwargs, model, source kind)
CASES = {
    "ct-tensor-kv": ("compressed-tensors", {"kv": True}, "tiny-dense", "hf"),
    "ct-tensor-moe-dcp": ("compressed-tensors", {}, "tiny-moe", "dcp"),
    "ct-channel": ("compressed-tensors", {"weights": "channel", "inputs": "token"}, "tiny-moe", "hf"),
    "ct-block": ("compressed-tensors", {"weights": "block", "inputs": "group", "block": (32, 32)},
                 "tiny-dense", "hf"),
    "ct-nvfp4": ("compressed-tensors", {"fmt": "nvfp4"}, "tiny-dense", "hf"),
    "mo-fp8": ("modelopt", {}, "tiny-moe", "hf"),
    "mo-fp8-pcpt": ("modelopt", {"weights": "channel", "inputs": "token"}, "tiny-dense", "hf"),
    "mo-nvfp4": ("modelopt", {"fmt": "nvfp4"}, "tiny-moe", "hf"),
}  # fmt: skip


def _export(case: tuple, src: str, cal: str, out: str, mesh=None, options=None, **export_kw):
    from qckpt.export.writer import export_checkpoint
    from qckpt.models.build import load_config
    from qckpt.recipe import ExportConfig
    from tests.export_fixtures import quant_config

    fmt, qkw, model, _ = case
    cfg = load_config(model)
    return export_checkpoint(
        source=src,
        calibration=cal,
        output=out,
        model_type=cfg.model_type,
        model_config=cfg,
        quant=quant_config(**qkw),
        export=ExportConfig(format=fmt, output=out, max_shard_size=SHARD, **export_kw),
        mesh=mesh,
        options=options,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Sources, calibration files and the one-process export of every case, one shard file
    after another in plan order (one lane: the ranks write two files each at once)."""
    import torch.distributed.checkpoint as dcp

    from qckpt.export.writer import WriteOptions
    from tests.export_fixtures import quant_config, saved_model, write_calibration

    root = tmp_path_factory.mktemp("dexport")
    models = {m: saved_model(root, m) for m in ("tiny-dense", "tiny-moe")}
    dcp_dir = root / "tiny-moe-dcp"
    dcp.save(models["tiny-moe"][0].state_dict(), checkpoint_id=str(dcp_dir), no_dist=True)
    jobs = {}
    for name, case in CASES.items():
        model, hf_dir = models[case[2]]
        cal = write_calibration(root, model, quant_config(**case[1]), f"cal-{name}.safetensors")
        src = dcp_dir if case[3] == "dcp" else hf_dir
        rep = _export(
            case, str(src), str(cal), str(root / f"{name}-w1"), options=WriteOptions(lanes=1)
        )
        assert rep.shards >= 3 and rep.lanes == 1, (name, rep.shards)
        jobs[name] = (case, str(src), str(cal))
    return root, jobs


def _mesh(ranks: list[int]):
    """A mesh over ``ranks`` of the live world (every rank must call this: new_group is)."""
    import torch.distributed as dist

    from qckpt.parallel.deadline import Deadline, register
    from qckpt.parallel.mesh import Mesh

    g = dist.new_group(ranks)
    me = dist.get_rank()
    if me not in ranks:
        return None
    mesh = Mesh(world_size=len(ranks), rank=ranks.index(me), world_group=g, timeout_s=TIMEOUT_S)
    mesh.deadline = Deadline(TIMEOUT_S)
    register([g], mesh.deadline)
    return mesh


def _export_all(rank: int, world: int, root: str, jobs: dict, tag: str, ranks: list[int]):
    mesh = _mesh(ranks)
    if mesh is None:
        return {}
    out = {}
    for name, (case, src, cal) in jobs.items():
        rep = _export(case, src, cal, f"{root}/{name}-{tag}", mesh=mesh)
        out[name] = (rep.world_size, rep.ranks, rep.tensors_written)
    return out


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _no_temps(root: Path) -> bool:
    return not [p for p in root.iterdir() if ".qckpt-" in p.name]


def test_two_and_three_ranks_write_the_one_process_files(setup):
    root, jobs = setup
    world = World(3, timeout_s=TIMEOUT_S)
    try:
        for tag, ranks in (("w2", [0, 1]), ("w3", [0, 1, 2])):
            outs = world.run(_export_all, str(root), jobs, tag, ranks, deadline_s=240)
            assert all(o.ok for o in outs), [o.error for o in outs]
            shared = []  # shard files more than one rank wrote into
            lanes = []
            for name in jobs:
                size, per_rank, _ = outs[0].value[name]
                assert size == len(ranks)
                _assert_balanced(jobs[name], per_rank)
                lanes += [r["lanes"] for r in per_rank]
                files = [f for r in per_rank for f in r["files"]]
                shared += [f for f in set(files) if files.count(f) > 1]
                one, many = _tree(root / f"{name}-w1"), _tree(root / f"{name}-{tag}")
                assert sorted(one) == sorted(many), name
                for f in one:  # byte for byte: tensors, headers, index, config, marker
                    assert one[f] == many[f], (name, tag, f)
            assert shared, tag  # the ranks' shares cut files (whole files are not the unit)
            assert max(lanes) >= 2, lanes  # ranks wrote two (or more) of their files at once
        # a rank whose share holds a weight above its calibrated amax: every rank fails, with
        # the reason, and nothing is left
        case, src, cal = jobs["ct-tensor-kv"]
        bad = _tampered_calibration(root, _weight_written_by(1, jobs["ct-tensor-kv"]), cal)
        outs = world.run(_export_bad, str(root), (case, src, str(bad)), deadline_s=120)
        assert not any(o.ok for o in outs)
        assert "exceeds the calibrated weight amax" in outs[1].error, outs[1].error
        for o in (outs[0], outs[2]):
            assert "rank 1" in o.error and "exceeds" in o.error, o.error
        assert not (root / "bad-w3").exists() and _no_temps(root)
        # rank 0 fails after every shard is written (its own check of the dir): the others
        # learn it from its outcome, and nothing is left
        outs = world.run(_export_main_fails, str(root), jobs["ct-channel"], deadline_s=120)
        assert not any(o.ok for o in outs)
        assert "the export failed its own check: planted" in outs[0].error, outs[0].error
        for o in outs[1:]:
            assert "export failed on rank 0" in o.error and "planted" in o.error, o.error
        assert not (root / "main-fails").exists() and _no_temps(root)
    finally:
        world.close()


def _assert_balanced(job: tuple, per_rank: list[dict]) -> None:
    """Every rank wrote tensors; its bytes read plus written are within one source tensor (and
    its outputs) of an equal share; the shares add up to the files' tensor bytes and to the
    source read once (with the byte equality of the files: no tensor twice, none missed)."""
    from qckpt.export.shares import plan_items

    plan = _plan(job)
    world, items = len(per_rank), plan_items(plan)
    assert sum(r["bytes_written"] for r in per_rank) == plan.shards.total_size
    assert sum(r["bytes_read"] for r in per_rank) == sum(e.nbytes for e in plan.source.entries())
    total, big = sum(it.cost for it in items), max(it.cost for it in items)
    got = [r["bytes_read"] + r["bytes_written"] for r in per_rank]
    assert all(abs(b * world - total) <= big * world for b in got), (got, total, big)
    assert all(r["files"] and r["tensors_written"] for r in per_rank), per_rank


def _plan(job: tuple):
    from qckpt.export.plan import plan_export
    from qckpt.models.build import load_config
    from qckpt.recipe import ExportConfig
    from tests.export_fixtures import quant_config

    case, src, cal = job
    cfg = load_config(case[2])
    return plan_export(
        source=src,
        calibration=cal,
        output=Path(src).parent / "never",
        model_type=cfg.model_type,
        model_config=cfg,
        quant=quant_config(**case[1]),
        export=ExportConfig(format=case[0], max_shard_size=SHARD),
    )


def _weight_written_by(rank: int, job: tuple) -> str:
    """A quantized linear whose weight is in rank ``rank``'s share of 3."""
    from qckpt.export.shares import assign_items

    share = assign_items(_plan(job), 3)[rank]
    return next(g.module for it in share.items for g in it.groups if g.module)


def _tampered_calibration(root: Path, module: str, cal: str) -> Path:
    from qckpt.calib.state_file import load_calibration, save_calibration

    state = load_calibration(cal)
    state.amax[f"{module}.weight_amax"] = state.amax[f"{module}.weight_amax"] / 4
    return save_calibration(state, root / "cal-bad.safetensors")


def _export_bad(rank: int, world: int, root: str, job: tuple):
    from qckpt.parallel.mesh import init_mesh

    mesh = init_mesh(timeout_s=TIMEOUT_S, device="cpu")
    case, src, cal = job
    return _export(case, src, cal, f"{root}/bad-w3", mesh=mesh)


def _export_main_fails(rank: int, world: int, root: str, job: tuple):
    import qckpt.export.writer as ex
    from qckpt.errors import ExportError
    from qckpt.parallel.mesh import init_mesh

    def planted(tmp, target):
        raise ExportError(f"{target}: the export failed its own check: planted")

    real, ex.self_check = ex.self_check, planted
    try:
        case, src, cal = job
        mesh = init_mesh(timeout_s=TIMEOUT_S, device="cpu")
        return _export(case, src, cal, f"{root}/main-fails", mesh=mesh)
    finally:
        ex.self_check = real


# -- a rank that dies -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, recipe: Path, victim: int, mark: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "FAULT_RANK": str(victim),
        "FAULT_MARK": str(mark),
    }
    env.pop("QCKPT_DEBUG", None)
    script = Path(__file__).with_name("_export_fault.py")
    return subprocess.Popen(
        [sys.executable, str(script), "export", str(recipe)],
        cwd=recipe.parent,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _recipe(d: Path, root: Path, job: tuple) -> Path:
    case, src, cal = job
    d.mkdir()
    recipe = d / "r.yaml"
    recipe.write_text(
        f"model: {{source: {root / 'tiny-dense-hf'}}}\n"
        f"checkpoint: {{path: {src}}}\n"
        f"calibrate: {{output: {cal}}}\n"
        "quant: {kv_cache: true}\n"
        f"parallel: {{timeout_s: {TIMEOUT_S}}}\n"
        f"export: {{output: {d / 'out'}, max_shard_size: {SHARD}, device: cpu}}\n"
    )
    return recipe


def test_a_dead_rank_leaves_no_target_and_the_other_fails_in_time(setup, tmp_path):
    """Rank 1 dies (rank 0 must clean up), and in a second world at the same time rank 0 dies
    (rank 1 must remove the temp dir rank 0 made)."""
    root, jobs = setup
    runs = {}
    for victim in (1, 0):
        recipe = _recipe(tmp_path / f"victim{victim}", root, jobs["ct-tensor-kv"])
        mark, port = recipe.parent / "died", _free_port()
        runs[victim] = (recipe, mark, [_rank(r, port, recipe, victim, mark) for r in (0, 1)])
    try:
        rcs = {v: [p.wait(timeout=180) for p in procs] for v, (_, _, procs) in runs.items()}
    finally:
        for _, _, procs in runs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    ended = time.time()
    for victim, (recipe, mark, procs) in runs.items():
        survivor = 1 - victim
        assert rcs[victim][victim] == 9 and mark.exists()
        # (rank 0's transient progress bar leaves an empty line on a non-terminal stderr)
        lines = [ln for ln in procs[survivor].stderr.read().splitlines() if ln.strip()]
        assert rcs[victim][survivor] == 1, lines
        assert ended - float(mark.read_text()) < 1.5 * TIMEOUT_S + 5  # + the survivor's exit
        assert len(lines) == 1 and "Traceback" not in lines[0], lines
        assert lines[0].startswith(f"qckpt: error (rank {survivor}): export: "), lines
        assert "died or timed out (parallel.timeout_s=10" in lines[0], lines
        assert not (recipe.parent / "out").exists()
        assert _no_temps(recipe.parent), sorted(p.name for p in recipe.parent.iterdir())
