"""Sharded ``qckpt load`` (issue 17) on real gloo ranks: EP2, TP2 and DP2 x EP2 (4 ranks).

Every rank builds the sharded model (meta -> EP -> TP), allocates and reads only its blocks,
and its quantized parameters must equal, bit for bit, the matching slices of a one-rank load
of the same checkpoint: codes and block scales sliced, per-tensor scales (fp8, fp8_delayed's
state, nvfp4's global scale) equal. That needs the whole tensor's amax, reduced over the shard
group inside the read loop (``qckpt.load.shard_scales``); a block-local amax would give other
scales, so these tests fail on the code before it.

Sources: a DCP dir, an HF safetensors dir (per-expert names) and a blockwise-FP8 HF dir (the
copy path for ``fp8_block`` with the source's block size; the dequantize path otherwise).
Every format runs inside one scenario per layout, so the ranks are spawned once per world size.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.dist.harness import shared_world

pytestmark = pytest.mark.timeout(600)

SOURCE = "tiny-moe"
# (id, load.params, format options): fp8_block with 16x16 tiles, so TP2's splits (16 / 32
# rows and columns) fall on tile boundaries; the 128x128 default is refused under TP (below)
# fp8_delayed first: its build joins a collective (agree_delayed_state), best before the
# ranks' builds drift apart
FORMATS = (
    ("fp8_delayed", "fp8_delayed", {}),
    ("fp8", "fp8", {}),
    ("fp8-channel", "fp8", {"granularity": "channel"}),
    ("mxfp8", "mxfp8", {}),
    ("fp8_block", "fp8_block", {"block_size": (16, 16)}),
    ("nvfp4", "nvfp4", {}),
)
# the blockwise-FP8 source: its own layout (the copy path) and per-tensor FP8 (dequantized,
# requantized with the group amax); the other formats take the same dequantize path
QUANTIZED_SOURCE_FORMATS = ("fp8", "fp8_block")
# per-tensor state: equal on every rank to the one-rank load's
WHOLE_FIELDS = {"global_scale", "amax_history", "quant_scale"}


def _build(mesh, fmt, opts):
    """The model ``qckpt load`` fills (pipeline.load.build_for_load), with format options."""
    from qckpt.pipeline.load import build_for_load
    from qckpt.recipe import recipe_from_dict

    recipe = recipe_from_dict({"model": {"source": SOURCE}, "load": {"params": fmt}})
    return build_for_load(recipe, mesh, **opts).model


def _fields(m) -> dict:
    from qckpt import formats

    return {
        k: {
            "shape": tuple(v.shape),
            "fields": dict(v.fields()) if formats.is_quantized(v) else {"t": v.detach().clone()},
        }
        for k, v in m.state_dict(keep_vars=True).items()
    }


def _cases(sources: dict):
    for src, path in sources.items():
        for fid, fmt, opts in FORMATS:
            if src != "blockwise_fp8" or fid in QUANTIZED_SOURCE_FORMATS:
                yield src, path, fid, fmt, opts


def _load_all(mesh, sources: dict, models: dict | None = None) -> dict:
    """Every (source, format) loaded on this rank (into ``models`` built before, else built
    here): fields, blocks and report figures."""
    from qckpt.load.loader import load_checkpoint
    from qckpt.load.shard_scales import WholeScales
    from qckpt.parallel.shard import model_shards

    hooks = []
    original = WholeScales.__dict__["of"]

    def spy(model, mesh_):  # the reductions each load made, in order (the invariant)
        hooks.append(original.__func__(WholeScales, model, mesh_))
        return hooks[-1]

    WholeScales.of = spy
    out = {}
    try:
        for src, path, fid, fmt, opts in _cases(sources):
            m = models[(src, fid)] if models is not None else _build(mesh, fmt, opts)
            rep = load_checkpoint(m, path, mesh=mesh)
            specs = {n: (s.dim, s.start, s.stop) for n, s in model_shards(m).items()}
            out[(src, fid)] = {
                "params": _fields(m),
                "specs": specs,
                "bytes_read": rep.bytes_read,
                "param_bytes": rep.param_bytes,
                "holds": rep.holds,
                "reduced": list(hooks[-1].reduced) if hooks[-1] is not None else [],
                "copied": rep.copied_tensors,
            }
    finally:
        WholeScales.of = original
    return out


# per rank process: the mesh and models sc_build made for sc_sharded
_BUILT: dict = {}


def sc_build(rank, world, ep, tp, sources):
    """Every model first, in a scenario of its own: on a loaded host the ranks then enter the
    loads' collectives together, not one rank's builds apart (the groups wait 10 s at most)."""
    from qckpt.parallel.mesh import init_mesh

    mesh = init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu")
    models = {(src, fid): _build(mesh, fmt, opts) for src, _, fid, fmt, opts in _cases(sources)}
    _BUILT[(ep, tp)] = (mesh, models)


def sc_sharded(rank, world, ep, tp, sources):
    mesh, models = _BUILT.pop((ep, tp))
    t0 = time.monotonic()
    out = _load_all(mesh, sources, models)
    return {
        "loads": out,
        "ep_rank": mesh.ep_rank,
        "tp_rank": mesh.tp_rank,
        "seconds": time.monotonic() - t0,
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The tiny MoE (seed 3, not the build's seed 0) as DCP, HF and blockwise-FP8 16x16 dirs."""
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model
    from tests.quantized_fixtures import bf16_dir, blockwise_fp8

    root = tmp_path_factory.mktemp("sharded-load")
    hf = bf16_dir(root, SOURCE, seed=3)
    dcp = root / "dcp"
    save_model_dcp(build_model(SOURCE, seed=3), dcp)
    fp8 = blockwise_fp8(hf, root / "blockwise-fp8", block=(16, 16))
    return {"dcp": str(dcp), "hf": str(hf), "blockwise_fp8": str(fp8)}


