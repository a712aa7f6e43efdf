"""The fast reader on sharded loads (real gloo ranks): EP- and TP-sharded destinations
(``ShardSpec`` blocks) from an HF safetensors dir and from a DCP dir saved on a different
number of ranks give, on every rank, the params the plain reader gives, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import shared_world

ALL = ["none", "fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]


def _fields(m) -> dict:
    out = {}
    for k, v in m.state_dict(keep_vars=True).items():
        fields = v.fields() if hasattr(v, "fields") else {"t": v.detach()}
        out[k] = {f: t.clone() for f, t in fields.items()}
    return out


def sc_fast_vs_plain(rank, world, path, ep, tp, fmts):
    """Per format: one sharded model loaded by the plain reader, then by the fast one (in
    pieces of 1000 bytes, so every block is read in several)."""
    import qckpt.read.fast_read as fast_read

    mesh_args = {"ep": ep, "tp": tp, "timeout_s": 10, "device": "cpu"}
    chunk, fast_read.CHUNK_BYTES = fast_read.CHUNK_BYTES, 1000
    try:
        return _compare(mesh_args, path, fmts)
    finally:
        fast_read.CHUNK_BYTES = chunk


def _compare(mesh_args, path, fmts):
    from qckpt.load.loader import load_checkpoint
    from qckpt.parallel.mesh import init_mesh
    from qckpt.parallel.shard import model_shards
    from qckpt.pipeline.model import build
    from tests._bits import bits

    mesh = init_mesh(**mesh_args)
    bad, sharded = [], 0
    for fmt in fmts:
        # fp8_block: blocks that a TP split of tiny-moe's 64 rows does not cut
        opts = {"block_size": (16, 16)} if fmt == "fp8_block" else {}
        m = build("tiny-moe", mesh, params=fmt, ignore=["lm_head"], **opts).model
        sharded = len(model_shards(m))
        load_checkpoint(m, path, mesh=mesh, reader="plain")
        ref = _fields(m)
        rep = load_checkpoint(m, path, mesh=mesh, reader="fast", read_threads=3)
        got = _fields(m)
        assert rep.reader == "fast" and rep.inline_items == 0
        for k in ref:
            for f in ref[k]:
                if not torch.equal(bits(ref[k][f]), bits(got[k][f])):
                    bad.append(f"{fmt}: {k}.{f}")
    return {"bad": bad, "sharded": sharded}


def sc_save(rank, world, out):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    save_model_dcp(build_model("tiny-moe", seed=1), out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from qckpt.convert.dcp import dcp_to_hf_dir, save_model_dcp
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("fastdist")
    src = build_model("tiny-moe", seed=1)
    save_model_dcp(src, root / "dcp1")
    dcp_to_hf_dir(root / "dcp1", root / "hf", src.config, max_shard_bytes=60_000)
    outs = shared_world(2).run(sc_save, str(root / "dcp2"), deadline_s=120)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return root


def _check(outs, want_sharded):
    for o in outs:
        assert o.ok, f"rank {o.rank}: {o.error}\n{o.traceback}"
        assert o.value["sharded"] >= want_sharded
        assert not o.value["bad"], (o.rank, o.value["bad"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind,ep,tp",
    [
        # expert blocks of fused experts read per expert from safetensors; TP row/column blocks
        ("hf", 2, 1),
        ("hf", 1, 2),
        # saved on 2 ranks (every tensor in two row blocks) read into EP / TP blocks
        ("dcp2", 2, 1),
        ("dcp2", 1, 2),
    ],
)
def test_sharded_loads_fast_equal_plain(dirs, kind, ep, tp):
    outs = shared_world(2).run(sc_fast_vs_plain, str(dirs / kind), ep, tp, ALL, deadline_s=180)
    _check(outs, 4 if ep == 2 else 8)
