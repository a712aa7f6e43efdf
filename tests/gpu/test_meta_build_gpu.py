"""Meta builds on a GPU (issue 17): fresh quantized tensors on CUDA hold the same fields as on
the CPU, a meta-built model loads what a seeded build loads, and the build allocates no more
device memory than the quantized model itself. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from qckpt import formats
from qckpt.convert.dcp import save_model_dcp
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.model import build
from tests._bits import bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ALL_FORMATS = ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]
IGNORE = ["lm_head", "*.mlp.gate"]


def _same(a, b) -> bool:
    fa, fb = a.fields(), b.fields()
    return fa.keys() == fb.keys() and all(
        torch.equal(bits(fa[k].cpu()), bits(fb[k].cpu())) for k in fa
    )


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_empty_on_cuda_equals_the_cpu_and_quantizing_zeros(fmt):
    shape = (130, 260)
    want = formats.quantize(torch.zeros(shape, dtype=torch.bfloat16), fmt)
    got = formats.empty(shape, fmt, device="cuda")
    moved = torch.empty_like(formats.empty(shape, fmt, device="meta"), device="cuda")
    assert got.qdata.is_cuda and moved.qdata.is_cuda
    assert _same(got, want) and _same(moved, want)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("meta") / "dcp"
    src = build_model("tiny-moe", seed=5)
    save_model_dcp(src, d)
    return d, src.state_dict()


def _build(fmt, seeded):
    mesh = Mesh(device=torch.device("cuda"))
    return build("tiny-moe", mesh, seeded=seeded, sharded=False, params=fmt, ignore=IGNORE)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_meta_build_on_cuda_loads_what_a_seeded_build_loads(ckpt, fmt):
    path, values = ckpt
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    meta = _build(fmt, seeded=False)
    held = sum(
        t.quantized_nbytes() if formats.is_quantized(t) else t.numel() * t.element_size()
        for t in {id(t): t for t in meta.model.state_dict(keep_vars=True).values()}.values()
    )
    # the build allocated the quantized model and the small rebuilt buffers, nothing more
    assert torch.cuda.memory_allocated() - before <= held + 2**20
    seeded = _build(fmt, seeded=True)
    load_checkpoint(meta.model, path)
    load_checkpoint(seeded.model, path)
    got = meta.model.state_dict(keep_vars=True)
    ref = seeded.model.state_dict(keep_vars=True)
    for name, t in got.items():
        if fmt == "fp8_delayed" and name in meta.quantized:
            want = formats.quantize(values[name].cuda(), fmt)
            assert _same(t, want), name
        elif formats.is_quantized(t):
            assert _same(t, ref[name]), name
        else:
            assert torch.equal(bits(t.detach().cpu()), bits(ref[name].detach().cpu())), name
