"""The fast reader on a GPU: pinned buffers, copy stream, overlapped quantize.

Skipped without CUDA. Every format (and plain BF16) loads a DCP dir and its HF safetensors
twin with the fast and the plain reader into CUDA params: identical params, and the fast
stream's device transient (allocator peak stats) within max_inflight scratches + 64 MiB.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS, DIM = 6, 2048
MiB = 2**20
DEVICE = "cuda"
FORMATS = ["none", "fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(DIM, DIM, bias=False, dtype=torch.bfloat16, device="meta")
            for _ in range(LAYERS)
        )
        # a tall one: its rows span several 32 MiB read pieces
        self.big = nn.Linear(DIM, 5 * DIM, bias=False, dtype=torch.bfloat16, device="meta")
        self.norm = nn.LayerNorm(DIM, dtype=torch.bfloat16, device="meta")
        self.to_empty(device=DEVICE)
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch):
    # 1 MiB pieces: every weight in many pieces, each pinned buffer reused many times
    import qckpt.read.fast_read as fast_read

    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 1 << 20)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from safetensors.torch import save_file

    from qckpt.convert.dcp import save_model_dcp

    g = torch.Generator().manual_seed(0)
    src = Stack().cpu()
    sd = {}
    for k, v in src.state_dict().items():
        w = torch.randn(v.shape, generator=g)
        if w.dim() == 2:
            w *= 2.0 ** ((torch.arange(w.shape[0]) % 8) - 4).float().view(-1, 1)
        sd[k] = w.to(torch.bfloat16)
    root = tmp_path_factory.mktemp("fastgpu")
    save_model_dcp(sd, root / "dcp")
    # FP32 values for BF16 params: cast on the host into the pinned buffer
    save_model_dcp({k: v.float() for k, v in sd.items()}, root / "dcp-fp32")
    (root / "hf").mkdir()
    save_file(sd, str(root / "hf" / "model.safetensors"))
    return root


def _model(fmt: str) -> nn.Module:
    from qckpt.models.quantize_params import quantize_model_params

    m = Stack()
    if fmt != "none":
        quantize_model_params(m, fmt, ignore=["norm"])
    return m


def _same(a: nn.Module, b: nn.Module) -> bool:
    from tests.toy import same_tensor

    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    return all(same_tensor(sa[k], sb[k]) for k in sa)


def test_cast_path_fast_equals_plain_on_cuda(dirs):
    from qckpt.load.loader import load_checkpoint

    for fmt in ("none", "fp8"):
        a, b = _model(fmt), _model(fmt)
        load_checkpoint(a, dirs / "dcp-fp32", reader="fast")
        load_checkpoint(b, dirs / "dcp-fp32", reader="plain")
        assert _same(a, b), fmt


@pytest.mark.parametrize("kind", ["dcp", "hf"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_equals_plain_on_cuda(dirs, fmt, kind):
    from qckpt.load.loader import load_checkpoint

    a, b = _model(fmt), _model(fmt)
    ra = load_checkpoint(a, dirs / kind, reader="fast", max_inflight=2)
    rb = load_checkpoint(b, dirs / kind, reader="plain")
    assert ra.reader == "fast" and rb.reader == "plain"
    assert ra.inline_items == 0
    assert _same(a, b)
    biggest = 2 * 5 * DIM * DIM
    if fmt != "none":
        assert ra.predicted_transient_bytes == biggest + 2 * DIM * DIM
        assert ra.transient_bytes <= ra.predicted_transient_bytes + 64 * MiB
        assert rb.transient_bytes <= biggest + 64 * MiB
    del a, b
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt,kernel", [("fp8", "fp8_cast"), ("mxfp8", "mx_quantize")])
def test_fast_load_quantizes_with_the_triton_kernels(dirs, monkeypatch, fmt, kernel):
    from qckpt.formats import triton_kernels
    from qckpt.load.loader import load_checkpoint

    if not triton_kernels.usable(fmt):
        pytest.skip("triton kernels not usable on this GPU")
    m = _model(fmt)  # its own quantize is not the load's
    calls = []
    real = getattr(triton_kernels, kernel)

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, kernel, spy)
    load_checkpoint(m, dirs / "dcp", reader="fast")
    assert len(calls) >= LAYERS + 1  # every quantized destination of the load


# ---- runs: the per-expert items of a fused parameter, packed and copied by stretches ------------


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    from qckpt.convert.dcp import dcp_to_hf_dir, save_model_dcp
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("fastgpu-moe")
    moe = build_model("tiny-moe", seed=1)
    save_model_dcp(moe, root / "dcp")
    dcp_to_hf_dir(root / "dcp", root / "hf", moe.config, max_shard_bytes=60_000)
    return root / "hf"


def _moe(fmt: str) -> nn.Module:
    from qckpt.models.build import build_model
    from qckpt.models.quantize_params import quantize_model_params

    m = build_model("tiny-moe", seed=7).to(DEVICE)
    if fmt != "none":
        quantize_model_params(m, fmt, ignore=["lm_head"])
    return m


@pytest.mark.parametrize("inflight", [1, 2])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4"])
def test_fused_experts_read_as_runs_on_cuda_equal_plain(moe_hf, monkeypatch, fmt, inflight):
    import qckpt.read.fast_read as fast_read
    import qckpt.read.fast_tasks as fast_tasks
    from qckpt.load.loader import load_checkpoint
    from qckpt.read.fast_read import FastReadEngine

    # 4 KiB pinned buffers: a run's spans are cut mid-expert and its tasks reuse the buffers
    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 4096)
    runs, copies = [], []
    real_run, real_stretches = FastReadEngine._start_run, fast_tasks.stretches

    def spy_run(self, *args):
        r = real_run(self, *args)
        if r is not None:
            runs.append(len(r.items))
        return r

    def spy_stretches(spans):
        out = real_stretches(spans)
        copies.append((len(spans), len(out)))
        return out

    monkeypatch.setattr(FastReadEngine, "_start_run", spy_run)
    monkeypatch.setattr(fast_tasks, "stretches", spy_stretches)
    a, b = _moe(fmt), _moe(fmt)
    ra = load_checkpoint(a, moe_hf, reader="fast", max_inflight=inflight, read_threads=4)
    load_checkpoint(b, moe_hf, reader="plain")
    assert _same(a, b)
    assert runs and max(runs) > 1
    assert copies and all(0 < c <= s for s, c in copies)
    assert ra.transient_bytes <= ra.predicted_transient_bytes + 64 * MiB


# ---- read-ahead: the next destinations' bytes in pinned staging before their scratch ----------


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4"])
def test_read_ahead_on_cuda_equals_plain_at_max_inflight_1(dirs, moe_hf, monkeypatch, fmt):
    import qckpt.read.fast_read as fast_read
    from qckpt.load.loader import load_checkpoint
    from qckpt.read.fast_read import FastReadEngine

    # 64 KiB pieces and 256 KiB of pinned staging: each destination's first pieces are staged
    # (copied in at its admission), its later ones wait for a staging buffer or the admission
    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(fast_read, "READ_AHEAD_BYTES", 256 << 10)
    staged: list[int] = []
    real = FastReadEngine._stage

    def spy(self, run, spans, sbuf):
        staged.append(1)
        assert sbuf.is_pinned()
        return real(self, run, spans, sbuf)

    monkeypatch.setattr(FastReadEngine, "_stage", spy)
    for path, make in ((moe_hf, lambda: _moe(fmt)), (dirs / "dcp", lambda: _model(fmt))):
        a, b = make(), make()
        ra = load_checkpoint(a, path, reader="fast", max_inflight=1, read_threads=4)
        load_checkpoint(b, path, reader="plain")
        assert _same(a, b), path
        assert ra.read_ahead_bytes == 256 << 10
        # one scratch live at a time: the staging is host memory
        assert ra.transient_bytes <= ra.predicted_transient_bytes + 64 * MiB
        del a, b
        gc.collect()
        torch.cuda.empty_cache()
    assert staged
