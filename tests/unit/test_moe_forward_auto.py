"""calibrate.moe_forward: auto, the default: the grouped experts forward wherever it gives the
eager forward's bits, eager otherwise (and the report says why).

Eager is the reference: for every algorithm and every MoE family qckpt calibrates (Qwen3-MoE,
Mixtral, DeepSeek-V3 with its shared experts and dense first layer), auto must run grouped and
give eager's amaxes and eager's GPTQ / AWQ weights bit for bit (the GPTQ weights are a function
of the Hessians, the AWQ ones of the searched statistics). gpt-oss's experts (biases, transposed)
are refused by the instrumentation whatever the forward.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from qckpt.calib import moe_forward
from qckpt.calib.algorithms import Awq, Gptq, Mse
from qckpt.calib.calibrate import calibrate_model
from qckpt.calib.instrument import insert_quantizers, instrumentation, remove_quantizers, settle
from qckpt.convert.dcp import save_model_dcp
from qckpt.errors import CalibrationError
from qckpt.formats.tensor import dequantized_compute
from qckpt.models.build import build_model
from qckpt.models.quantize_params import quantize_model_params
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.calibrate import calibrate
from qckpt.pipeline.export import export
from qckpt.recipe import QuantConfig, load_recipe, recipe_from_dict
from tests.conftest import ROOT

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
ALGORITHMS = {
    "max": lambda: "max",
    "mse": Mse,
    "gptq": Gptq,
    "awq": lambda: Awq(grid=4),  # a coarse grid: the same search, fewer points
}
# static per-tensor FP8 inputs (what mse's histograms and awq's input term read), FP8 weights
QUANT = {
    "weights": {"format": "fp8", "granularity": "channel"},
    "inputs": {"format": "fp8", "granularity": "tensor"},
    "ignore": ["lm_head", "*.mlp.gate", "*.block_sparse_moe.gate"],
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A local HF dir per family (tiny-moe is Qwen3-MoE, built in)."""
    from transformers import DeepseekV3Config, MixtralConfig

    d = tmp_path_factory.mktemp("families")
    MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    ).save_pretrained(str(d / "mixtral"))  # fmt: skip
    DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False,
    ).save_pretrained(str(d / "deepseek_v3"))  # fmt: skip
    return {
        "qwen3_moe": "tiny-moe",
        "mixtral": str(d / "mixtral"),
        "deepseek_v3": str(d / "deepseek_v3"),
    }


def _batches(n=2, seq=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, seq), generator=g) for _ in range(n)]


def _run(model_fn, algorithm, mode: str, batches=None):
    quant = recipe_from_dict({"quant": QUANT}).quant
    state, report = calibrate_model(
        model_fn(), batches or _batches(), quant, Mesh(), moe_forward=mode, algorithm=algorithm()
    )
    return state, report


