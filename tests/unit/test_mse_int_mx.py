"""calibrate.algorithm mse on INT4 / INT8 / MXFP4 / MXFP8 weights (no model, no processes): the
search is never worse than max on its measure, and the export's tensors, read back through
qckpt's dequantizer, have exactly the error the search reported."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib import mse
from qckpt.formats.mx_search import mx_block_search, mx_mse_quantize
from qckpt.formats.numerics import tree_sum
from qckpt.formats.scheme import make_scheme
from qckpt.layouts.ct_writers import export_layout
from qckpt.layouts.dequantize import dequantize
from qckpt.layouts.export_layout import BlockScales
from qckpt.layouts.source_layout import int8_weights, int_packed_weights, mx_weights
from qckpt.recipe import recipe_from_dict

M = "model.layers.0.mlp.down_proj"
INT_CASES = {
    "int4-g128": ({"format": "int4", "granularity": "group", "block_size": [128]}, "none"),
    "int4-g32": ({"format": "int4", "granularity": "group", "block_size": [32]}, "none"),
    "int4-channel": ({"format": "int4", "granularity": "channel"}, "none"),
    "int8-channel": ({"format": "int8", "granularity": "channel"}, "int8"),
    "int8-tensor": ({"format": "int8", "granularity": "tensor"}, "int8"),
    "int8-w8a16": ({"format": "int8", "granularity": "channel"}, "none"),
}


def _weights(kind: str, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    if kind == "heavy":  # outliers (a Student-t): where clipping pays
        x = torch.distributions.StudentT(2.5).sample((48, 256))
    else:
        x = torch.randn(48, 256)
    return (0.02 * x).to(torch.bfloat16)


def _quant(weights: dict, inputs: str):
    ins = {"format": "none"} if inputs == "none" else {"format": inputs, "dynamic": True}
    return recipe_from_dict({"quant": {"weights": weights, "inputs": ins}}).quant


def _max_amax(w: torch.Tensor, scheme) -> torch.Tensor:
    g = mse.weight_groups(w, scheme.calib_granularity, scheme.block)
    return g.abs().amax(dim=1).reshape(scheme.amax_shape("weight", tuple(w.shape)))


def _index(t: dict[str, torch.Tensor]) -> dict:
    return {k: ("x.safetensors", tuple(v.shape), v.dtype) for k, v in t.items()}


def _fetch(t: dict[str, torch.Tensor]):
    def fetch(key, rows, cols):
        v = t[key]
        if rows is not None:
            v = v[rows[0] : rows[1]]
        if cols is not None:
            v = v[:, cols[0] : cols[1]]
        return v

    return fetch


def _exported_error(tensors: dict[str, torch.Tensor], w: torch.Tensor, scheme) -> float:
    """sum((w - dq)**2) of the export's tensors dequantized by qckpt's reader, as the search
    adds it (float64 squares; the sum's order differs: compared with a tolerance)."""
    idx = _index(tensors)
    if scheme.mx:
        qw = mx_weights(idx, scheme.code_bits)
    elif f"{M}.weight_packed" in tensors:
        qw = int_packed_weights(
            idx, scheme.code_bits, [scheme.block[1]] if scheme.granularity == "group" else [0]
        )
    else:
        qw = int8_weights(idx, ["channel", "tensor"])
    dq = dequantize(qw[f"{M}.weight"], _fetch(tensors), torch.float32)
    return float(((w.double() - dq.double()) ** 2).sum())


@pytest.mark.parametrize("kind", ["random", "heavy"])
@pytest.mark.parametrize("case", sorted(INT_CASES))
def test_int_mse_clip_is_never_worse_than_max_and_is_what_the_export_writes(case, kind):
    weights, inputs = INT_CASES[case]
    quant = _quant(weights, inputs)
    scheme = make_scheme(**{"fmt": weights["format"], "granularity": weights["granularity"],
                            "block": weights.get("block_size", (128, 128))})  # fmt: skip
    w = _weights(kind)
    amax = _max_amax(w, scheme)
    clip, err_max, err_mse = mse.int_weight_clip(w, amax, scheme, torch.bfloat16)
    assert clip.shape == amax.shape and bool((clip <= amax).all())
    assert err_mse <= err_max
    if scheme.code_bits == 4 or kind == "heavy":
        assert err_mse < err_max  # 4-bit codes (and outliers) gain from clipping
    layout = export_layout(quant, torch.bfloat16)
    for a, want in ((amax, err_max), (clip, err_mse)):
        out = dict(layout.quantize_linear(M, w, {f"{M}.weight_amax": a}))
        assert _exported_error(out, w, scheme) == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_int_mse_of_an_all_zero_group_is_zero_and_ties_keep_the_larger_ratio():
    scheme = make_scheme("int4", granularity="group", block=(32,))
    w = _weights("heavy")[:4, :64].clone()
    w[0] = 0  # two all-zero groups: every ratio ties at error 0
    amax = _max_amax(w, scheme)
    clip, err_max, err_mse = mse.int_weight_clip(w, amax, scheme, torch.bfloat16)
    assert torch.equal(clip[0], amax[0]) and float(clip[0].abs().sum()) == 0.0
    assert err_mse < err_max


def test_tree_sum_is_a_fixed_order_of_additions():
    x = torch.rand(3, 37, dtype=torch.float64)
    got = tree_sum(x)
    pad = torch.nn.functional.pad(x, (0, 64 - 37))
    while pad.shape[-1] > 1:
        pad = pad[:, : pad.shape[-1] // 2] + pad[:, pad.shape[-1] // 2 :]
    assert torch.equal(got, pad[:, 0])
    assert torch.allclose(got, x.sum(dim=-1))


@pytest.mark.parametrize("kind", ["random", "heavy"])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_mse_exponents_are_never_worse_than_max_and_are_what_the_export_writes(fmt, kind):
    scheme = make_scheme(fmt, granularity="group")
    ins = "none"
    quant = _quant({"format": fmt, "granularity": "group"}, ins)
    w = _weights(kind)
    codes, scales, err, err0 = mx_mse_quantize(w, scheme.code_bits)
    assert err <= err0
    if scheme.code_bits == 4:
        assert err < err0
    e_max, e_mse = mse.mx_weight_error(w, scheme.code_bits)
    assert (e_max, e_mse) == (err0, err)
    # the export of an mse calibration searches again (the same function); of max: the rule
    amax = {f"{M}.weight_amax": w.float().abs().amax()}
    for search, want in ((False, err0), (True, err)):
        layout = export_layout(quant, torch.bfloat16, BlockScales(search=search))
        out = dict(layout.quantize_linear(M, w, amax))
        assert _exported_error(out, w, scheme) == pytest.approx(want, rel=1e-12)
        if search:
            assert torch.equal(out[f"{M}.weight_scale"], scales)


def test_mx_block_search_tries_the_rules_exponent_and_its_neighbours_only():
    x = _weights("heavy").float().reshape(48, 8, 32)
    e, err, err0 = mx_block_search(x, 4)
    from qckpt.formats.mx_codes import mx_exponents

    base = mx_exponents(x.abs().amax(dim=-1), 2)
    assert bool(((e - base).abs() <= 1).all())
    assert bool((err <= err0).all()) and bool((e != base).any())
    assert torch.equal(err[e == base], err0[e == base])  # a tie keeps the rule's exponent
