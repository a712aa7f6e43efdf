"""``calibrate.offload: layer | host`` over real gloo ranks: the calibration file is the resident
run's, byte for byte, on DP2 and EP2 (each rank streams only its own experts), and a rank whose
read fails makes every rank fail within the timeout instead of hanging."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from qckpt.calib.state_file import calibration_differences
from tests.dist.harness import shared_world

# generous: on a shared 2-core machine the first world start alone has taken 150 s; the
# harness deadlines (below) and the 10 s group timeouts are what catch a hang
pytestmark = pytest.mark.timeout(600)
DATA = {"source": "synthetic", "num_samples": 8, "seq_len": 16, "batch_size": 2}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """tiny-moe as an HF dir (per-expert tensors: the EP read path), tiny-dense as DCP."""
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("offload")
    build_model("tiny-moe", seed=3).save_pretrained(root / "moe")
    save_model_dcp(build_model("tiny-dense", seed=4), root / "dense")
    return {"tiny-moe": str(root / "moe"), "tiny-dense": str(root / "dense")}


def _recipe(src: str, ckpt: str, offload: str, out: str, ignore=("*.mlp.gate",), **cal):
    from qckpt.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "model": {"source": src},
            "checkpoint": {"path": ckpt},
            "quant": {"ignore": list(ignore)},
            "calibrate": {"data": DATA, "offload": offload, "output": out, **cal},
            "parallel": {"timeout_s": 10},
        }
    )


def _calibrate_runs(rank, world, src, ckpt, ep, runs, out_dir, tp=1):
    """Every (name, offload, extra calibrate keys) of ``runs`` on this world with ``ep`` EP
    ranks; rank 0 writes ``out_dir/name.safetensors``; returns each run's offload report."""
    from qckpt.models.build import build_model
    from qckpt.parallel.mesh import init_mesh
    from qckpt.pipeline.calibrate import calibrate

    # transformers' model code imported before the first collective: on shared CPUs the
    # import alone can take longer than the group timeout
    build_model(src, device="meta")
    mesh = init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu")
    reports = {}
    for name, offload, cal in runs:
        r = _recipe(src, ckpt, offload, f"{out_dir}/{name}.safetensors", **cal)
        reports[name] = calibrate(r, mesh).report.get("offload")
    return reports


RUNS = [
    ("resident", "none", {}),
    ("layer", "layer", {}),
    ("host", "host", {"activations": "host"}),
]


@pytest.mark.parametrize(
    ("src", "ep", "tp"), [("tiny-moe", 1, 1), ("tiny-moe", 2, 1), ("tiny-dense", 1, 2)]
)
def test_two_ranks_write_the_resident_file(ckpts, tmp_path, src, ep, tp):
    """DP2 and EP2 on tiny-moe, TP2 on tiny-dense: offload layer and host (activations in
    host memory) write the file the resident run of the same layout writes."""
    out = shared_world(2).run(
        _calibrate_runs, src, ckpts[src], ep, RUNS, str(tmp_path), tp, deadline_s=400
    )
    assert all(o.ok for o in out), [o.error for o in out]
    ref = tmp_path / "resident.safetensors"
    for name in ("layer", "host"):
        assert calibration_differences(ref, tmp_path / f"{name}.safetensors") == [], name
    for o in out:
        rep = o.value["layer"]
        assert rep["mode"] == "layer" and rep["weights_on"] == "disk"
        assert rep["layers"] == 2 and rep["bytes_read"] > 0
        # the activations kept: this rank's samples (8 split over DP x EP) x 16 tokens x 64
        # hidden, bf16 (TP ranks see the same samples)
        assert rep["activation_bytes"] == 8 // (2 // tp) * 16 * 64 * 2
        assert o.value["host"]["mode"] == "host"
        assert o.value["host"]["host_weight_bytes"] > 0


