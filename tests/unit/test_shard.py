"""ShardSpec: the block a rank holds, as one value the loader and the fingerprint read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qckpt.calib.state_file import model_fingerprint, model_names_shapes
from qckpt.load.preflight import expert_shards
from qckpt.models.build import build_model
from qckpt.parallel.shard import ShardSpec, model_shards, set_shard


def test_block_of_rank_two_of_four():
    s = ShardSpec.block("tp", (64, 32), 1, rank=2, world=4)
    assert (s.offsets, s.local, s.start, s.stop, s.total) == ((0, 16), 8, 16, 24, 32)
    assert list(s.indices) == list(range(16, 24))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(kind="dp"), "kind"),
        (dict(offsets=(4, 4)), "along dim 0"),
        (dict(offsets=(60, 0)), "past the end"),
        (dict(dim=2), "offsets"),
    ],
)
def test_a_spec_that_is_no_block_is_refused(kw, match):
    base = dict(kind="expert", global_shape=(64, 8), offsets=(0, 0), dim=0, local=8, rank=0)
    with pytest.raises(ValueError, match=match):
        ShardSpec(**{**base, "world": 8, **kw})


def test_fingerprint_of_an_expert_sharded_model_is_the_whole_models():
    whole = build_model("tiny-moe", seed=0)
    want = model_fingerprint(model_names_shapes(whole))
    part = build_model("tiny-moe", seed=0)
    for name, mod in part.named_modules():
        if name.endswith("mlp.experts"):
            for attr in ("gate_up_proj", "down_proj"):
                full = getattr(mod, attr)
                setattr(mod, attr, nn.Parameter(full.detach()[4:8].clone()))
                spec = ShardSpec.block("expert", full.shape, 0, rank=1, world=2)
                set_shard(mod, attr, spec)
    assert model_fingerprint(model_names_shapes(part)) == want
    # the loader reads the same specs: rank 1 reads experts 4..7 of each fused tensor
    shards = expert_shards(part)
    assert set(shards) == set(model_shards(part, "expert"))
    gs, off = shards["model.layers.0.mlp.experts.down_proj"]
    assert off == (4, 0, 0) and gs[0] == 8
    assert torch.Size(gs[1:]) == part.model.layers[0].mlp.experts.down_proj.shape[1:]
