"""The hand-written Triton kernels (qckpt/formats/triton_kernels.py) against the torch path, bit for bit.

    pytest -q tests/gpu/test_formats_triton.py        # CUDA + triton; the CPU part runs anywhere

CPU part (always runs): the integer FP8 rounding (``soft_fp8_bits_torch``) against torch's cast,
and a pure-torch emulation of each kernel's per-program logic (index math, block exponents,
subnormal handling) against ``quantize`` with the torch path.
CUDA part (skipped without CUDA or triton): ``quantize`` with the Triton kernels against the torch
path (``QCKPT_TRITON`` off, eager) on the same device, every code and scale, in bf16 and fp32,
on random, skewed and edge-case inputs, with both FP8 conversions (Triton's cast and the integer
one); NaN/Inf refusal; temporaries.
"""

from __future__ import annotations

import pytest
import torch

from qckpt.errors import FormatError
from qckpt.formats import (
    FORMATS,
    KernelPolicy,
    kernel_policy,
    kernels,
    numerics,
    quantize,
    triton_kernels,
)
from qckpt.formats.triton_kernels import tl, triton
from tests._bits import bits

HAS_TRITON_CUDA = torch.cuda.is_available() and triton_kernels.available()
needs_gpu = pytest.mark.skipif(not HAS_TRITON_CUDA, reason="needs CUDA (sm_89+) and triton")

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}


def _fval(t: torch.Tensor) -> str:
    v = t.float().item()
    b = t.float().view(torch.int32).item() & 0xFFFFFFFF
    return f"{v:.9g} (0x{b:08x})"


def _report(name: str, x: torch.Tensor, ref: torch.Tensor, got: torch.Tensor) -> list[str]:
    """Mismatch positions (in the (rows, last dim) view) with the input value (codes) or the
    block's amax (mxfp8 scales) and both results."""

    def as2d(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)

    r2, g2, x2 = as2d(ref), as2d(got), as2d(x)
    diff = (bits(r2) != bits(g2)).nonzero()
    if len(diff) == 0:
        return []
    out = [f"{name}: {len(diff)} of {ref.numel()} differ (ref shape {tuple(ref.shape)})"]

    def show(t: torch.Tensor) -> str:
        if t.dtype == torch.uint8:
            return f"0x{int(t):02x}"
        if t.element_size() == 1:
            return f"{float(t.float()):.9g} (0x{int(t.view(torch.uint8)):02x})"
        return _fval(t)

    for i, j in diff[:8].tolist():
        if r2.shape == x2.shape:
            src = f"x={_fval(x2[i, j])}"
        else:  # a block scale
            src = f"block amax={_fval(x2[i, j * 32 : (j + 1) * 32].float().abs().max())}"
        out.append(f"    at [{i}, {j}]: {src}; torch {show(r2[i, j])}, triton {show(g2[i, j])}")
    return out


# ---- inputs ---------------------------------------------------------------------------------


