"""``qckpt plan`` sized from config.json (torch-free) equals the plan made on the meta model.

The meta path (the model built by transformers on the meta device, sharded by the commands' own
sharders) is the reference: for each model family qckpt builds and each EP x TP split, the
torch-free spec holds the same tensors (names, shapes, dtypes, quantized or not, the same
ShardSpec), and for every recipe in configs/ under 1 rank, DP2, EP2, TP2 and DP2 x EP2 the
whole ``--json`` report is the same, byte figure for byte figure, refusals word for word.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qckpt.errors import UsageError
from qckpt.recipe import load_recipe
from tests.conftest import ROOT

_TINY = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4,
}  # fmt: skip
# model families x the config features that change shapes; several give only the required keys
# (the config class's defaults decide the rest, as transformers' do)
FAMILIES = {
    "llama": {"model_type": "llama", "num_key_value_heads": 2},
    "llama-tied-biased": {
        "model_type": "llama", "tie_word_embeddings": True, "attention_bias": True,
        "mlp_bias": True, "head_dim": 32,
    },
    "mistral": {"model_type": "mistral"},
    "qwen2": {"model_type": "qwen2", "num_key_value_heads": 2},
    "qwen3": {"model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 16},
    "qwen3-defaults": {"model_type": "qwen3"},
    "qwen2-defaults": {"model_type": "qwen2", "num_attention_heads": 32},
    "mixtral-defaults": {"model_type": "mixtral", "num_attention_heads": 8},
    "qwen3_moe": {
        "model_type": "qwen3_moe", "num_key_value_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "qwen3_moe-mixed-layers": {
        "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4,
        "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3],
    },
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "tie_word_embeddings": True},
    "deepseek_v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 3, "moe_intermediate_size": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2,
        "topk_group": 1, "num_key_value_heads": 4,
    },
    "deepseek_v3-no-q-lora": {
        "model_type": "deepseek_v3", "num_hidden_layers": 2, "moe_intermediate_size": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
        "num_key_value_heads": 4,
    },
}  # fmt: skip
SPLITS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 3)]


def _model_dir(root: Path, name: str) -> str:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**_TINY, **FAMILIES[name]}))
    return str(d)


def _both(source: str, world: int = 4):
    from qckpt.pipeline.plan_meta import MetaWhole
    from qckpt.plan.spec import model_spec
    from qckpt.plan.whole import SpecWhole

    spec, why = model_spec(source, "bfloat16")
    assert spec is not None, why
    return SpecWhole(spec), MetaWhole(source, "bfloat16", world)


def _as_rows(held) -> list[tuple]:
    return sorted(
        (t.name, t.shape, t.dtype.itemsize, t.fmt, t.shard, t.persistent, t.aliases, t.layer)
        for t in held
    )


def _split(whole, ep: int, tp: int):
    try:
        return whole.sharded(ep, tp), None
    except UsageError as exc:
        return None, str(exc)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_spec_holds_what_the_meta_build_holds(tmp_path, family):
    spec, meta = _both(_model_dir(tmp_path, family))
    assert spec.model_type == meta.model_type and spec.itemsize == meta.itemsize
    assert spec.summary() == meta.summary()
    assert spec.linears() == meta.linears()
    assert sorted(spec.hf_value_sizes()) == sorted(meta.hf_value_sizes())
    assert {k: tuple(v) for k, v in meta.expected().items()} == spec.expected()
    assert spec.tp_linears() == meta.tp_linears()
    assert spec.output_embedding == meta.output_embedding
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                "vocab_size"):  # fmt: skip
        assert (spec.attr(key) or 0) == (meta.attr(key) or 0), key  # each use takes `or`
    names = {t.name: t for t in meta.held(meta.model, "none", ())}
    for t in spec.held({}, "none", ()):  # dtypes by name: torch's and the spec's
        assert str(names[t.name].dtype) == f"torch.{t.dtype.name}", t.name
    for ep, tp in SPLITS:
        (a, why_a), (b, why_b) = _split(spec, ep, tp), _split(meta, ep, tp)
        assert why_a == why_b, (ep, tp)
        if why_a is not None:
            continue
        for params, ignore in (("none", ()), ("fp8_block", ("lm_head", "*.mlp.gate"))):
            got, want = spec.held(a, params, ignore), meta.held(b, params, ignore)
            assert _as_rows(got) == _as_rows(want), (ep, tp, params)


def _recipes() -> list[str]:
    out = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))
    return out + sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("models/*/*.yaml")
    )


# (processes, --layout specs) each plan is made for; the recipe's own layout is ep=1, tp=1
WORLDS = {
    "1 rank": (1, []),
    "DP2": (2, []),
    "EP2": (2, ["ep=2"]),
    "TP2": (2, ["tp=2"]),
    "DP2xEP2": (4, ["ep=2"]),
}


def _report(path: str, world: str, meta: bool, monkeypatch) -> dict | str:
    from qckpt.pipeline.plan import plan
    from qckpt.plan import spec as spec_module
    from qckpt.plan.layouts import parse_layout, recipe_layout

    r = load_recipe(ROOT / path, ["checkpoint.path=none"])
    nproc, specs = WORLDS[world]
    base = recipe_layout(r)
    with monkeypatch.context() as mp:
        if meta:
            mp.setattr(spec_module, "model_spec", lambda *_a: (None, "the reference"))
        try:
            res = plan(
                r, recipe_path=path, nproc_per_node=nproc, device_bytes=80 << 30,
                host_bytes=1 << 40, layouts=[parse_layout(s, base) for s in specs],
            )  # fmt: skip
        except UsageError as exc:
            return str(exc)
    d = res.to_dict()
    assert d["model"].pop("sized_by") == ("meta model" if meta else "config.json")
    assert d["model"].pop("meta_reason") == ("the reference" if meta else None)
    if meta:
        assert d["notes"].pop(1) == "sized on the meta model: the reference"
    return d


@pytest.mark.parametrize("world", sorted(WORLDS))
@pytest.mark.parametrize("recipe", _recipes())
def test_the_torch_free_plan_is_the_meta_models_plan(recipe, world, monkeypatch):
    got = _report(recipe, world, meta=False, monkeypatch=monkeypatch)
    want = _report(recipe, world, meta=True, monkeypatch=monkeypatch)
    assert got == want


def test_a_model_type_it_cannot_size_is_planned_on_the_meta_model_and_says_so(tmp_path):
    """olmoe: a MoE qckpt builds (transformers' code) but the spec does not know: the plan
    is made on the meta model, and both the report and --json say so."""
    from tests._inproc import run_main

    d = tmp_path / "olmoe"
    d.mkdir()
    cfg = {**_TINY, "model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{source: {d}}}\ncheckpoint: {{path: none}}\nload: {{params: fp8}}\n"
        "quant:\n  weights: {format: fp8, granularity: tensor}\n"
        "  inputs: {format: fp8, granularity: tensor, dynamic: false}\n"
        '  ignore: ["lm_head", "*.mlp.gate"]\n'
    )
    out = tmp_path / "plan.json"
    r = run_main("plan", str(recipe), "--nproc-per-node", "1", "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["model"]["sized_by"] == "meta model"
    assert data["model"]["meta_reason"] == "model_type 'olmoe' is not sized from config.json"
    assert "sized on the meta model: model_type 'olmoe'" in r.stdout
    assert data["model"]["parameters"] > 0 and data["commands"]["load"][0]["peak_bytes"] > 0
    # a feature the spec does not model goes the same way, with its own reason
    (d / "config.json").write_text(json.dumps({**_TINY, "model_type": "llama",
                                               "partial_rotary_factor": 0.5}))  # fmt: skip
    r = run_main("plan", str(recipe), "--nproc-per-node", "1", "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    reason = json.loads(out.read_text())["model"]["meta_reason"]
    assert reason == "a partial rotary factor is sized by the model code"
