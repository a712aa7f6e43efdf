"""Formats on CUDA: bounded quantize memory, CUDA == CPU bit for bit (eager and compiled),
scaled_mm Linear. Skipped without CUDA.

    pytest -q tests/gpu/test_formats_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from qckpt.formats import FORMATS, _common, quantize, set_compile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FMTS = ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]
GiB = 1 << 30


def _field_bytes(q) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in q.fields().values())


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


@pytest.fixture(params=["eager", "compiled"])
def compile_mode(request: pytest.FixtureRequest):  # noqa: ANN201
    set_compile(request.param == "compiled")
    yield request.param
    set_compile("auto")


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_memory_is_bounded(fmt: str, compile_mode: str) -> None:
    """Peak allocation of quantize = output fields + O(chunk) temporaries, far below the
    full-size FP32 copy (4 B/elem) that an unchunked quantize makes."""
    n_rows, n_cols = 16384, 16384  # 256 Mi elements: 512 MiB bf16, a full FP32 copy is 1 GiB
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
    # warm up with the same shapes: compiling (and autotuning, which clones mutated buffers)
    # must happen outside the measurement
    del_me = quantize(x, fmt)
    del del_me
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q = quantize(x, fmt)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out = _field_bytes(q)
    temps = peak - out
    # the chunk the kernels ran with (compiled kernels use a larger one: fused, no FP32 temps)
    chunk_f32 = _common.quant_chunk(x.device, _common.run_kernel) * 4
    print(
        f"{fmt} {compile_mode}: output {out / 2**20:.0f} MiB, temporaries {temps / 2**20:.0f} MiB"
    )
    assert temps <= 6 * chunk_f32, f"{fmt}: {temps / 2**20:.0f} MiB of temporaries"
    assert temps < x.numel() * 4 / 2  # never near a full-size FP32 copy

    # in place (the loader's path): no output allocation at all, only the chunk temporaries
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q.quantize_(x, update_state=False)
    torch.cuda.synchronize()
    temps_inplace = torch.cuda.max_memory_allocated() - base
    print(f"{fmt} {compile_mode}: quantize_ temporaries {temps_inplace / 2**20:.0f} MiB")
    assert temps_inplace <= 6 * chunk_f32


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_memory_is_bounded(fmt: str) -> None:
    x = torch.randn(8192, 16384, device="cuda", dtype=torch.bfloat16)
    q = quantize(x, fmt)
    del x
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    d = q.dequantize(torch.bfloat16)
    torch.cuda.synchronize()
    temps = torch.cuda.max_memory_allocated() - base - d.numel() * 2
    assert temps <= 8 * _common.CHUNK_ELEMS * 4, f"{fmt}: {temps / 2**20:.0f} MiB"


@pytest.mark.parametrize("cols", [1056, 1000])  # 1000: partial last blocks for every format
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_matches_cpu_bit_for_bit(fmt: str, compile_mode: str, cols: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, cols, generator=g) * torch.logspace(-6, 6, 1000).view(-1, 1)
    x[3] = 0
    x[7, :40] = 2.0**-130
    for dt in (torch.float32, torch.bfloat16):
        xc = x.to(dt)
        ref = quantize(xc, fmt)
        got = quantize(xc.cuda(), fmt)
        for k in FORMATS[fmt].tensor_fields:
            a, b = _u8(getattr(ref, k)), _u8(getattr(got, k)).cpu()
            mism = (a != b).sum().item()
            assert mism == 0, f"{fmt} {compile_mode} {dt}: {k} differs in {mism} places"
        assert torch.equal(ref.dequantize(torch.float32), got.dequantize(torch.float32).cpu())


def test_compiled_path_is_used_on_cuda() -> None:
    set_compile("auto")
    quantize(torch.randn(256, 256, device="cuda"), "mxfp8")
    assert not _common._compile_failed, f"torch.compile fell back: {_common._compile_failed}"


def test_linear_scaled_mm_fp8() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    w = lin.weight.detach().clone()
    lin.weight = torch.nn.Parameter(quantize(w, "fp8"), requires_grad=False)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    y = lin(x)
    ref = torch.nn.functional.linear(x, w, lin.bias)
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert y.shape == (64, 512) and y.dtype == torch.bfloat16
    assert rel < 0.08, rel
    # other formats: dequantize then matmul on CUDA too
    for fmt in ("mxfp8", "fp8_block", "nvfp4"):
        lin.weight = torch.nn.Parameter(quantize(w, fmt), requires_grad=False)
        y = lin(x)
        assert torch.equal(y, torch.nn.functional.linear(x, lin.weight.dequantize(), lin.bias))


def test_to_device_round_trip() -> None:
    q = quantize(torch.randn(64, 64), "nvfp4")
    c = q.to("cuda")
    assert c.device.type == "cuda" and c.qdata.is_cuda and c.global_scale.is_cuda
    assert torch.equal(c.to("cpu").dequantize(torch.float32), q.dequantize(torch.float32))


def test_linear_scaled_mm_non_finite_input_propagates() -> None:
    lin = torch.nn.Linear(64, 32, device="cuda", dtype=torch.bfloat16)
    lin.weight = torch.nn.Parameter(quantize(lin.weight.detach(), "fp8"), requires_grad=False)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    y = lin(x)  # no FormatError: the dequantized matmul propagates NaN as torch would
    assert torch.isnan(y[3]).all() and torch.isfinite(y[:3]).all()
