"""Formats on CUDA: bounded quantize memory, CUDA == CPU bit for bit (eager and compiled),
scaled_mm Linear. Skipped without CUDA.

    pytest -q tests/gpu/test_formats_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from qckpt.formats import FORMATS, KernelPolicy, kernel_policy, kernels, numerics, quantize
from tests._bits import bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FMTS = ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]
GiB = 1 << 30


def _field_bytes(q) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in q.fields().values())


@pytest.fixture(params=["eager", "compiled"])
def compile_mode(request: pytest.FixtureRequest):  # noqa: ANN201
    mode = "always" if request.param == "compiled" else "never"
    with kernel_policy(KernelPolicy(compile=mode)):
        yield request.param


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
    chunk_f32 = kernels.quant_chunk(x.device, kernels.run_kernel) * 4
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
    assert temps <= 8 * numerics.CHUNK_ELEMS * 4, f"{fmt}: {temps / 2**20:.0f} MiB"


def _show(t: torch.Tensor, idx: tuple[int, ...]) -> str:
    """One element as value and bits (fp8 / float32) or hex (uint8 codes, E8M0 exponents)."""
    v = t[idx]
    if v.dtype == torch.uint8:
        return f"0x{int(v):02x}"
    if v.element_size() == 1:
        return f"{float(v.float()):.9g} (0x{int(v.view(torch.uint8)):02x})"
    if v.dtype == torch.float32:
        return f"{float(v):.9g} (0x{int(v.view(torch.int32)) & 0xFFFFFFFF:08x})"
    return f"{float(v.float()):.9g}"


def _input_of(fmt: str, opts: dict, field: str, idx: tuple[int, ...], x: torch.Tensor) -> str:
    """The input element(s) that one output element was computed from, for a mismatch report."""
    r = idx[0] if idx else 0
    c = idx[1] if len(idx) > 1 else 0

    def amax(t: torch.Tensor) -> str:
        a = t.abs().max().float()
        return f"amax {float(a):.9g} (0x{int(a.view(torch.int32)) & 0xFFFFFFFF:08x})"

    if field == "qdata" and fmt != "nvfp4":  # codes have the input's shape
        return f"x={_show(x, idx)}"
    if fmt == "nvfp4" and field == "qdata":
        return f"x[{r}, {2 * c}:{2 * c + 2}]={x[r, 2 * c : 2 * c + 2].float().tolist()}"
    if fmt in ("mxfp8", "nvfp4") and field == "scale":
        b = 32 if fmt == "mxfp8" else 16
        return f"block x[{r}, {c * b}:{(c + 1) * b}] " + amax(x[r, c * b : (c + 1) * b])
    if fmt == "fp8_block" and field == "scale":
        br, bc = opts.get("block_size", (128, 128))
        return f"tile [{r * br}:, {c * bc}:] " + amax(
            x[r * br : (r + 1) * br, c * bc : (c + 1) * bc]
        )
    if fmt == "fp8" and opts.get("granularity") == "channel":
        return f"row {r} " + amax(x[r])
    return "tensor " + amax(x)


CASES = [pytest.param(f, {}, id=f) for f in FMTS] + [
    pytest.param("fp8", {"granularity": "channel"}, id="fp8_channel"),
    pytest.param("mxfp8", {"scale_rounding": "rceil"}, id="mxfp8_rceil"),
    pytest.param("fp8_block", {"block_size": (1, 128)}, id="fp8_block_1x128"),
]


@pytest.mark.parametrize("cols", [1056, 1000])  # 1000: partial last blocks for every format
@pytest.mark.parametrize("fmt,opts", CASES)
def test_cuda_matches_cpu_bit_for_bit(fmt: str, opts: dict, compile_mode: str, cols: int) -> None:
    """No tolerance and no excluded inputs: every scale and code must be the same bits.

    The input spans 12 decades and has an all-zero row, float32 subnormals (row 7), values
    whose quotients by 448 / 6 are float32 subnormals (row 13) and exact 448 * 2**k (row 11:
    amax / 448 a power of two, the RCEIL boundary)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, cols, generator=g) * torch.logspace(-6, 6, 1000).view(-1, 1)
    x[3] = 0
    x[7, :40] = 2.0**-130
    k = torch.randint(-20, 20, (cols,), generator=g).float()
    x[11] = 448.0 * torch.exp2(k) * torch.where(torch.rand(cols, generator=g) < 0.5, -1.0, 1.0)
    x[13] = torch.randn(cols, generator=g) * 2.0**-121
    errors = []
    for dt in (torch.float32, torch.bfloat16):
        xc = x.to(dt)
        ref = quantize(xc, fmt, **opts)
        got = quantize(xc.cuda(), fmt, **opts)
        for name in FORMATS[fmt].tensor_fields:
            rt, gt = getattr(ref, name), getattr(got, name).cpu()
            diff = (bits(rt) != bits(gt)).nonzero()
            if len(diff) == 0:
                continue
            errors.append(f"{dt} {name} differs in {len(diff)} places")
            for i in diff[:5].tolist():
                idx = tuple(i)
                errors.append(
                    f"    at {list(idx)}: {_input_of(fmt, opts, name, idx, xc)}; "
                    f"cpu {_show(rt, idx)}, cuda {_show(gt, idx)}"
                )
        if not torch.equal(ref.dequantize(torch.float32), got.dequantize(torch.float32).cpu()):
            errors.append(f"{dt} dequantize differs")
    if errors:
        head = (
            f"{fmt} {opts} {compile_mode} cols={cols} (torch {torch.__version__}, "
            f"inductor options {kernels.compile_options()}):"
        )
        pytest.fail("\n".join([head, *errors]), pytrace=False)


