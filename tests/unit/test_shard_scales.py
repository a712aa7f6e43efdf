"""Which sharded destinations need the whole tensor's amax, which splits are refused, and the
copy decision of a quantized source made on the whole tensor (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from qckpt import formats
from qckpt.errors import UsageError
from qckpt.formats.scheme import Fp8Scheme
from qckpt.kernel_policy import KernelPolicy
from qckpt.load.shard_scales import check_blocks, whole_amax_kind
from qckpt.parallel.shard import ShardSpec


def _q(shape, fmt, **opts):
    # eager kernels: these tests need the layout, not the speed (no compile on first use)
    eager = KernelPolicy(compile="never")
    return formats.quantize(torch.randn(shape, dtype=torch.bfloat16), fmt, policy=eager, **opts)


def _tp(shape, dim, rank=1, world=2):
    return ShardSpec.block("tp", shape, dim, rank, world)


def _ep(shape, rank=1, world=2):
    return ShardSpec.block("expert", shape, 0, rank, world)


@pytest.mark.parametrize(
    ("fmt", "opts", "spec", "want"),
    [
        ("fp8", {}, _ep((8, 64, 32)), "tensor"),  # one scale for all experts
        ("fp8", {}, _tp((64, 64), 0), "tensor"),
        ("fp8", {"granularity": "channel"}, _ep((8, 64, 32)), None),  # one scale per expert
        ("fp8", {"granularity": "channel"}, _tp((64, 64), 0), None),  # rows whole
        ("fp8", {"granularity": "channel"}, _tp((64, 64), 1), "rows"),  # rows cut
        ("nvfp4", {}, _tp((64, 64), 1), "tensor"),  # the global scale
        ("fp8_delayed", {}, _ep((8, 64, 32)), "tensor"),  # a first scale comes from it
        ("mxfp8", {}, _tp((64, 64), 1), None),
        ("fp8_block", {}, _ep((8, 64, 32)), None),
    ],
)
def test_which_scales_span_the_split(fmt, opts, spec, want):
    local = tuple(spec.local if i == spec.dim else s for i, s in enumerate(spec.global_shape))
    assert whole_amax_kind(_q(local, fmt, **opts), spec) == want


@pytest.mark.parametrize(
    ("fmt", "opts", "spec", "block"),
    [
        ("mxfp8", {}, _tp((64, 64), 1, rank=1, world=4), 32),  # columns [16, 32)
        ("nvfp4", {}, _tp((64, 24), 1), 16),  # columns [12, 24)
        ("fp8_block", {}, _tp((64, 64), 0), 128),  # rows [32, 64) of one 128-row tile
        ("fp8_block", {"block_size": (16, 32)}, _tp((64, 32), 1), 32),
    ],
)
def test_a_split_inside_a_block_is_one_line_naming_param_split_and_block(fmt, opts, spec, block):
    local = tuple(spec.local if i == spec.dim else s for i, s in enumerate(spec.global_shape))
    state = {"layers.0.o_proj.weight": _q(local, fmt, **opts)}
    with pytest.raises(UsageError) as e:
        check_blocks(state, {"layers.0.o_proj.weight": spec})
    msg = str(e.value)
    assert msg.startswith(
        f"layers.0.o_proj.weight: parallel.tp={spec.world} splits dim {spec.dim} "
        f"(size {spec.total}) at [{spec.start}, {spec.stop}), inside a {block}-element {fmt} "
    ), msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("fmt", "opts", "spec"),
    [
        ("mxfp8", {}, _tp((64, 64), 1)),  # [32, 64): a block boundary
        ("nvfp4", {}, _tp((64, 64), 1, rank=3, world=4)),
        ("fp8_block", {"block_size": (16, 16)}, _tp((32, 64), 0)),
        ("fp8_block", {}, _ep((8, 64, 32))),  # experts: tiles run over the last two dims
        ("mxfp8", {}, _tp((64, 48), 0)),  # rows: mxfp8 blocks run along the columns
        ("fp8", {}, _tp((64, 48), 1)),  # per tensor: the amax reduction covers it
    ],
)
def test_splits_on_block_boundaries_are_accepted(fmt, opts, spec):
    local = tuple(spec.local if i == spec.dim else s for i, s in enumerate(spec.global_shape))
    check_blocks({"w": _q(local, fmt, **opts)}, {"w": spec})


def test_the_copy_decision_of_a_whole_tensor_scale_is_made_on_the_whole_tensor():
    """A per-tensor FP8 source tensor stored as two pieces (per-expert weights of one fused
    tensor): one rank's block may come from one piece, but the whole tensor needs two scales
    in one: no rank copies, so every rank takes the dequantize path and its collective."""
    from qckpt.layouts.source_layout import QuantWeight
    from qckpt.load.same_layout import copy_plan

    class Piece:
        def __init__(self, offsets, sizes):
            self.offsets, self.sizes = offsets, sizes
            self.quant = QuantWeight(
                name="w", shape=sizes[-2:], scheme=Fp8Scheme(), granularity="tensor", codes="w",
                scale="w_scale",
            )  # fmt: skip

    pieces = [Piece((0, 0, 0), (1, 8, 16)), Piece((1, 0, 0), (1, 8, 16))]
    dest = _q((1, 8, 16), "fp8")  # rank 1's expert of a 2-expert fused tensor
    assert copy_plan(dest, pieces, (1, 0, 0)) is not None  # the block alone: one piece
    assert copy_plan(dest, pieces, (1, 0, 0), (2, 8, 16)) is None  # the whole: two
    whole = _q((2, 8, 16), "fp8")
    assert copy_plan(whole, pieces, (0, 0, 0)) is None  # what a one-rank load decides
    one = [Piece((0, 0, 0), (2, 8, 16))]
    assert copy_plan(dest, one, (1, 0, 0), (2, 8, 16)) is not None  # one piece: copied


def test_te_backend_with_ep_or_tp_is_refused_before_building():
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.load import load
    from qckpt.recipe import recipe_from_dict

    r = recipe_from_dict({"load": {"backend": "te"}, "parallel": {"ep": 2}})
    with pytest.raises(UsageError, match=r"^load.backend: te loads every tensor whole; "):
        load(r, Mesh(world_size=2, ep=2))
