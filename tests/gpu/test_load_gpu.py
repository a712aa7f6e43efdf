"""Streaming loads on a GPU: transient device memory measured with the allocator's peak stats.

Skipped without CUDA. The checkpoint (8 x 4096x4096 BF16, 256 MiB) is written once per module;
each format loads it stream and bulk into CUDA params:

* stream transient <= 2 * max(numel) + 64 MiB (one BF16 scratch plus the quantize kernels'
  chunk temporaries), bulk transient >= 2 * sum(numel) (everything dequantized at once);
* stream and bulk give identical params; main params FP32 equal the checkpoint bit for bit.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS, DIM = 8, 4096
MiB = 2**20
ALL_FORMATS = ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]


class Stack(nn.Module):
    def __init__(self, device: str = "cuda") -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(DIM, DIM, bias=False, dtype=torch.bfloat16, device="meta")
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(DIM, dtype=torch.bfloat16, device="meta")
        self.to_empty(device=device)
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from qckpt.convert.dcp import save_model_dcp

    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(LAYERS):
        w = torch.randn(DIM, DIM, generator=g)
        w *= 2.0 ** ((torch.arange(DIM) % 8) - 4).float().view(-1, 1)
        sd[f"layers.{i}.weight"] = w.to(torch.bfloat16)
    sd["norm.weight"] = torch.randn(DIM, generator=g).to(torch.bfloat16)
    sd["norm.bias"] = torch.randn(DIM, generator=g).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("gpu") / "dcp"
    save_model_dcp(sd, path)
    return path, sd


def _model(fmt: str) -> nn.Module:
    from qckpt.models.quantize_params import quantize_model_params

    m = Stack()
    quantize_model_params(m, fmt)
    gc.collect()
    torch.cuda.empty_cache()
    # qckpt never resets the allocator's high (a command's peak is whole); the test does, here,
    # before the load, so that every load window below raises it and is measured exactly
    torch.cuda.reset_peak_memory_stats()
    return m


def _fields(m: nn.Module) -> dict:
    from qckpt import formats

    out = {}
    for k, v in m.state_dict(keep_vars=True).items():
        fs = v.fields() if formats.is_quantized(v) else {"t": v.detach()}
        out[k] = {
            n: (t.view(torch.uint8) if t.element_size() == 1 else t).cpu() for n, t in fs.items()
        }
    return out


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_stream_transient_is_bounded_by_the_largest_tensor(ckpt, fmt):
    from qckpt import formats
    from qckpt.load.loader import load_checkpoint

    if fmt not in formats.FORMATS:
        pytest.skip(f"{fmt} not built")
    path, _ = ckpt
    numel = DIM * DIM
    # compile the format's kernels at this shape outside the measured loads
    x = torch.randn(DIM, DIM, device="cuda").to(torch.bfloat16)
    q = formats.quantize(x, fmt)
    q.dequantize(torch.bfloat16)
    q.quantize_(x, update_state=False)
    del x, q

    ms = _model(fmt)
    # the plain reader: one scratch at a time (the fast reader's bound: test_fast_read_gpu.py)
    rs = load_checkpoint(ms, path, stream=True, reader="plain")
    assert "cuda allocator" in rs.measured_by and "lower bound" not in rs.measured_by
    assert rs.predicted_transient_bytes == 2 * numel
    assert rs.transient_bytes <= 2 * numel + 64 * MiB, rs.to_dict()
    assert rs.transient_bytes >= 2 * numel  # the scratch itself is really there
    stream_fields = _fields(ms)
    del ms

    mb = _model(fmt)
    rb = load_checkpoint(mb, path, stream=False)
    assert rb.transient_bytes >= 2 * numel * LAYERS, rb.to_dict()
    bulk_fields = _fields(mb)
    del mb
    for k in stream_fields:
        for n in stream_fields[k]:
            assert torch.equal(stream_fields[k][n], bulk_fields[k][n]), (fmt, k, n)


def test_main_params_on_cuda_equal_the_checkpoint(ckpt):
    from qckpt.load.loader import load_checkpoint

    path, sd = ckpt
    m = _model("fp8")
    rep = load_checkpoint(m, path, main_params="fp32")
    assert len(rep.main_param_tensors) == LAYERS
    for k, t in rep.main_param_tensors.items():
        assert t.device.type == "cuda" and t.dtype == torch.float32
        assert torch.equal(t.cpu(), sd[k].float()), k
    # kept outputs are not transient: still one scratch
    assert rep.transient_bytes <= 2 * DIM * DIM + 64 * MiB


def test_plain_bf16_load_on_cuda_is_bit_exact(ckpt):
    from qckpt.load.loader import load_checkpoint

    path, sd = ckpt
    m = _model("none")
    rep = load_checkpoint(m, path)
    assert rep.transient_bytes == 0
    for k, v in m.state_dict().items():
        assert torch.equal(v.cpu(), sd[k]), k