@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_matches_cpu_after_recompiles_for_new_shapes(fmt: str) -> None:
    """A loader or an export meets many weight shapes in one process: after the second shape
    the compiled kernel is recompiled with dynamic shapes, and that kernel must match CPU for
    every tensor-wide scale too. Found on the H200 (torch 2.11): the NVFP4 kernel's in-kernel
    1 / global_scale was not rounded as IEEE division, so for some global scales 0.9 % of an
    11008 x 4096 weight's codes differed. Hence many global scales here, no tolerance."""
    shapes = [(4096, 4096), (11008, 4096)] + [(1024 + 16 * (j % 3), 2048) for j in range(30)]
    g = torch.Generator().manual_seed(0)
    errors = []
    with kernel_policy(KernelPolicy(compile="always")):
        for i, (rows, cols) in enumerate(shapes):
            x = torch.randn(rows, cols, generator=g) * 0.02
            x.view(-1)[::4099] *= 40
            x = (x * 2.0 ** float(torch.empty(()).uniform_(-8, 8, generator=g))).to(torch.bfloat16)
            ref, got = quantize(x, fmt), quantize(x.cuda(), fmt)
            for name in FORMATS[fmt].tensor_fields:
                n = int((bits(getattr(ref, name)) != bits(getattr(got, name).cpu())).sum())
                if n:
                    errors.append(
                        f"{rows}x{cols} (#{i}) {name}: {n} of {getattr(ref, name).numel()}"
                    )
    assert not kernels.compile_failed, f"torch.compile fell back: {kernels.compile_failed}"
    assert not errors, f"{fmt} (torch {torch.__version__}): " + "; ".join(errors[:8])


def test_compile_options_make_division_exact() -> None:
    """The compiled kernels' float32 x / scale must be div_rn (eager's IEEE division): the
    option that makes inductor emit it must exist under one of its names in this torch."""
    opts = kernels.compile_options()
    print(f"torch {torch.__version__}: inductor options {opts}")
    assert opts.get("eager_numerics.division_rounding") or opts.get("emulate_divison_rounding")


def test_compiled_path_is_used_on_cuda() -> None:
    quantize(torch.randn(256, 256, device="cuda"), "mxfp8")  # the default policy: auto
    assert not kernels.compile_failed, f"torch.compile fell back: {kernels.compile_failed}"


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
