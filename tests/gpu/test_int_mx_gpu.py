"""The integer and MX codes on CUDA are the CPU's bit for bit: INT4 / INT8 scales, codes and
int32 packing, MXFP4 exponents and packed codes, the INT8 input quantization ``qckpt eval``
applies, and whole exports of INT4 W4A16, INT8 W8A8 and MXFP4 W4A16 made on the GPU against
the same exports made on the CPU. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weight(rows: int = 2048, cols: int = 4096, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.05
    w[:, 11] *= 30.0  # outlier columns, as real weights have
    w[7, :64] = 0.0  # zero groups
    return w.to(torch.bfloat16)


def test_mx_codes_on_cuda_are_the_cpus():
    from qckpt.formats.mx_codes import mx_quantize, mxfp4_values, mxfp8_input

    w = _weight()
    p_cpu, s_cpu = mx_quantize(w, 4)
    p_gpu, s_gpu = mx_quantize(w.cuda(), 4)
    assert torch.equal(p_cpu, p_gpu.cpu()) and torch.equal(s_cpu, s_gpu.cpu())
    assert torch.equal(mxfp4_values(p_cpu, s_cpu), mxfp4_values(p_gpu, s_gpu).cpu())
    c_cpu, s_cpu = mx_quantize(w, 8)
    c_gpu, s_gpu = mx_quantize(w.cuda(), 8)
    assert torch.equal(c_cpu.view(torch.uint8), c_gpu.cpu().view(torch.uint8))
    assert torch.equal(s_cpu, s_gpu.cpu())
    assert torch.equal(mxfp8_input(w * 50), mxfp8_input((w * 50).cuda()).cpu())


@pytest.mark.parametrize(("qmax", "code_range", "group", "bits"), [
    (7.5, (-8, 7), 128, 4), (127.5, (-128, 127), 0, 8)])  # fmt: skip
def test_integer_codes_on_cuda_are_the_cpus(qmax, code_range, group, bits):
    from qckpt.formats.intq import int_codes, int_scale, pack_int32, unpack_int32

    w = _weight()
    rows, cols = w.shape

    def run(x):
        a = x.float().abs()
        a = a.reshape(rows, cols // group, group).amax(-1) if group else a.amax(-1)
        s = int_scale(a, qmax, torch.bfloat16)
        c = int_codes(x, s, code_range, group)
        return s.cpu(), c.cpu(), pack_int32(c, bits).cpu()

    cpu, gpu = run(w), run(w.cuda())
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(unpack_int32(gpu[2].cuda(), bits, cols).cpu(), cpu[1])


@pytest.mark.parametrize("mode", ["int8_token", "int8_static"])
def test_int8_input_quantization_on_cuda_is_the_cpus(mode):
    from qckpt.formats.act_quant import InputQuant, quantize_input

    x = _weight(512, 4096, seed=3) * 40
    scale = torch.tensor(0.03) if mode == "int8_static" else None
    got = quantize_input(x.cuda(), InputQuant(mode, scale)).cpu()
    assert torch.equal(got, quantize_input(x, InputQuant(mode, scale)))


@pytest.mark.parametrize(("name", "weights", "inputs"), [
    ("w4a16", {"format": "int4", "granularity": "group", "block_size": [32]}, {"format": "none"}),
    ("w8a8", {"format": "int8", "granularity": "channel"}, {"format": "int8", "dynamic": True}),
    ("w8a8-static", {"format": "int8", "granularity": "tensor"}, {"format": "int8"}),
    ("mxfp4", {"format": "mxfp4"}, {"format": "none"}),
    ("mxfp8", {"format": "mxfp8"}, {"format": "mxfp8", "dynamic": True}),
])  # fmt: skip
def test_gpu_export_equals_cpu_export(tmp_path: Path, name, weights, inputs):
    from tests._inproc import run_main
    from tests.e2e.tiny_exports import tiny_recipe

    base = tiny_recipe(tmp_path, "base", {"format": "fp8"}, {"format": "fp8"})
    assert run_main("convert", str(base), str(tmp_path / "dcp")).returncode == 0
    trees = []
    for device in ("cpu", "cuda"):
        rec = tiny_recipe(tmp_path, f"{name}-{device}", weights, inputs,
                          export={"device": device})  # fmt: skip
        for cmd in ("calibrate", "export"):
            r = run_main(cmd, str(rec))
            assert r.returncode == 0, r.stderr[-2000:]
        out = tmp_path / f"{name}-{device}" / "out"
        trees.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    cpu, gpu = trees
    assert sorted(cpu) == sorted(gpu)
    for f in cpu:
        assert cpu[f] == gpu[f], (name, f)