@pytest.fixture(scope="module")
def reference(sources):
    """One-rank loads of every (source, format): what every sharded block must slice."""
    from qckpt.parallel.mesh import Mesh

    return _load_all(Mesh(), sources)


def _slice(field: torch.Tensor, whole: tuple, dim: int, start: int, stop: int) -> torch.Tensor:
    """The part of a one-rank field that a rank holding [start, stop) along ``dim`` of the
    whole tensor must hold: codes and block scales cut on their block, one-per-dim scales
    (per tensor; per row along the columns) whole."""
    if field.dim() != len(whole) or field.shape[dim] == 1 and whole[dim] != 1:
        return field
    n = field.shape[dim]
    b = -(-whole[dim] // n)  # elements per field entry along dim: 1, 2 (packed), the block
    return field.narrow(dim, start // b, -(-stop // b) - start // b)


def _compare(got: dict, ref: dict, what: str) -> list[str]:
    from tests._bits import bits

    wrong = []
    for name, p in ref["params"].items():
        mine = got["params"][name]["fields"]
        spec = got["specs"].get(name)
        for f, v in p["fields"].items():
            want = v if spec is None or f in WHOLE_FIELDS else _slice(v, p["shape"], *spec)
            if mine[f].shape != want.shape or not torch.equal(bits(mine[f]), bits(want)):
                wrong.append(f"{what}: {name}.{f}")
    return wrong


def _ok(outs):
    bad = [o for o in outs if not o.ok]
    assert not bad, "\n".join(f"rank {o.rank}: {o.error}\n{o.traceback}" for o in bad)
    return [o.value for o in outs]


LAYOUTS = (("EP2", 2, 2, 1), ("TP2", 2, 1, 2), ("DP2xEP2", 4, 2, 1))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_sharded_load_equals_the_slices_of_a_one_rank_load(layout, sources, reference):
    what, world, ep, tp = layout
    _ok(shared_world(world).run(sc_build, ep, tp, sources, deadline_s=480))
    values = _ok(shared_world(world).run(sc_sharded, ep, tp, sources, deadline_s=240))
    wrong = []
    for v in values:
        for key, ref in reference.items():
            got = v["loads"][key]
            wrong += _compare(got, ref, f"{what} rank ep{v['ep_rank']}/tp{v['tp_rank']} {key}")
            # every sharded destination whose scale spans the split was reduced, once each,
            # in the same order on every rank (compared across ranks below)
            assert len(set(got["reduced"])) == len(got["reduced"])
    assert not wrong, f"{len(wrong)} fields differ, first: {wrong[:5]}"
    for key in reference:
        orders = {tuple(v["loads"][key]["reduced"]) for v in values}
        assert len(orders) == 1, (what, key, orders)
        n = len(next(iter(orders)))
        fid = key[1]
        # per-tensor fp8, fp8_delayed and nvfp4: every sharded quantized tensor (4 experts or
        # 8 TP linears over 2 layers); fp8 per channel only the row-parallel o_proj; blocks never
        per_tensor = 4 if ep > 1 else 8
        want = {"fp8": per_tensor, "nvfp4": per_tensor, "fp8_delayed": per_tensor}
        want["fp8-channel"] = 0 if ep > 1 else 2
        copied = key == ("blockwise_fp8", "fp8_block")
        assert n == (0 if copied else want.get(fid, 0)), (what, key, n)
    # what each rank read of the HF dir: the replicated tensors whole, and of a tensor split
    # along its rows (experts, column-parallel) only its rows; a row-parallel block (columns)
    # may be read as whole rows (the fast reader reads rows), never more than the tensor
    one = reference[("hf", "fp8")]["bytes_read"]
    sharded = _sharded_bytes(reference[("hf", "fp8")], values[0]["loads"][("hf", "fp8")])
    cols = _sharded_bytes(reference[("hf", "fp8")], values[0]["loads"][("hf", "fp8")], dim=1)
    for v in values:
        got = v["loads"][("hf", "fp8")]
        least = one - sharded // 2
        assert least <= got["bytes_read"] <= least + cols // 2, (what, got["bytes_read"], one)
        assert got["param_bytes"] < reference[("hf", "fp8")]["param_bytes"]
        if ep > 1:
            e0 = 4 * v["ep_rank"]
            assert got["holds"]["experts"] == [e0, e0 + 4, 8] and "tp" not in got["holds"]
        else:
            assert got["holds"]["tp"] == 2 and got["holds"]["tp_rank"] == v["tp_rank"]


def _sharded_bytes(ref: dict, got: dict, dim: int | None = None) -> int:
    """BF16 bytes of the whole tensors a rank holds one half of (split along ``dim``)."""
    total = 0
    for name, spec in got["specs"].items():
        if dim is not None and spec[0] != dim:
            continue
        total += 2 * torch.Size(ref["params"][name]["shape"]).numel()
    return total


def sc_pipeline(rank, world, ep, tp, recipe):
    """``qckpt load``'s body (what the CLI calls between its world and its report)."""
    from qckpt.parallel.mesh import init_mesh
    from qckpt.pipeline.load import load
    from qckpt.recipe import recipe_from_dict

    mesh = init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu")
    return load(recipe_from_dict(recipe), mesh).to_dict("r.yaml", recipe["load"]["params"])


def _recipe(path: str, params: str, ep: int = 1, tp: int = 1) -> dict:
    return {
        "model": {"source": SOURCE},
        "checkpoint": {"path": path},
        "load": {"params": params, "device": "cpu"},
        "parallel": {"ep": ep, "tp": tp, "timeout_s": 10},
    }


def test_the_load_report_is_per_rank_and_says_what_each_rank_holds(sources, reference):
    from rich.console import Console

    from qckpt.report import render_load_report

    one = reference[("hf", "fp8")]
    outs = _ok(
        shared_world(2).run(sc_pipeline, 2, 1, _recipe(sources["hf"], "fp8", ep=2), deadline_s=240)
    )
    # every rank gathers every rank's row; rank 0 writes --json and renders the table
    assert outs[0]["runs"][0]["ranks"] == outs[1]["runs"][0]["ranks"]
    rows = outs[0]["runs"][0]["ranks"]
    assert [r["rank"] for r in rows] == [0, 1] and [r["ep_rank"] for r in rows] == [0, 1]
    assert [r["holds"]["experts"] for r in rows] == [[0, 4, 8], [4, 8, 8]]
    for r in rows:
        # half the experts read and held: less than the one-rank load, the same on both ranks
        assert r["bytes_read"] < one["bytes_read"] and r["param_bytes"] < one["param_bytes"]
        assert r["whole_amax_reduced"] == 4  # 2 fused expert tensors x 2 layers
    assert rows[0]["bytes_read"] == rows[1]["bytes_read"]
    console = Console(record=True, width=200)
    render_load_report(outs[0], console)
    text = console.export_text()
    assert "rank 0 of 2" in text and "experts 0-3 of 8" in text and "experts 4-7 of 8" in text


def test_a_tp_split_inside_a_scale_block_is_refused_before_reading(sources):
    """fp8_block's 128x128 tiles: TP2 splits k_proj's 32 rows at 16, inside one tile."""
    outs = shared_world(2).run(
        sc_pipeline, 1, 2, _recipe(sources["dcp"], "fp8_block", tp=2), deadline_s=240
    )
    for o in outs:
        assert o.error_type == "UsageError", o.error
        assert o.error.startswith(
            "UsageError: model.layers.0.self_attn.q_proj.weight: parallel.tp=2 splits dim 0 "
            "(size 64) at ["
        ), o.error
        assert "inside a 128-element fp8_block scale block" in o.error and "\n" not in o.error


def sc_nan(rank, world, path):
    from qckpt.load.loader import load_checkpoint
    from qckpt.parallel.mesh import init_mesh

    mesh = init_mesh(ep=2, timeout_s=10, device="cpu")
    m = _build(mesh, "nvfp4", {})
    t0 = time.monotonic()
    try:
        load_checkpoint(m, path, mesh=mesh)
    except Exception as exc:  # noqa: BLE001 - what the rank raised, and when
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def test_nan_in_one_ranks_block_fails_every_rank_at_once(tmp_path):
    """Expert 6 (EP rank 1's block) holds a NaN: both ranks stop at that tensor's reduction
    with a line naming it, rank 0 does not wait for a collective rank 1 never joins."""
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    sd = build_model(SOURCE, seed=3).state_dict()
    sd["model.layers.1.mlp.experts.down_proj"][6, 3, 5] = float("nan")
    save_model_dcp(sd, tmp_path / "nan")
    outs = shared_world(2).run(sc_nan, str(tmp_path / "nan"), deadline_s=240)
    for kind, msg, seconds in _ok(outs):
        assert kind == "CheckpointError", msg
        assert msg.startswith(
            "model.layers.1.mlp.experts.down_proj: the checkpoint's value is NaN or Inf"
        ), msg
        assert seconds < 10, seconds  # no group timeout (10 s) waited out


def _die_at_first_reduction(rank, world, path):
    """Rank 1 dies at its first whole-tensor amax reduction; rank 0 must not hang there."""
    import os

    from qckpt.load.loader import load_checkpoint
    from qckpt.load.shard_scales import WholeScales
    from qckpt.parallel.mesh import init_mesh

    mesh = init_mesh(ep=2, timeout_s=10, device="cpu")
    m = _build(mesh, "fp8", {})
    if rank == 1:
        WholeScales.__call__ = lambda *a: os._exit(3)
    t0 = time.monotonic()
    try:
        load_checkpoint(m, path, mesh=mesh)
    finally:
        print(f"rank {rank} left the load after {time.monotonic() - t0:.1f} s", flush=True)


def test_a_dead_peer_fails_the_load_within_the_timeout(sources):
    """The last test here: it kills rank 1 of the shared world (a later test gets a new one)."""
    t0 = time.monotonic()
    outs = shared_world(2).run(_die_at_first_reduction, sources["hf"], deadline_s=120)
    assert outs[1].error_type == "Died" and outs[1].error == "died with exit code 3"
    o = outs[0]
    assert not o.ok and o.error_type in ("PeerError", "CheckpointError"), o.error
    assert "whole-tensor amax of model.layers.0.mlp.experts.gate_up_proj" in o.error, o.error
    assert "a rank died or timed out" in o.error and "\n" not in o.error
    assert o.seconds < 15, o.seconds  # the group timeout is 10 s; a hang would be 120
    assert time.monotonic() - t0 < 120