@pytest.mark.parametrize("src", ["tiny-moe", "tiny-dense"])
def test_one_rank_layer_and_host_write_the_resident_file(ckpts, tmp_path, src):
    """One process; lm_head quantized (its input amax comes after the final norm) and the
    KV-cache output quantizers on: every quantizer of the resident run, the same bits."""
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.calibrate import calibrate

    files, reports = {}, {}
    for name, offload in (("resident", "none"), ("layer", "layer"), ("host", "host")):
        files[name] = tmp_path / f"{name}.safetensors"
        r = _recipe(src, ckpts[src], offload, str(files[name]), ignore=["*.mlp.gate"])
        r.quant.kv_cache = True
        res = calibrate(r, Mesh())
        reports[name] = res.report.get("offload")
        assert "lm_head.input_amax" in res.state.amax
        assert "model.layers.1.self_attn.v_proj.output_amax" in res.state.amax
    for name in ("layer", "host"):
        assert calibration_differences(files["resident"], files[name]) == [], name
    rep = reports["layer"]
    assert reports["resident"] is None
    assert rep["layers"] == 2 and rep["activations_on"] == "cpu"
    assert rep["activation_bytes"] == 8 * 16 * 64 * 2  # 8 samples x 16 tokens x hidden 64, bf16
    # one layer at a time, plus the next one read ahead: never more than two (whether the
    # read-ahead overlaps the current layer depends on the machine's load, so at least one)
    assert rep["layer_weight_bytes_max"] <= rep["layer_weight_bytes_peak"]
    assert rep["layer_weight_bytes_peak"] <= 2 * rep["layer_weight_bytes_max"]
    # lm_head is quantized, so it is on the device beside the embeddings: 2 x 256 x 64 bf16
    assert rep["outer_weight_bytes"] >= 2 * 256 * 64 * 2
    assert rep["bytes_read"] > 0 and rep["reads"] == 3  # outer modules + 2 layers
    # offload: host holds every decoder layer (two of the same size) in host memory
    assert reports["host"]["host_weight_bytes"] == 2 * rep["layer_weight_bytes_max"]


def test_a_missing_tensor_is_refused_before_any_layer_runs(tmp_path):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.errors import CheckpointError
    from qckpt.models.build import build_model
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.calibrate import calibrate

    sd = build_model("tiny-dense", seed=1).state_dict()
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_model_dcp(sd, tmp_path / "ckpt")
    out = tmp_path / "calib.safetensors"
    r = _recipe("tiny-dense", str(tmp_path / "ckpt"), "layer", str(out))
    with pytest.raises(
        CheckpointError, match=r"^model\.layers\.1\.mlp\.down_proj\.weight: missing"
    ):
        calibrate(r, Mesh())
    assert not out.exists()


def _read_fails_on_rank1(rank, world, ckpt, out):
    """DP2, offload layer; rank 1's read of layer 1 fails (on the prefetch thread)."""
    from qckpt.errors import CheckpointError
    from qckpt.load import layer_weights

    real = layer_weights.CheckpointLayers.fetch

    def fetch(self, modules):
        if rank == 1 and any(n == "model.layers.1" for n, _ in modules):
            raise CheckpointError("model.layers.1: injected read failure")
        return real(self, modules)

    layer_weights.CheckpointLayers.fetch = fetch
    try:
        return _calibrate_runs(rank, world, "tiny-moe", ckpt, 1, [("off", "layer", {})], out)
    finally:
        layer_weights.CheckpointLayers.fetch = real


def test_a_read_failing_on_one_rank_fails_every_rank(ckpts, tmp_path):
    """The failing rank still reaches the amax sync and tells the other, which raises too
    (no rank waits for a peer that left); no file is written."""
    out = shared_world(2).run(
        _read_fails_on_rank1, ckpts["tiny-moe"], str(tmp_path), deadline_s=400
    )
    assert not out[1].ok and "injected read failure" in out[1].error, out[1].error
    assert not out[0].ok and "rank 1 of 2 failed before the sync" in out[0].error, out[0].error
    assert "\n" not in out[0].error
    assert not (tmp_path / "off.safetensors").exists()


@pytest.mark.parametrize("ep", [1, 2])
def test_gptq_with_offload_writes_the_resident_files_on_dp2_and_ep2(ckpts, tmp_path, ep):
    """calibrate.algorithm gptq with offload layer and host: every rank walks the layers in
    the same order (EP's exchanges and the Hessians' all-reduces meet), and the calibration
    file and each EP rank's sidecar of GPTQ'd weights are the resident run's, byte for byte."""
    gptq = {"algorithm": "gptq"}
    runs = [(name, off, {**cal, **gptq}) for name, off, cal in RUNS]
    src = "tiny-moe"
    out = shared_world(2).run(
        _calibrate_runs, src, ckpts[src], ep, runs, str(tmp_path), 1, deadline_s=400
    )
    assert all(o.ok for o in out), [o.error for o in out]
    ref = tmp_path / "resident.safetensors"
    sidecars = [f"ep{r:03d}.safetensors" for r in range(ep)]
    for name in ("layer", "host"):
        assert calibration_differences(ref, tmp_path / f"{name}.safetensors") == [], name
        for f in sidecars:  # offload's streamed file is in layer order, so tensor by tensor
            a = load_file(str(tmp_path / "resident.safetensors.gptq" / f))
            b = load_file(str(tmp_path / f"{name}.safetensors.gptq" / f))
            assert a.keys() == b.keys() and a, (name, f)
            assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert all(o.value["layer"]["layers"] == 2 for o in out)