def _ties_row(cols: int, e4m3: bool) -> torch.Tensor:
    """Exact FP8 rounding ties (midpoints between adjacent codes, normal and subnormal) with
    448 (E4M3) / 57344 (E5M2) every 32 elements, so the per-tensor scale and each MX block's
    scale are exactly 1.0 and x / scale hits the midpoints."""
    mb, emin, top = (3, -6, 448.0) if e4m3 else (2, -14, 57344.0)
    mids = []
    for p in range(emin, 9 if e4m3 else 16):
        for j in range(1 << mb):
            mids.append((1 + (2 * j + 1) / 2 ** (mb + 1)) * 2.0**p)
    for j in range(1 << mb):  # subnormal midpoints
        mids.append((2 * j + 1) * 2.0 ** (emin - mb - 1))
    v = torch.tensor([m for m in mids if m < top], dtype=torch.float64)
    v = v.repeat(cols // len(v) + 1)[:cols]
    sign = torch.where(torch.arange(cols) % 3 == 0, -1.0, 1.0).double()
    v = v * sign
    v[::32] = top
    return v.float()


def make_input(rows: int, cols: int, dtype: torch.dtype, fp8: torch.dtype, seed: int = 0):
    """Random rows spanning 12 decades plus edge rows: zeros, -0.0, float32 subnormals (a
    whole row of them: all-subnormal MX blocks), quotients below FP8's range, exact powers of
    two, FP8 rounding ties, and values saturating MX blocks (amax / 2**e in [448, 512))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows).view(-1, 1)
    if rows >= 16:
        x[3] = 0
        x[4] = -0.0
        x[5, ::2] = -0.0
        x[7, :40] = 2.0**-130
        x[8] = torch.randn(cols, generator=g) * 2.0**-128  # all subnormal (fp32; bf16 too)
        x[9, : min(cols, 5)] = torch.tensor([2.0**-149, -(2.0**-149), 2.0**-133, -0.0, 1e-40])[
            : min(cols, 5)
        ]
        k = torch.randint(-20, 20, (cols,), generator=g).float()
        x[11] = 448.0 * torch.exp2(k) * torch.where(torch.rand(cols, generator=g) < 0.5, -1, 1)
        x[12] = _ties_row(cols, fp8 == torch.float8_e4m3fn)
        x[13] = torch.randn(cols, generator=g) * 2.0**-121
        x[14] = (torch.rand(cols, generator=g) * 64 + 448) * torch.where(
            torch.arange(cols) % 2 == 0, 1.0, -1.0
        )  # MX: amax / 2**e in [448, 512): the top saturates
        x[15] = torch.exp2(torch.randint(-126, 127, (cols,), generator=g).float())
    return x.to(dtype)


def rescale(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``normal``: x; ``tiny``: x scaled to amax 2**-128 (all float32 subnormals or zero)."""
    if kind == "normal":
        return x
    return x / x.abs().max().clamp_min(1e-30) * 2.0**-128


# ---- CPU: the integer FP8 rounding and emulations of the kernels ----------------------------


@pytest.mark.parametrize("fp8", list(FP8.values()), ids=list(FP8))
def test_soft_fp8_bits_match_torch_cast(fp8: torch.dtype) -> None:
    """Every exponent, every pattern of the top 7 mantissa bits combined with low bits that sit
    at, just below and just above each possible rounding position (ties and near-ties, normal
    and subnormal results), every code's value +- 3 ulp, and random patterns; |y| <= fmax."""
    fmax = numerics.FP8_MAX[fp8]
    lim = int(torch.tensor(fmax).view(torch.int32))
    p = torch.arange(23, dtype=torch.int64)
    low = torch.cat([1 << p, (1 << p) - 1, (1 << p) + 1, torch.tensor([0, 0x7FFFFF])]) & 0x7FFFFF
    top = torch.arange(128, dtype=torch.int64) << 16
    mant = (top.view(-1, 1) | low.view(1, -1)).flatten()
    mant = torch.cat([mant, (top.view(-1, 1) ^ (low.view(1, -1) & 0xFFFF)).flatten()]) & 0x7FFFFF
    ex = torch.arange(0, (lim >> 23) + 1, dtype=torch.int64)
    b = ((ex.view(-1, 1) << 23) | mant.view(1, -1)).flatten()
    codes = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    codes = codes[torch.isfinite(codes) & (codes >= 0) & (codes <= fmax)]
    near = (codes.view(torch.int32).view(-1, 1) + torch.arange(-3, 4, dtype=torch.int32)).flatten()
    g = torch.Generator().manual_seed(1)
    rnd = torch.randint(0, lim + 1, (1 << 20,), generator=g, dtype=torch.int64)
    b = torch.cat([b, near.to(torch.int64), rnd])
    b = b[(b >= 0) & (b <= lim)].to(torch.int32)
    for sign in (0, -(1 << 31)):
        y = (b | sign).view(torch.float32)
        got = triton_kernels.soft_fp8_bits_torch(y, fp8 == torch.float8_e4m3fn)
        ref = y.to(fp8).view(torch.uint8)
        bad = (got != ref).nonzero().flatten()
        assert len(bad) == 0, [(float(y[i]), int(ref[i]), int(got[i])) for i in bad[:5]]


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    """As ``_load_f32_bits``: bf16 bits << 16, or the float32 bits (int64 here)."""
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16).to(torch.int64) << 16) & 0xFFFFFFFF
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _i32_to_f32(b: torch.Tensor) -> torch.Tensor:
    return (b & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32)


