"""A blockwise-FP8 source loaded on 2 gloo ranks (TP=2, EP=2) and a source split over two
files (as two ranks write it) loaded on one: every rank's values are the one-rank load's block.

The 24x40 source has partial edge blocks and a TP split (rows 32 of 64) that cuts through a
24-row block, so the sliced reads must pick the right scale rows and columns; with 32x32 blocks
the EP blocks line up and fp8_block params take the stored codes and scales on each rank (a TP
split through a 32-row tile of fp8_block params is refused: tests/dist/test_sharded_load.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests import quantized_fixtures as fx
from tests.dist.harness import shared_world

IGNORE = ["lm_head", "*.mlp.gate"]


def _values(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.dequantize(torch.bfloat16) if hasattr(v, "qdata") else v.detach().clone())
        for k, v in model.state_dict(keep_vars=True).items()
    }


def _load(rank: int, world: int, path: str, ep: int, tp: int, block) -> dict:
    from qckpt.load.loader import load_checkpoint
    from qckpt.load.preflight import expert_shards, tensor_shards
    from qckpt.parallel.mesh import init_mesh
    from qckpt.pipeline.model import build

    # _warm built this model once already (imports, first build): a busy host's seconds of
    # building do not count against the groups' 10 s timeout here
    mesh = init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu")
    params = {} if block is None else {"params": "fp8_block", "block_size": block}
    model = build("tiny-moe", mesh, seed=3, seeded=True, ignore=IGNORE, **params).model
    rep = load_checkpoint(model, path, mesh=mesh)
    shards = {**expert_shards(model), **tensor_shards(model)}
    return {"values": _values(model), "shards": shards, "copied": rep.copied_tensors}


def _warm(rank: int, world: int) -> None:
    """Imports and a first model build, outside any collective."""
    from qckpt.models.build import build_model

    build_model("tiny-moe", dtype="bfloat16", seed=3)


def _one_rank(path: Path, block=None) -> tuple[dict[str, torch.Tensor], int]:
    from qckpt.load.loader import load_checkpoint
    from qckpt.models.build import build_model
    from qckpt.models.quantize_params import quantize_model_params

    model = build_model("tiny-moe", dtype="bfloat16", seed=3)
    if block is not None:
        quantize_model_params(model, "fp8_block", ignore=IGNORE, block_size=block)
    rep = load_checkpoint(model, path)
    return _values(model), rep.copied_tensors


def _split_in_two_files(src: Path, out: Path) -> Path:
    """The same tensors over two shard files with an index; each weight's codes in one file
    and its scales in the other, as two ranks that split the tensors would write them."""
    out.mkdir()
    with safe_open(str(src / "model.safetensors"), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    files = ({}, {})
    for i, k in enumerate(sorted(tensors)):
        files[(i + k.endswith("_scale_inv")) % 2][k] = tensors[k]
    weight_map = {}
    for i, part in enumerate(files):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, str(out / name))
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in src.glob("*.json"):
        (out / f.name).write_text(f.read_text())
    return out


def _ok(outs):
    bad = [o for o in outs if not o.ok]
    assert not bad, "\n".join(f"rank {o.rank}: {o.error}\n{o.traceback}" for o in bad)
    return [o.value for o in outs]


def _assert_rank_blocks(outs: list[dict], ref: dict[str, torch.Tensor], what: str) -> None:
    """Each rank's values are its block of the one-rank values, bit for bit."""
    for rank, out in enumerate(outs):
        for k, v in out["values"].items():
            want = ref[k]
            if k in out["shards"]:
                _, offs = out["shards"][k]
                idx = tuple(slice(o, o + n) for o, n in zip(offs, v.shape, strict=True))
                want = want[idx]
            assert torch.equal(v.view(torch.int16), want.view(torch.int16)), (what, rank, k)


@pytest.mark.timeout(300)
def test_blockwise_fp8_source_loads_the_same_on_one_and_two_ranks(tmp_path):
    src = fx.bf16_dir(tmp_path)
    bw24 = fx.blockwise_fp8(src, tmp_path / "bw24x40", (24, 40))
    bw32 = fx.blockwise_fp8(src, tmp_path / "bw32", (32, 32))
    w2 = shared_world(2)
    _ok(w2.run(_warm, deadline_s=240))

    # 1 -> 2: TP=2 (attention split) and EP=2 (experts split), BF16 params
    ref24, _ = _one_rank(bw24)
    for ep, tp in ((1, 2), (2, 1)):
        outs = _ok(w2.run(_load, str(bw24), ep, tp, None, deadline_s=240))
        assert any(k in o["shards"] for o in outs for k in o["values"])
        _assert_rank_blocks(outs, ref24, f"24x40, ep={ep} tp={tp}")

    # 1 -> 2 into fp8_block params: the blocks line up under EP, so codes and scales are
    # copied on each rank; under TP k/v_proj's 16-row halves would cut a 32-row tile, whose
    # one scale no local layout can hold: refused on every rank before a byte is read
    ref32, copied = _one_rank(bw32, (32, 32))
    assert copied == 12
    outs = _ok(w2.run(_load, str(bw32), 2, 1, (32, 32), deadline_s=240))
    assert [o["copied"] for o in outs] == [12, 12]
    _assert_rank_blocks(outs, ref32, "fp8_block 32x32, ep=2")
    outs = w2.run(_load, str(bw32), 1, 2, (32, 32), deadline_s=240)
    for o in outs:
        assert o.error_type == "UsageError", o.error
        assert "model.layers.0.self_attn.k_proj.weight: parallel.tp=2 splits dim 0" in o.error
        assert "inside a 32-element fp8_block scale block" in o.error and "\n" not in o.error

    # 2 -> 1: the source split over two files (codes and scales apart) reads the same
    split = _split_in_two_files(bw24, tmp_path / "bw24x40-split")
    got, _ = _one_rank(split)
    assert all(torch.equal(got[k].view(torch.int16), ref24[k].view(torch.int16)) for k in ref24)
    # and 2 -> 2
    outs = _ok(w2.run(_load, str(split), 1, 2, None, deadline_s=240))
    _assert_rank_blocks(outs, ref24, "split source, tp=2")
