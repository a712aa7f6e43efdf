"""Tensor parallelism on gloo ranks: TP2, DP2 x TP2 and EP2 x TP2 against one process.

Tolerances (the row-parallel all-reduce sums the partial outputs in another order than one
process's matmul, so activations differ by rounding, never by more):
* logits: bfloat16 model, max abs diff < 2e-2 (measured 5.1e-3); float32 model, < 1e-4
  (measured 2.4e-7);
* per-tensor / per-block input and output amax: relative diff < 2e-2 (bfloat16 activations;
  measured 1.2e-2 at most, tiny-moe);
* weight amax (per-tensor, per-channel, per-block): bit for bit (weights are not summed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from tests.conftest import ROOT, run_qckpt
from tests.dist.harness import run_once, shared_world

pytestmark = pytest.mark.timeout(240)

IDS = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(7))
DATA = {"source": "synthetic", "num_samples": 8, "seq_len": 16, "batch_size": 2}
CHANNEL = {
    "weights": {"format": "fp8", "granularity": "channel"},
    "inputs": {"format": "fp8", "granularity": "tensor"},
    "ignore": ["lm_head", "*.mlp.gate"],
    "kv_cache": True,
}
BLOCK = {
    "weights": {"format": "fp8", "granularity": "block", "block_size": [16, 16]},
    "inputs": {"format": "fp8", "granularity": "block", "block_size": [16]},
    "ignore": ["lm_head", "*.mlp.gate"],
}
# NVFP4: only the per-tensor global amax is static; dynamic inputs are disabled, join no sync
NVFP4 = {
    "weights": {"format": "nvfp4"},
    "inputs": {"format": "nvfp4", "dynamic": True},
    "ignore": ["lm_head", "*.mlp.gate"],
}
BF16_ATOL, F32_ATOL, AMAX_RTOL = 2e-2, 1e-4, 2e-2
# tiny-dense-bias: every split linear has a bias (column: split with the rows; row: added once)
LOGIT_SOURCES = ("tiny-dense", "tiny-moe", "tiny-dense-bias")


def _mesh(tp, world):
    from qckpt.parallel.mesh import Mesh, init_mesh

    return init_mesh(tp=tp, timeout_s=10, device="cpu") if world > 1 else Mesh()


def _biased(dtype):
    """tiny-dense with (seeded, non-zero) biases on every attention and MLP linear."""
    from transformers import AutoModelForCausalLM

    from qckpt.models.build import DTYPES, load_config

    cfg = load_config("tiny-dense")
    cfg.attention_bias = cfg.mlp_bias = True
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype]).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=g))
    return m


def _eager(m):
    if getattr(m.config, "_experts_implementation", None) is not None:
        m.config._experts_implementation = "eager"


def _model(source, dtype, mesh):
    from qckpt.models.build import build_model
    from qckpt.parallel.tensor import shard_tensor_parallel

    m = _biased(dtype) if source == "tiny-dense-bias" else build_model(source, dtype=dtype)
    _eager(m)
    return m, shard_tensor_parallel(m, mesh)


def sc_logits(rank, world, tp):
    """Logits of both tiny models in both dtypes, on this rank's rows (dp = world / tp)."""
    mesh = _mesh(tp, world)
    out = {"data_rank": mesh.data_rank, "n_data": mesh.data_parallel_size}
    for source in LOGIT_SOURCES:
        for dtype in ("bfloat16", "float32"):
            m, names = _model(source, dtype, mesh)
            with torch.no_grad():
                out[(source, dtype)] = m(IDS[mesh.data_rank :: mesh.data_parallel_size]).logits
            out[(source, "sharded")] = names
            attn = m.model.layers[0].self_attn
            out[(source, "q_rows")] = attn.q_proj.weight.shape[0]
    return out


