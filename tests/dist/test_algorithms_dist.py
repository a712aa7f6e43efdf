"""calibrate.algorithm under DP / EP / DP x EP (gloo): the export is the one process's, byte for
byte, on the tiny MoE with cold experts (experts 5-7 never routed to), for every algorithm
(max is the other tests'; mse, gptq, gptq with calibrate.gptq_inputs: quantized, and awq
here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.harness import shared_world

pytestmark = pytest.mark.timeout(400)
DATA = {"source": "synthetic", "num_samples": 8, "seq_len": 16, "batch_size": 2}
QUANTS = {
    # per-channel FP8 weights, static per-tensor FP8 inputs: weight clips per row, input clips
    # from the summed histograms (experts: one per layer side)
    "fp8_channel": {
        "weights": {"format": "fp8", "granularity": "channel"},
        "inputs": {"format": "fp8", "granularity": "tensor"},
    },
    # NVFP4 W4A4: global weight clip + per-16-block scales searched (again, in the export)
    "nvfp4": {"weights": {"format": "nvfp4"}, "inputs": {"format": "nvfp4"}},
    # INT4 W4A16, a scale per 32 columns (the tiny MoE's dims are 64 and 32): GPTQ makes each
    # group's scale as it reaches the group, and the export writes those
    "int4": {
        "weights": {"format": "int4", "granularity": "group", "block_size": [32]},
        "inputs": {"format": "none"},
    },
    # the same with a zero point per group (symmetric: false); the act-order case: every
    # group's scale and zero point from the weight before the sweep, columns in Hessian order
    "int4_asym": {
        "weights": {"format": "int4", "granularity": "group", "block_size": [32],
                    "symmetric": False},
        "inputs": {"format": "none"},
    },
    # INT8 W8A8 per channel with static per-tensor int8 inputs (their calibrated amax crosses
    # ranks; GPTQ's inputs quantized as vLLM's int8 kernels do)
    "int8": {
        "weights": {"format": "int8", "granularity": "channel"},
        "inputs": {"format": "int8", "granularity": "tensor"},
    },
    # MXFP4 W4A16: E8M0 exponents per 32 made from each group (GPTQ: as it reaches it)
    "mxfp4": {"weights": {"format": "mxfp4"}, "inputs": {"format": "none"}},
    # MXFP8 W8A8: the same per-32 exponents on E4M3 codes, inputs scaled per 32 at run time
    # (gptq only: on these weights an 8-bit MX grid leaves AWQ nothing to fold in some layers,
    # which the awq case's assertions require)
    "mxfp8": {"weights": {"format": "mxfp8"}, "inputs": {"format": "mxfp8", "dynamic": True}},
    # quant.schemes: NVFP4 routed experts, FP8 block q/k/v with dynamic group inputs, FP8 per
    # channel o_proj with static inputs (lm_head ignored, the router is no linear)
    "mixed": {
        "schemes": [
            {"targets": ["*.experts.*"], "weights": {"format": "nvfp4"},
             "inputs": {"format": "nvfp4"}},
            {"targets": ["*.q_proj", "*.k_proj", "*.v_proj"],
             "weights": {"format": "fp8", "granularity": "block", "block_size": [32, 32]},
             "inputs": {"format": "fp8", "granularity": "block", "block_size": [1, 32],
                        "dynamic": True}},
            {"targets": ["*.o_proj"], "weights": {"format": "fp8", "granularity": "channel"},
             "inputs": {"format": "fp8"}},
        ]
    },
}  # fmt: skip
COLD = [5, 6, 7]
# a case's name -> its calibrate options beside the algorithm
OPTIONS = {
    "gptq+qin": {"algorithm": "gptq", "gptq_inputs": "quantized"},
    "gptq+ao": {"algorithm": "gptq", "gptq_act_order": True},
}


def _recipe(quant: str, algorithm: str):
    from qckpt.recipe import recipe_from_dict

    q = {**QUANTS[quant], "ignore": ["lm_head", "*.mlp.gate"]}
    cal = OPTIONS.get(algorithm, {"algorithm": algorithm})
    return recipe_from_dict({"quant": q, "calibrate": {"data": DATA, **cal}})


def sc_calibrate(rank, world, ep, quant, algorithm, out):
    """Calibrate the seeded tiny MoE (cold experts) over this world; rank 0 writes ``out``."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.calib.state_file import save_calibration
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.calibrate import algorithm_of
    from qckpt.pipeline.model import build
    from tests.dist.test_ep_calibration import starve_experts

    r = _recipe(quant, algorithm)
    algorithm = r.calibrate.algorithm
    mesh = init_mesh(ep=ep, timeout_s=10, device="cpu") if world > 1 else Mesh()

    def starve(m):
        starve_experts(m, cold=COLD)
        if algorithm == "awq":
            _salient(m)

    model = build("tiny-moe", mesh, seeded=True, before_shard=starve).model
    batches = calibration_batches(
        r.calibrate.data,
        vocab_size=256,
        data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )
    state, report = calibrate_model(model, batches, r.quant, mesh, algorithm=algorithm_of(r))
    if algorithm in ("gptq", "awq"):  # every writer rank (first DP rank of each EP rank) writes
        from qckpt.calib.gptq_pass import write_weights

        write_weights(state, out, mesh, suffix="." + algorithm)
    if rank == 0:
        save_calibration(state, out)
    return {"layers": report["layers"], "collectives": report["sync_collectives"]}


