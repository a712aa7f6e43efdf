"""qckpt search's pieces: budgets, units, the knapsack, the found recipe, the proxy's sums."""

from __future__ import annotations

import random

import pytest

from qckpt.errors import UsageError
from qckpt.search.choose import Unit, choose, parse_budget, units_of


def test_budgets_parse_and_refuse_in_one_line():
    assert parse_budget("4.5bpw").bpw == 4.5
    assert parse_budget("18GB").bytes == 18 * 10**9
    assert parse_budget("18GiB").bytes == 18 * 2**30
    assert parse_budget("1234").bytes == 1234
    for bad in ("4.5 bits", "GB", "-3bpw", "0bpw", "", None):
        with pytest.raises(UsageError) as e:
            parse_budget(bad)
        assert "\n" not in str(e.value) and "--budget" in str(e.value)


def test_units_put_fused_groups_and_an_experts_layer_together():
    mods = [
        "m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj",
        "m.layers.0.self_attn.o_proj", "m.layers.0.mlp.experts.0.gate_proj",
        "m.layers.0.mlp.experts.0.up_proj", "m.layers.0.mlp.experts.1.down_proj",
        "m.layers.1.mlp.gate_proj", "m.layers.1.mlp.up_proj", "m.layers.1.mlp.down_proj",
    ]  # fmt: skip
    got = dict(units_of(mods))
    assert got["m.layers.0.mlp.experts"] == sorted(m for m in mods if ".experts." in m)
    assert len(got["m.layers.0.self_attn#0"]) == 3
    assert got["m.layers.0.self_attn.o_proj"] == ["m.layers.0.self_attn.o_proj"]
    assert len(got["m.layers.1.mlp#1"]) == 2
    assert got["m.layers.1.mlp.down_proj"] == ["m.layers.1.mlp.down_proj"]


def _units(n: int, seed: int = 0) -> list[Unit]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        w = rnd.choice([256, 1024, 4096])
        # nvfp4-ish, fp8-ish, bf16: bytes up, error down
        cost = [w // 2 + w // 16, w + 4, 2 * w]
        e = rnd.uniform(0.1, 10.0)
        out.append(Unit(key=f"u{i:02d}", modules=[f"u{i:02d}"], weights=w,
                        cost=cost, error=[e, e * rnd.uniform(0.01, 0.2), 0.0]))  # fmt: skip
    return out


def _brute(units: list[Unit], limit: int) -> float:
    from itertools import product

    best = float("inf")
    for picks in product(range(3), repeat=len(units)):
        if sum(u.cost[c] for u, c in zip(units, picks, strict=True)) <= limit:
            best = min(best, sum(u.error[c] for u, c in zip(units, picks, strict=True)))
    return best


def test_the_choice_fits_is_monotone_and_hits_both_ends():
    units = _units(12)
    low = sum(u.cost[0] for u in units)
    high = sum(u.cost[2] for u in units)
    b = parse_budget("1bpw")
    at_low = choose(units, low, b, str)
    assert at_low.picks == [0] * len(units) and at_low.bytes == low
    at_high = choose(units, high, b, str)
    assert at_high.picks == [2] * len(units) and at_high.error == 0.0
    prev = float("inf")
    for limit in range(low, high + 1, (high - low) // 97):
        c = choose(units, limit, b, str)
        assert c.bytes <= limit
        assert c.error <= prev  # a larger budget never a larger error
        prev = c.error
    with pytest.raises(UsageError) as e:
        choose(units, low - 1, b, lambda n: f"{n} bytes")
    assert f"{low} bytes" in str(e.value) and "\n" not in str(e.value)


def test_the_choice_is_the_optimum_up_to_the_grid():
    units = _units(7, seed=3)
    b = parse_budget("1bpw")
    low = sum(u.cost[0] for u in units)
    high = sum(u.cost[2] for u in units)
    for limit in (low, low + 700, (low + high) // 2, high - 500, high):
        c = choose(units, limit, b, str)
        assert c.error >= _brute(units, limit) - 1e-12
        # optimal for a budget smaller by the grid's slack
        assert c.error <= _brute(units, limit - c.grid * len(units)) + 1e-12


def test_found_recipe_replaces_quant_and_drops_search():
    from qckpt.recipe import recipe_from_dict
    from qckpt.search.found import found_recipe, schemes_of

    raw = {
        "quant": {"weights": {"format": "fp8"}, "ignore": ["lm_head"]},
        "search": {"candidates": [{"weights": {"format": "nvfp4"}, "inputs": {"format": "none"}},
                                  {"weights": {"format": "none"}}]},
    }  # fmt: skip
    r = recipe_from_dict(raw)
    units = [
        Unit(key="m.l.0.mlp.experts", modules=["m.l.0.mlp.experts.0.down_proj"], weights=1),
        Unit(key="m.l.0.self_attn#0", modules=["m.l.0.self_attn.k_proj", "m.l.0.self_attn.q_proj",
                                               "m.l.0.self_attn.v_proj"], weights=1),
        Unit(key="m.l.0.self_attn.o_proj", modules=["m.l.0.self_attn.o_proj"], weights=1),
    ]  # fmt: skip
    found = found_recipe(raw, schemes_of(units, [0, 0, 1], r.search.candidates))
    assert "search" not in found and "weights" not in found["quant"]
    (entry,) = found["quant"]["schemes"]
    assert entry["targets"] == ["m.l.0.mlp.experts.*", "m.l.0.self_attn.k_proj",
                                "m.l.0.self_attn.q_proj", "m.l.0.self_attn.v_proj"]  # fmt: skip
    back = recipe_from_dict(found)
    assert back.search is None and back.quant.entry_index("m.l.0.self_attn.o_proj") is None
    assert back.quant.entry_index("m.l.0.mlp.experts.3.up_proj") == 0
    none = found_recipe(raw, [])
    assert none["quant"]["ignore"] == ["lm_head", "*"]


def test_the_recipe_refuses_a_search_without_candidates():
    from qckpt.errors import RecipeError
    from qckpt.recipe import recipe_from_dict

    with pytest.raises(RecipeError, match=r"^search\.candidates: name at least one"):
        recipe_from_dict({"search": {"candidates": []}})
    with pytest.raises(RecipeError, match=r"^search\.candidates\[0\]\.weights\.format"):
        recipe_from_dict({"search": {"candidates": [{"weights": {"format": "fp7"}}]}})


def test_tree_sum_is_the_sum_and_the_proxy_is_zero_for_exact_weights():
    import torch

    from qckpt.formats.scheme import scheme_of
    from qckpt.recipe import TensorQuantConfig
    from qckpt.search.sensitivity import tree_sum, weight_error

    t = torch.arange(1, 12, dtype=torch.float64).reshape(11, 1).expand(11, 3)
    assert tree_sum(t, 0).tolist() == [66.0, 66.0, 66.0]
    fp8 = scheme_of(TensorQuantConfig(format="fp8", granularity="channel"), "weight")
    w = torch.tensor([[1.0, 2.0, 448.0], [0.5, -0.25, 224.0]])  # FP8 codes times amax / 448
    assert weight_error(w, fp8, torch.ones(3, dtype=torch.float64)) == 0.0
    w2 = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    d = torch.rand(32, dtype=torch.float64)
    e = weight_error(w2, fp8, d)
    assert e > 0 and weight_error(w2, fp8, 2 * d) == pytest.approx(2 * e)