def sc_calibrate(rank, world, tp, quant, sources=("tiny-dense", "tiny-moe"), ep=1):
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.parallel.mesh import init_mesh
    from qckpt.pipeline.model import build
    from qckpt.recipe import recipe_from_dict

    r = recipe_from_dict({"quant": quant, "calibrate": {"data": DATA}})
    mesh = init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu") if world > 1 else _mesh(1, 1)
    out = {}
    for source in sources:
        m = build(source, mesh, seeded=True, before_shard=_eager).model
        batches = calibration_batches(
            r.calibrate.data,
            vocab_size=256,
            data_rank=mesh.data_rank,
            data_world=mesh.data_parallel_size,
        )
        state, report = calibrate_model(m, batches, r.quant, mesh)
        out[source] = {
            "amax": state.amax,
            "meta": state.quantizers,
            "fingerprint": state.model_fingerprint,
            "collectives": report["sync_collectives"],
        }
    return out


def sc_load(rank, world, ep, tp, source, path):
    """Meta build, EP then TP sharding, allocate, load ``path``: each rank holds its blocks."""
    from qckpt.load.loader import load_checkpoint
    from qckpt.models.build import build_model
    from qckpt.parallel.mesh import init_mesh
    from qckpt.parallel.shard import model_shards
    from qckpt.pipeline.model import build

    mesh = init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu")
    m = build(source, mesh).model  # on meta, EP then TP, allocated for the load
    load_checkpoint(m, path, mesh=mesh)
    full = build_model(source).state_dict()
    wrong = []
    for name, t in m.state_dict().items():
        want = full[name]
        if t.shape != want.shape:  # a TP or EP block: the same slice of the whole tensor
            spec = model_shards(m)[name]
            assert spec.global_shape == tuple(want.shape)
            want = want.narrow(spec.dim, spec.start, spec.local)
        if not torch.equal(t, want):
            wrong.append(name)
    m.config._experts_implementation = "eager"
    with torch.no_grad():
        logits = m(IDS[mesh.data_rank :: mesh.data_parallel_size]).logits
    return {"wrong": wrong, "logits": logits, "data_rank": mesh.data_rank,
            "n_data": mesh.data_parallel_size}  # fmt: skip


def sc_bad_heads(rank, world):
    mesh = _mesh(4, world)  # tiny-dense: 4 heads, 2 key/value heads
    _model("tiny-dense", "bfloat16", mesh)


def _check_logits(outs, ref):
    worst = {}
    for o in outs:
        assert o.ok, o.error
        v = o.value
        for source in LOGIT_SOURCES:
            assert v[(source, "q_rows")] == 64 // 2 and len(v[(source, "sharded")]) == 2 * (
                4 if source == "tiny-moe" else 7
            )
            for dtype, tol in (("bfloat16", BF16_ATOL), ("float32", F32_ATOL)):
                mine = ref[(source, dtype)][v["data_rank"] :: v["n_data"]]
                d = float((v[(source, dtype)].float() - mine.float()).abs().max())
                worst[(source, dtype)] = max(worst.get((source, dtype), 0.0), d)
                assert d < tol, (source, dtype, d)
    return worst


def _reference_logits():
    from qckpt.parallel.mesh import Mesh

    ref = {}
    for source in LOGIT_SOURCES:
        for dtype in ("bfloat16", "float32"):
            m, _ = _model(source, dtype, Mesh())
            with torch.no_grad():
                ref[(source, dtype)] = m(IDS).logits
    return ref


@pytest.fixture(scope="module")
def ref_logits():
    return _reference_logits()