def _salient(model) -> None:
    """A few hidden channels 16x the others after every norm (a trained model's outliers), so
    that AWQ folds into the norms (and the routers, and every expert's columns) too."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[:4] *= 16


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("algos")
    build_model("tiny-moe", dtype="bfloat16", seed=0).save_pretrained(root / "hf")
    return root / "hf"


@pytest.fixture(scope="module")
def hf_salient(tmp_path_factory) -> Path:
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("algos-salient")
    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    _salient(model)
    model.save_pretrained(root / "hf")
    return root / "hf"


def _export(hf: Path, cal: Path, out: Path, quant: str, algorithm: str) -> dict[str, bytes]:
    from qckpt.models.build import build_model
    from tests.export_fixtures import run_export

    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    run_export(model, hf, cal, out, _recipe(quant, algorithm).quant)
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def _sidecar(cal: Path, algorithm: str) -> dict[str, bytes]:
    """Every tensor of a calibration's weights sidecar (all EP ranks' files), as bytes."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, bytes] = {}
    for f in sorted(Path(f"{cal}.{algorithm}").glob("*.safetensors")):
        for k, t in load_file(str(f)).items():
            out[k] = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


def _search_rows(layers: dict, algorithm: str) -> list[dict]:
    return [row[algorithm] for row in layers.values() if algorithm in row]


def _strip(rows: list[dict]) -> list[dict]:
    # a layer's seconds, and awq's check of its fold (on this rank's first batch)
    return [{k: v for k, v in r.items() if k not in ("seconds", "fold_error")} for r in rows]


@pytest.mark.parametrize(("case", "quant"), [("mse", q) for q in ("fp8_channel", "nvfp4", "int4",
                                                                  "int8", "mxfp4")]
                         + [("gptq", "nvfp4"), ("gptq+qin", "nvfp4"), ("gptq", "int4"),
                            ("gptq+ao", "int4_asym"), ("gptq+qin", "int8"), ("gptq", "mxfp4"),
                            ("gptq+qin", "mxfp8")]
                         + [("max", "mixed"), ("gptq+qin", "mixed")]
                         + [("awq", q) for q in sorted(QUANTS) if q not in ("mxfp8",
                                                                             "int4_asym")])  # fmt: skip
def test_export_is_byte_identical_on_1_rank_dp2_ep2_dp2xep2(hf, hf_salient, tmp_path, case, quant):
    from qckpt.calib.state_file import calibration_differences

    algorithm = OPTIONS.get(case, {"algorithm": case})["algorithm"]
    hf = hf_salient if algorithm == "awq" else hf
    one = tmp_path / "one.safetensors"
    ref = sc_calibrate(0, 1, 1, quant, case, one)
    # the algorithm did something a user sees: some clip below max / a lower output error
    rows = _search_rows(ref["layers"], algorithm)
    if algorithm == "mse":  # MX: exponents searched per block, no clip
        assert rows and (quant.startswith("mx") or any(r["ratio_min"] < 1.0 for r in rows))
        assert sum(r["loss_mse"] for r in rows) < sum(r["loss_max"] for r in rows)
    elif algorithm == "max":  # a mixed recipe's calibration: the file is compared below
        assert ref["layers"]
    elif algorithm == "gptq":  # every layer: GPTQ's output error under rounding's; cold rounded
        assert len(rows) == 2 and all(r["loss_gptq"] < r["loss_rtn"] for r in rows)
        assert all(r["rounded"] == 3 * len(COLD) for r in rows)
    else:  # awq: every layer searched, never worse than max; some scales folded; cold skipped
        assert len(rows) == 2 and all(r["loss_awq"] <= r["loss_max"] for r in rows)
        assert all(r["alpha"]["input_layernorm"] and r["alpha"]["post_attention_layernorm"]
                   for r in rows)  # fmt: skip
        for r in rows:
            assert [r["alpha"][f"mlp.experts.{e}.down_proj"] for e in COLD] == [None] * len(COLD)
            assert 0 < r["fold_error"] < 0.02  # float scales: a BF16 rounding's worth
    # a mixed recipe: its calibration file and GPTQ sidecar (the layouts' own tests export)
    exported = quant != "mixed"
    ref_files = _export(hf, one, tmp_path / "x-one", quant, algorithm) if exported else None
    for n, ep in ((2, 1), (2, 2), (4, 2)):  # DP2, EP2, DP2 x EP2
        cal = tmp_path / f"w{n}ep{ep}.safetensors"
        out = shared_world(n).run(sc_calibrate, ep, quant, case, cal, deadline_s=240)
        assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
        assert calibration_differences(one, cal) == [], (n, ep)
        if exported:
            files = _export(hf, cal, tmp_path / f"x-{n}-{ep}", quant, algorithm)
            assert files == ref_files, (n, ep)
        elif algorithm == "gptq":
            assert _sidecar(cal, algorithm) == _sidecar(one, algorithm), (n, ep)
        if algorithm == "mse":  # every rank reports the same search (owners' losses, summed)
            assert all(o.value["layers"] == out[0].value["layers"] for o in out)
        elif algorithm == "awq":  # every rank picked the same scales, from the same losses
            for o in out:
                assert _strip(_search_rows(o.value["layers"], "awq")) == _strip(rows), (n, ep)
        elif ep == 1:  # gptq: each rank's own linears (DP replicas: the same ones, same loss)
            rows = [_search_rows(o.value["layers"], "gptq") for o in out]
            for r in rows:
                for row in r:
                    row.pop("seconds")
            assert rows[0] == rows[1] == _strip(_search_rows(ref["layers"], "gptq"))