def _split_subnormal(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_split_subnormal`` in torch (xb: uint32 values in int64)."""
    ax = xb & 0x7FFFFFFF
    is_sub = ax < 0x800000
    sign = xb & 0x80000000
    xs = ax.to(torch.float32) * 2.0**-23
    xs_b = (xs.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | sign
    return is_sub, _i32_to_f32(torch.where(is_sub, xs_b, xb))


def emulate_mx(x2: torch.Tensor, fp8: torch.dtype, blocks: int = triton_kernels.MX_BLOCKS):
    """``_mx_kernel`` program by program (all programs at once) in torch on CPU."""
    r, k = x2.shape
    nb = -(-k // 32)
    n_blocks = r * nb
    grid = -(-n_blocks // blocks)
    emax, fmax = EMAX[fp8], numerics.FP8_MAX[fp8]
    flat = x2.reshape(-1)
    pid = torch.arange(grid, dtype=torch.int64)
    g = pid.view(-1, 1) * blocks + torch.arange(blocks)  # (grid, BLOCKS)
    t = torch.arange(32)
    gmask = g < n_blocks
    if k % 32 == 0:
        offs = g[..., None] * 32 + t
        mask = gmask[..., None].expand_as(offs)
    else:
        rr = g // nb
        col = (g - rr * nb) * 32
        offs = rr[..., None] * k + col[..., None] + t
        mask = gmask[..., None] & ((col[..., None] + t) < k)
    xb = torch.zeros(offs.shape, dtype=torch.int64)
    xb[mask] = _f32_bits(flat)[offs[mask]]
    amax = (xb & 0x7FFFFFFF).amax(-1)
    part = amax.amax(-1)
    e = (((amax >> 23) & 0xFF) - 127 - emax).clamp(-127, 127)
    scales = torch.zeros(grid * blocks, dtype=torch.uint8)
    scales[g[gmask]] = (e + 127)[gmask].to(torch.uint8)
    inv = _i32_to_f32((127 - e) << 23)
    is_sub, num = _split_subnormal(xb)
    y = num * inv[..., None]
    y = torch.where(is_sub, y * 2.0**-126, y).clamp(-fmax, fmax)
    codes = torch.zeros(flat.numel(), dtype=torch.uint8)
    codes[offs[mask]] = triton_kernels.soft_fp8_bits_torch(y, fp8 == torch.float8_e4m3fn)[mask]
    bad = _i32_to_f32(part.amax()).reshape(())
    return codes.view(fp8).view(r, k), scales[:n_blocks].view(r, nb), bad


def emulate_fp8(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``_fp8_cast_kernel`` (and ``_amax_kernel``) in torch on CPU; block index math is 1-D."""
    flat = x.reshape(-1)
    n = flat.numel()
    grid = -(-n // triton_kernels.CAST_BLOCK)
    offs = torch.arange(grid * triton_kernels.CAST_BLOCK)
    mask = offs < n
    xb = torch.zeros(offs.shape, dtype=torch.int64)
    xb[mask] = _f32_bits(flat)
    is_sub, num = _split_subnormal(xb)
    q = num / scale.reshape(())  # float32 / float32: IEEE on CPU, as div_rn
    q = torch.where(is_sub, q * 2.0**-126, q).clamp(-numerics.FP8_MAX[fp8], numerics.FP8_MAX[fp8])
    codes = triton_kernels.soft_fp8_bits_torch(q, fp8 == torch.float8_e4m3fn)[mask]
    return codes.view(fp8).view(x.shape)


SHAPES = [(40, 1056), (40, 1000), (37, 33), (1, 1), (16, 31), (300, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fp8", list(FP8.values()), ids=list(FP8))
def test_emulated_mx_kernel_matches_torch_path(shape, dtype, fp8) -> None:  # noqa: ANN001
    x = make_input(*shape, dtype, fp8)
    ref = quantize(x, "mxfp8", dtype=fp8)
    codes, scales, bad = emulate_mx(x, fp8)
    errs = _report("scale", x, ref.scale, scales) + _report("qdata", x, ref.qdata, codes)
    assert not errs, "\n".join(errs)
    assert float(bad) == float(x.float().abs().max())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fp8", list(FP8.values()), ids=list(FP8))
@pytest.mark.parametrize("kind", ["normal", "tiny"])
def test_emulated_fp8_kernel_matches_torch_path(shape, dtype, fp8, kind) -> None:  # noqa: ANN001
    """``tiny``: the whole tensor scaled into float32's subnormals, so the scale floors at
    2**-126 and subnormal inputs get non-zero codes (the subnormal path of the kernel)."""
    x = rescale(make_input(*shape, torch.float32, fp8), kind).to(dtype)
    for opts in ({}, {"pow2_scale": True}):
        ref = quantize(x, "fp8", dtype=fp8, **opts)
        codes = emulate_fp8(x, ref.scale, fp8)
        errs = _report(f"qdata {opts}", x, ref.qdata, codes)
        assert not errs, "\n".join(errs)
    sub = (x.float().abs() < 2.0**-126) & (x != 0)
    if kind == "tiny" and sub.any():  # the tiny case: subnormal inputs with non-zero codes
        assert (ref.qdata.float()[sub] != 0).any()


def test_import_and_dispatch_without_gpu() -> None:
    """The module imports with or without triton; CPU tensors never take the Triton path."""
    x = torch.randn(64, 64)
    assert not kernels.use_triton(x, "fp8")
    assert not kernels.use_triton(x, "mxfp8")
    info = triton_kernels.info()
    assert set(info) == {"triton", "available", "soft_cvt", "failed"}
    with pytest.raises(ValueError, match="compile"):
        KernelPolicy(compile="maybe")


# ---- CUDA: the Triton kernels against the torch path ----------------------------------------


@pytest.fixture
def paths():  # noqa: ANN201
    """run(fn, triton: bool, soft: bool) -> fn() under the Triton path (its FP8 cast in hardware
    or by integer rounding) or the eager torch path."""

    def run(fn, triton: bool, soft: bool = False):  # noqa: ANN001, ANN202
        with kernel_policy(KernelPolicy(compile="never", triton=triton, soft_fp8_cast=soft)):
            return fn()

    return run


CASES = [
    pytest.param("fp8", {}, id="fp8"),
    pytest.param("fp8", {"dtype": torch.float8_e5m2}, id="fp8_e5m2"),
    pytest.param("fp8", {"pow2_scale": True}, id="fp8_pow2"),
    pytest.param("fp8", {"amax": 1.0}, id="fp8_amax_saturating"),
    pytest.param("fp8_delayed", {}, id="fp8_delayed"),
    pytest.param("mxfp8", {}, id="mxfp8"),
    pytest.param("mxfp8", {"dtype": torch.float8_e5m2}, id="mxfp8_e5m2"),
]
# (256, 1024): a multiple of every kernel's elements per program, so the unmasked (EVEN) paths run
GPU_SHAPES = [(1000, 1056), (1000, 1000), (256, 1024), (1, 1), (16, 31), (3, 5, 64)]


@needs_gpu
@pytest.mark.parametrize("soft", [False, True], ids=["cvt", "softcvt"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt,opts", CASES)
def test_triton_matches_torch_bit_for_bit(fmt, opts, shape, soft, paths) -> None:  # noqa: ANN001
    fp8 = opts.get("dtype", torch.float8_e4m3fn)
    errors: list[str] = []
    for dt in (torch.float32, torch.bfloat16):
        rows, cols = (shape[0] * (shape[1] if len(shape) > 2 else 1), shape[-1])
        base = make_input(rows, cols, torch.float32, fp8)
        for kind in ("normal", "tiny"):
            x = rescale(base, kind).to(dt).reshape(shape).cuda()
            ref = paths(lambda x=x: quantize(x, fmt, **opts), False)
            got = paths(lambda x=x: quantize(x, fmt, **opts), True, soft)
            for name in FORMATS[fmt].tensor_fields:
                errors += _report(f"{dt} {kind} {name}", x, getattr(ref, name), getattr(got, name))
    assert not triton_kernels.failed, triton_kernels.info()
    if errors:
        head = f"{fmt} {opts} {shape} soft={soft} ({triton_kernels.info()}, torch {torch.__version__}):"
        pytest.fail("\n".join([head, *errors]), pytrace=False)


@needs_gpu
def test_triton_path_is_taken() -> None:
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert kernels.use_triton(x, "fp8") and kernels.use_triton(x, "mxfp8")
    quantize(x, "fp8")
    quantize(x, "mxfp8")
    assert not triton_kernels.failed, triton_kernels.info()
    assert not kernels.use_triton(x.t(), "fp8")  # non-contiguous: torch path
    assert not kernels.use_triton(x.half(), "fp8")  # float16: torch path


@needs_gpu
@pytest.mark.parametrize("fmt,opts", [("fp8", {}), ("fp8", {"amax": 1.0}), ("mxfp8", {})])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_triton_refuses_nan_inf(fmt: str, opts: dict, bad: float) -> None:
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(100, 96, device="cuda", dtype=dt)
        x[57, 33] = bad
        with pytest.raises(FormatError, match="NaN|Inf"):
            quantize(x, fmt, **opts)


@needs_gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp8_delayed", "mxfp8"])
def test_triton_temporaries_are_bounded(fmt: str) -> None:
    """512 MiB bf16: quantize allocates its outputs plus the per-program maxima (numel / 4096
    int32 at most) and a few scalars; quantize_ allocates only those."""
    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    q = quantize(x, fmt)  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    bound = x.numel() // triton_kernels.CAST_BLOCK * 4 + (1 << 20)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q2 = quantize(x, fmt)
    torch.cuda.synchronize()
    out = sum(t.numel() * t.element_size() for t in q2.fields().values())
    temps = torch.cuda.max_memory_allocated() - base - out
    print(f"{fmt} triton: temporaries {temps / 2**20:.2f} MiB (bound {bound / 2**20:.1f})")
    assert temps <= bound
    del q2
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q.quantize_(x, update_state=False)
    torch.cuda.synchronize()
    temps = torch.cuda.max_memory_allocated() - base
    print(f"{fmt} triton: quantize_ temporaries {temps / 2**20:.2f} MiB")
    assert temps <= bound
    assert not triton_kernels.failed, triton_kernels.info()


@needs_gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp8_delayed"])
def test_nan_input_leaves_the_destination_untouched(fmt: str) -> None:
    """The amax's NaN/Inf check comes after the cast (no host sync in between); the kernel
    reads the amax and writes nothing, so a refused ``quantize_`` changes no code."""
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    q = quantize(x, fmt)
    before = {k: v.clone() for k, v in q.fields().items()}
    y = torch.randn_like(x) * 7
    y[123, 45] = float("nan")
    with pytest.raises(FormatError, match="NaN"):
        q.quantize_(y)
    for k, v in q.fields().items():
        assert torch.equal(
            v.reshape(-1).view(torch.uint8), before[k].reshape(-1).view(torch.uint8)
        ), k


if triton is not None:

    @triton.jit
    def _fast_div_check(out_ptr, e_x, e_s, BLOCK: tl.constexpr):
        """Mismatches of the fp8 kernel's fast division against div_rn: this program's BLOCK
        float32 significands of the scale (exponent e_s) against all 128 bfloat16
        significands of x (exponent e_x), with x's sign both ways."""
        ms = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        s = (((127 + e_s) << 23) | ms).to(tl.float32, bitcast=True)
        r = tl.div_rn(1.0, s)
        bad = tl.zeros((BLOCK,), dtype=tl.int32)
        for k in range(256):
            xb = ((127 + e_x) << 23) | ((k & 127) << 16)
            x = tl.full((BLOCK,), xb, tl.int32).to(tl.float32, bitcast=True)
            if k >= 128:
                x = -x
            ref = tl.div_rn(x, s)
            q = triton_kernels.fast_div(x, s, r)
            same = q.to(tl.int32, bitcast=True) == ref.to(tl.int32, bitcast=True)
            bad += tl.where(same, 0, 1)
        tl.store(out_ptr + tl.program_id(0), tl.sum(bad, axis=0))


@needs_gpu
@pytest.mark.parametrize(
    "e_x,e_s",
    [(0, 0), (0, 60), (0, -60), (-78, -60), (120, 60), (-100, -60), (127, 60), (60, -60)],
)
def test_fast_division_equals_ieee_division_for_every_bfloat16(e_x: int, e_s: int) -> None:
    """The fp8 cast divides bfloat16 x by a scale in [2**-60, 2**60] as ``x * r`` (r = 1/s)
    corrected by one fma. A quotient's rounding depends only on the significands while the
    result is a normal float32, so every bfloat16 significand (128, both signs) against every
    float32 significand (2**23) at these exponents covers the whole range: 2**31 divisions."""
    block = 1024
    out = torch.empty((1 << 23) // block, dtype=torch.int32, device="cuda")
    _fast_div_check[(out.numel(),)](out, e_x, e_s, BLOCK=block)
    assert int(out.sum()) == 0