@pytest.mark.parametrize("world_size", [2, 4])  # TP2; DP2 x TP2
def test_tp_forward_close_to_single_process(world_size, ref_logits):
    outs = shared_world(world_size).run(sc_logits, 2, deadline_s=120)
    worst = _check_logits(outs, ref_logits)
    print(f"world {world_size}: max abs logit diff {worst}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """tiny-dense and tiny-moe as a DCP dir and an HF safetensors dir each."""
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    d = tmp_path_factory.mktemp("tp-ckpt")
    out = {}
    for source in ("tiny-dense", "tiny-moe"):
        m = build_model(source)
        save_model_dcp(m, d / f"{source}-dcp")
        m.save_pretrained(str(d / f"{source}-hf"))
        out[source] = (str(d / f"{source}-dcp"), str(d / f"{source}-hf"))
    return out


@pytest.mark.parametrize(
    "world_size, ep, source",
    [(2, 1, "tiny-dense"), (4, 2, "tiny-moe")],  # TP2 (dense); EP2 x TP2 (MoE)
)
def test_tp_load_reads_each_rank_block(world_size, ep, source, checkpoints, ref_logits):
    for path in checkpoints[source]:  # DCP, then HF safetensors
        outs = shared_world(world_size).run(sc_load, ep, 2, source, path, deadline_s=120)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for o in outs:
            v = o.value
            assert not v["wrong"], (path, o.rank, v["wrong"][:5])
            mine = ref_logits[(source, "bfloat16")][v["data_rank"] :: v["n_data"]]
            assert float((v["logits"].float() - mine.float()).abs().max()) < BF16_ATOL


def _compare_calibration(ref, got, what):
    """Same keys, shapes, metadata and fingerprint; weights bit for bit, activations close."""
    assert got["fingerprint"] == ref["fingerprint"], what
    assert got["meta"] == ref["meta"], what
    assert sorted(got["amax"]) == sorted(ref["amax"]), what
    worst = 0.0
    for k, a in ref["amax"].items():
        b = got["amax"][k]
        assert b.shape == a.shape and b.dtype == a.dtype, (what, k, b.shape, a.shape)
        if k.endswith(".weight_amax"):
            assert torch.equal(a, b), (what, k)
        else:
            rel = float(((b - a).abs() / a.abs().clamp(min=1e-6)).max())
            worst = max(worst, rel)
            assert rel < AMAX_RTOL, (what, k, rel)
    return worst


@pytest.mark.parametrize("world_size, ep", [(2, 1), (4, 1), (4, 2)])  # TP2; DP2xTP2; EP2xTP2
def test_tp_calibration_matches_world1(world_size, ep):
    worst = {}
    for name, quant in (("channel", CHANNEL), ("block", BLOCK), ("nvfp4", NVFP4)):
        sources = ("tiny-dense", "tiny-moe") if name == "channel" else ("tiny-dense",)
        if ep > 1:
            sources = ("tiny-moe",)
        ref = sc_calibrate(0, 1, 1, quant, sources)
        outs = shared_world(world_size).run(sc_calibrate, 2, quant, sources, ep, deadline_s=120)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for o in outs:  # every rank holds the whole-tensor result
            for source in sources:
                w = _compare_calibration(ref[source], o.value[source], (name, source, o.rank))
                worst[(name, source)] = max(worst.get((name, source), 0.0), w)
                # O(1) collectives: DP sync (2 if any) + TP sync (2) + one TP all-gather
                assert o.value[source]["collectives"] <= 5
        if name == "channel":
            # a per-channel weight amax really was gathered: [out] of the whole q_proj
            key = "model.layers.0.self_attn.q_proj.weight_amax"
            assert outs[0].value[sources[0]]["amax"][key].shape == (64,)
    print(f"world {world_size}, ep {ep}: max relative activation-amax diff {worst}")


def test_block_that_straddles_tp_shards_is_a_usage_error():
    quant = {**BLOCK, "weights": {"format": "fp8", "granularity": "block"}}  # [128, 128]
    outs = shared_world(2).run(sc_calibrate, 2, quant, ("tiny-dense",))
    for o in outs:
        assert o.error_type == "UsageError", o
        assert o.error.startswith("UsageError: parallel.tp: 2 splits model.layers.0.self_attn")
        assert "\n" not in o.error


def test_tp_that_does_not_divide_heads_is_named():
    outs = shared_world(4).run(sc_bad_heads)
    for o in outs:
        assert o.error == (
            "UsageError: parallel.tp: 4 does not divide the 4 attention heads and 2 key/value heads"
        ), o


def test_cli_tp2_writes_the_one_rank_file(tmp_path):
    recipe = str(ROOT / "configs" / "tiny-dense.yaml")
    ckpt = tmp_path / "dcp"
    sets = ["--set", f"checkpoint.path={ckpt}"]
    r = run_qckpt("convert", recipe, str(ckpt), *sets, cwd=tmp_path)
    # per-channel weights: bit-identical amaxes only if every rank read exactly its block
    sets += ["--set", "quant.weights.granularity=channel"]
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("QCKPT_DEBUG", None)
    tp2, one = tmp_path / "tp2.safetensors", tmp_path / "one.safetensors"
    cmds = [
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "qckpt", "calibrate", recipe, *sets, "--set", f"calibrate.output={tp2}"]
        + ["--set", "parallel.tp=2", "-v"],  # -v: the step lines name the TP split
        [sys.executable, "-m", "qckpt", "calibrate", recipe, *sets]
        + ["--set", f"calibrate.output={one}"],
    ]
    # the TP2 run and the one-rank run side by side (most of each is starting Python)
    procs = [
        subprocess.Popen(c, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]  # fmt: skip
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0, logs[0][-3000:]
    assert procs[1].returncode == 0, logs[1][-3000:]
    assert "14 linears split over 2 TP ranks" in logs[0]
    with safe_open(str(tp2), "pt") as a, safe_open(str(one), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert a.metadata() == b.metadata()  # quantizers, shapes, fingerprint
        for k in b.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.shape == y.shape, k
            if k.endswith(".weight_amax"):
                assert torch.equal(x, y), k  # the loaded weights are the checkpoint's
            else:
                rel = float(((x - y).abs() / y.abs().clamp(min=1e-6)).max())
                assert rel < AMAX_RTOL, (k, rel)


def sc_tp_rank_dies_in_the_gather(rank, world):
    """TP2 calibration; rank 1 dies where the TP amax all-gather starts, rank 0 times it."""
    import qckpt.calib.calibrate as cal
    from qckpt.calib.data import calibration_batches
    from qckpt.errors import SyncError
    from qckpt.parallel.mesh import init_mesh
    from qckpt.recipe import recipe_from_dict

    r = recipe_from_dict({"quant": CHANNEL, "calibrate": {"data": DATA}})
    mesh = init_mesh(tp=2, timeout_s=10, device="cpu")
    m, _ = _model("tiny-dense", "bfloat16", mesh)
    gather = cal.gather_sharded_amax

    def die(*_a, **_k):
        os._exit(17)  # gone without a word, in the middle of the collectives

    def timed(*a, **k):
        t0 = time.monotonic()
        try:
            return gather(*a, **k)
        except SyncError as e:
            raise SyncError(f"{e} [gather {time.monotonic() - t0:.1f}s]") from None

    cal.gather_sharded_amax = die if rank == 1 else timed
    batches = calibration_batches(r.calibrate.data, vocab_size=256, data_rank=0, data_world=1)
    cal.calibrate_model(m, batches, r.quant, mesh)


def test_a_rank_dead_in_the_tp_amax_gather_fails_the_other_within_the_timeout():
    out = run_once(sc_tp_rank_dies_in_the_gather, 2, timeout_s=10.0, deadline_s=120.0)
    assert out[1].exitcode == 17
    survivor = out[0]
    assert survivor.exitcode == 1, survivor  # non-zero, as a CLI run would end
    assert survivor.error_type == "SyncError", survivor.error
    assert "amax gather over the tensor-parallel group failed" in survivor.error
    assert "died or timed out" in survivor.error
    waited = float(re.search(r"\[gather ([0-9.]+)s\]", survivor.error).group(1))
    assert waited < 10.0 + 5.0, waited  # the group's timeout, not forever