def sc_dies_mid_gptq(rank, world, tmp):
    """Rank 1 dies in the middle of the GPTQ pass (the second layer's first forward)."""
    import os

    from qckpt.calib import gptq_pass

    real = gptq_pass.LayerIo.run

    def run(self, layer, hidden, calls, i):
        if rank == 1 and i == 1:
            os._exit(3)
        return real(self, layer, hidden, calls, i)

    gptq_pass.LayerIo.run = run
    return sc_calibrate(rank, world, 1, "nvfp4", "gptq", Path(tmp) / "c.safetensors")


def test_a_rank_killed_mid_gptq_ends_the_others_within_the_timeout(tmp_path):
    import time

    from tests.dist.harness import run_once

    t0 = time.monotonic()
    out = run_once(sc_dies_mid_gptq, 2, str(tmp_path), timeout_s=10, deadline_s=120)
    took = time.monotonic() - t0
    assert out[1].exitcode == 3
    assert not out[0].ok and out[0].exitcode == 1, out[0]
    assert out[0].error_type in ("SyncError", "PeerError"), out[0].error
    assert "\n" not in out[0].error and "gptq" in out[0].error, out[0].error
    assert took < 60, took


def test_mse_export_differs_from_max_and_lowers_weight_error(hf, tmp_path):
    """The export writes the searched scales: the NVFP4 export's block scales are not the max
    rule's, and dequantized weights are closer to the BF16 ones."""
    import torch
    from safetensors.torch import load_file

    from qckpt.formats.nvfp4 import e2m1_values
    from qckpt.formats.nvfp4_search import nvfp4_mse_quantize  # noqa: F401 - the function the export uses

    err = {}
    for algo in ("max", "mse"):
        cal = tmp_path / f"{algo}.safetensors"
        sc_calibrate(0, 1, 1, "nvfp4", algo, cal)
        _export(hf, cal, tmp_path / f"x-{algo}", "nvfp4", algo)
        sd = {}
        for p in (tmp_path / f"x-{algo}").glob("*.safetensors"):
            sd.update(load_file(str(p)))
        src = load_file(str(hf / "model.safetensors"))
        total = 0.0
        for k in sd:
            if not k.endswith(".weight_packed") or ".experts." in k:
                continue
            m = k[: -len(".weight_packed")]
            p = sd[k]
            codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)
            s = sd[f"{m}.weight_scale"].float() / sd[f"{m}.weight_global_scale"].float()
            dq = e2m1_values(codes).view(p.shape[0], -1, 16) * s.unsqueeze(-1)
            w = src[f"{m}.weight"].float()
            total += float(((dq.reshape(w.shape) - w) ** 2).sum())
        err[algo] = total
    assert err["mse"] < 0.95 * err["max"], err


def sc_dies_mid_awq(rank, world, tmp):
    """Rank 1 dies in the middle of the AWQ pass (the second layer's first forward)."""
    import os

    from qckpt.calib import awq_pass

    real = awq_pass.LayerRunner.run

    def run(self, batches=None):
        if rank == 1 and self.i == 1:
            os._exit(3)
        return real(self, batches)

    awq_pass.LayerRunner.run = run
    return sc_calibrate(rank, world, 1, "nvfp4", "awq", Path(tmp) / "c.safetensors")


def test_a_rank_killed_mid_awq_ends_the_others_within_the_timeout(tmp_path):
    import time

    from tests.dist.harness import run_once

    t0 = time.monotonic()
    out = run_once(sc_dies_mid_awq, 2, str(tmp_path), timeout_s=10, deadline_s=120)
    took = time.monotonic() - t0
    assert out[1].exitcode == 3
    assert not out[0].ok and out[0].exitcode == 1, out[0]
    assert out[0].error_type in ("SyncError", "PeerError"), out[0].error
    assert "\n" not in out[0].error and "awq" in out[0].error, out[0].error
    assert took < 60, took