def _same(a: dict, b: dict) -> list[str]:
    """The keys whose tensors differ (or that only one side has)."""
    keys = set(a) | set(b)
    return sorted(k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_runs_grouped_and_gives_eagers_amaxes_and_weights(sources, family, algo):
    def model():
        return build_model(sources[family], dtype="bfloat16", seed=0)

    ref, ref_rep = _run(model, ALGORITHMS[algo], "eager")
    got, rep = _run(model, ALGORITHMS[algo], "auto")
    assert rep["moe_forward"]["asked"] == "auto"
    assert rep["moe_forward"]["used"] == "grouped", rep["moe_forward"]
    assert ref_rep["moe_forward"]["used"] == "eager"
    assert len(ref.amax) > 100
    assert not _same(ref.amax, got.amax)
    if algo in ("gptq", "awq"):  # the weights the sidecar gets: expert ones among them
        assert any(".experts." in k for k in ref.weights)
        assert not _same(ref.weights, got.weights)


def _odd_moe():
    """float32, an intermediate size of 100 and top-3 routing on an odd token count: the CPU
    silu's vector / scalar split and its two threads' split of the elements fall inside rows,
    where one activation call over every expert's rows differs from eager's per-expert calls
    in a few values (seen here: 2 of 99,900 down_proj inputs, which the amaxes hide and the
    Hessians do not)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=100,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _tapped_rows(model: nn.Module, mode: str, batch: torch.Tensor) -> dict[tuple, torch.Tensor]:
    """Every expert's gate/up and down_proj input rows as the algorithms' taps see them (the
    rows GPTQ's Hessians, AWQ's statistics and mse's histograms are made of), in their order."""
    insert_quantizers(model, QuantConfig(), moe_forward=mode)
    rows: dict[tuple, list[torch.Tensor]] = {}
    try:
        for name, mod in model.named_modules():
            obs = getattr(getattr(mod, "forward", None), "observer", None)
            for side, seg in () if obs is None else (("gate_up", obs.gate_up), ("down", obs.down)):

                def tap(x, ids, name=name, side=side):
                    for e in ids.unique_consecutive().tolist():
                        rows.setdefault((name, side, e), []).append(x[ids == e].clone())

                seg.tap = tap
        with torch.no_grad():
            model(input_ids=batch, use_cache=False)
        assert instrumentation(model).moe.used == ("eager" if mode == "eager" else "grouped")
    finally:
        remove_quantizers(model)
    return {k: torch.cat(v) for k, v in rows.items()}


def test_the_rows_the_algorithms_see_are_eagers_where_one_activation_call_would_not_be():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = _odd_moe()
        batch = torch.randint(0, 256, (1, 333), generator=torch.Generator().manual_seed(1))
        ref = _tapped_rows(model, "eager", batch)
        assert sum(k[1] == "down" for k in ref) == 16  # 2 layers x 8 experts, all routed to
        for mode in ("grouped", "auto"):
            got = _tapped_rows(model, mode, batch)
            assert sorted(got) == sorted(ref)
            bad = [
                k
                for k in ref
                if not torch.equal(ref[k].view(torch.int32), got[k].view(torch.int32))
            ]
            assert not bad, (mode, bad[:3])
        got, rep = _run(_odd_moe, Gptq, "auto", [batch])
        ref, _ = _run(_odd_moe, Gptq, "eager", [batch])
        assert rep["moe_forward"]["used"] == "grouped"
        assert not _same(ref.weights, got.weights)
    finally:
        torch.set_num_threads(threads)


class _LengthDependent(nn.Module):
    """An activation whose last bit depends on how many rows one call gets: what a kernel that
    rounds by the tensor's length does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.silu(x)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.shape[0] > 40 else y


def test_auto_takes_eager_where_grouped_differs_and_says_why(monkeypatch):
    # the CPU's grouped activation made one call over all rows, as CUDA's is
    monkeypatch.setattr(moe_forward, "ELEMENTWISE_ALIKE", {"cuda", "cpu"})
    moe_forward.forget_verdicts()

    def model():
        m = build_model("tiny-moe", dtype="bfloat16", seed=0)
        for layer in m.model.layers:
            layer.mlp.experts.act_fn = _LengthDependent()
        return m

    batches = _batches(seq=48)  # 2 x 48 tokens x top-2: 192 rows in one call, < 40 an expert
    ref, _ = _run(model, ALGORITHMS["max"], "eager", batches)
    bad, _ = _run(model, ALGORITHMS["max"], "grouped", batches)
    assert _same(ref.amax, bad.amax)  # the check has something to catch
    got, rep = _run(model, ALGORITHMS["max"], "auto", batches)
    assert rep["moe_forward"]["used"] == "eager"
    assert rep["moe_forward"]["why"].startswith("the grouped forward's down_proj inputs differ")
    assert rep["moe_forward"]["check_seconds"] > 0
    assert not _same(ref.amax, got.amax)
    # the verdict is the process's: a second calibration takes it without checking again
    _, again = _run(model, ALGORITHMS["max"], "auto", batches)
    assert again["moe_forward"]["used"] == "eager"
    assert again["moe_forward"]["check_seconds"] == 0
    moe_forward.forget_verdicts()


def test_auto_takes_eager_for_experts_held_quantized():
    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    assert quantize_model_params(model, "fp8", ignore=["lm_head", "*.mlp.gate"])
    insert_quantizers(model, QuantConfig(), moe_forward="auto")
    try:
        choice = instrumentation(model).moe
        assert (choice.used, choice.why) == ("eager", moe_forward.QUANTIZED_WHY)
        with torch.no_grad(), dequantized_compute():
            model(input_ids=_batches(1)[0], use_cache=False)  # grouped would raise here
        settle(model)
    finally:
        remove_quantizers(model)
    insert_quantizers(model, QuantConfig(), moe_forward="grouped")
    try:
        with pytest.raises(CalibrationError, match="grouped needs the experts in the model's"):
            with torch.no_grad(), dequantized_compute():
                model(input_ids=_batches(1)[0], use_cache=False)
    finally:
        remove_quantizers(model)


def test_a_dense_model_reports_no_experts_forward():
    _, rep = calibrate_model(build_model("tiny-dense"), _batches(1), QuantConfig(), Mesh())
    assert rep["moe_forward"] == {
        "asked": "auto", "used": None, "why": "no fused experts", "check_seconds": 0.0,
        "first_call_seconds": None,
    }  # fmt: skip


def _files(d) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_the_default_recipe_writes_eagers_calibration_sidecar_and_export_bytes(tmp_path):
    save_model_dcp(build_model("tiny-moe", seed=0), tmp_path / "dcp")
    out = {}
    for mode in ("eager", None):  # None: the recipe's default
        d = tmp_path / (mode or "default")
        sets = [
            f"checkpoint.path={tmp_path / 'dcp'}",
            "calibrate.algorithm=gptq",
            f"calibrate.output={d / 'calib' / 'calib.safetensors'}",
            f"export.output={d / 'out'}",
        ] + ([f"calibrate.moe_forward={mode}"] if mode else [])
        r = load_recipe(str(ROOT / "configs" / "tiny-moe.yaml"), sets)
        assert r.calibrate.moe_forward == (mode or "auto")
        res = calibrate(r, Mesh())
        assert res.report["moe_forward"]["used"] == ("eager" if mode else "grouped")
        export(r, None)
        out[mode] = (_files(d / "calib"), _files(d / "out"))
    (ref_cal, ref_out), (cal, exp) = out["eager"], out[None]
    assert any(k.startswith("calib.safetensors.gptq") for k in ref_cal)
    assert cal == ref_cal
    assert exp == ref_out
    side = load_file(str(d / "calib" / "calib.safetensors.gptq" / "ep000.safetensors"))
    assert any(".experts." in k for k in side)
