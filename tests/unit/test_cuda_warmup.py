"""The start-up's CUDA warm-up (``qckpt.pipeline.imports``, issue 18): while the model's code
imports, a thread quantizes small tensors of the load's format through the planner's calls (so
Triton compiles there, not at the load's first quantized destination) and makes and drops the
fast read's pinned buffers. CUDA is faked or the quantize runs on the CPU (this machine has no
GPU); tests/gpu/test_cuda_warmup_gpu.py checks the real thing."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from qckpt.pipeline import imports
from qckpt.recipe import Recipe
from tests.conftest import ROOT, run_qckpt

PARAMS = ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]


@pytest.mark.parametrize("fmt", PARAMS)
def test_warm_quantize_runs_the_formats_quantize_on_2d_and_3d_weights(monkeypatch, fmt):
    """The format's own ``quantize_into`` on a 2-D and a 3-D (fused experts) tensor of the
    model's dtype, inside ``defer_finite_checks`` as at the planner's commit, and under the
    caller's kernel policy with torch.compile off."""
    from qckpt import formats
    from qckpt.formats import numerics
    from qckpt.kernel_policy import KernelPolicy, current_policy, kernel_policy

    spec = formats.FORMATS[fmt]
    seen: list[tuple] = []
    real = type(spec).quantize_into

    def spy(self, q, x, update_state=True, *, amax=None):
        pol = current_policy()
        deferred = numerics.finite_checks_deferred()
        seen.append(
            (tuple(x.shape), x.dtype, update_state, amax, deferred, pol.triton, pol.compile)
        )
        return real(self, q, x, update_state, amax=amax)

    monkeypatch.setattr(type(spec), "quantize_into", spy)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    plan = imports.CudaWarmup(params=fmt, dtype="bfloat16")
    with kernel_policy(KernelPolicy(triton=False, compile="always")):
        imports.warm_quantize(plan, torch.device("cpu"))
    assert [s[0] for s in seen] == [tuple(s) for s in imports.WARM_SHAPES]
    assert [len(s) for s in imports.WARM_SHAPES] == [2, 3]
    assert all(s[1:] == (torch.bfloat16, False, None, True, False, "never") for s in seen), seen
    # every shape's numel keeps the 1-D kernels' EVEN (amax 8192 x 8, cast 4096 x 4) and % 16
    for shape in imports.WARM_SHAPES:
        assert torch.Size(shape).numel() % (8192 * 8) == 0 and shape[-1] % 32 == 0

    # a sharded load: the whole-tensor amax path too (formats with per-block scales refuse it:
    # swallowed, the other shapes still run)
    seen.clear()
    imports.warm_quantize(
        imports.CudaWarmup(params=fmt, dtype="float32", whole_amax=True), torch.device("cpu")
    )
    assert [s[1] for s in seen] == [torch.float32] * 4
    assert [s[3] is None for s in seen] == [True, False, True, False]

    seen.clear()
    imports.warm_quantize(imports.CudaWarmup(params="none"), torch.device("cpu"))
    assert seen == []


def test_the_warmup_thread_runs_its_steps_on_the_ranks_gpu_and_swallows_failures(monkeypatch):
    """The quantize and the pinned buffers run on the thread after the context, with the
    plan, on LOCAL_RANK's GPU, in the caller's context; one failing does not stop the other
    nor reach the caller. CUDA faked."""
    from qckpt.kernel_policy import KernelPolicy, current_policy, kernel_policy

    calls: list[tuple] = []
    real_empty = torch.empty

    def fake_empty(*a, **kw):
        dev = kw.get("device")
        if getattr(dev, "type", None) == "cuda":
            return real_empty(*a)
        return real_empty(*a, **kw)

    def step(name, fail):
        def run(plan, dev):
            calls.append((name, threading.current_thread().name, plan, dev, current_policy()))
            if fail:
                raise RuntimeError(f"{name} failed")

        return run

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(imports, "warm_quantize", step("quantize", True))
    monkeypatch.setattr(imports, "warm_pinned", step("pinned", False))
    plan = imports.CudaWarmup(params="mxfp8", pinned_buffers=3)
    pol = KernelPolicy(triton=False)
    with kernel_policy(pol):
        imports.warm_imports(None, "json", cuda_first_use=plan)  # no exception comes out
    main = threading.current_thread().name
    assert [c[0] for c in calls] == ["quantize", "pinned"], calls
    for _, thread, p, dev, policy in calls:
        assert thread != main and p is plan and dev == torch.device("cuda", 1)
        assert policy is pol


def test_warm_pinned_makes_and_drops_the_buffers(monkeypatch):
    made: list[tuple] = []
    real_empty = torch.empty

    def fake_empty(*a, **kw):
        if kw.get("pin_memory"):
            made.append((a, kw["dtype"]))
            kw = {k: v for k, v in kw.items() if k != "pin_memory"}
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch, "empty", fake_empty)
    imports.warm_pinned(imports.CudaWarmup(pinned_buffers=3, pinned_bytes=4096), None)
    assert made == [((4096,), torch.uint8)] * 3


def test_the_pinned_plan_mirrors_the_fast_reads_pool(tmp_path):
    from qckpt.read import fast_read

    threads = fast_read.default_threads()
    pool = threads + 2 + fast_read.READ_AHEAD_BYTES // fast_read.CHUNK_BYTES
    (tmp_path / "a.distcp").write_bytes(b"x" * 100)
    assert imports.pinned_buffers(str(tmp_path)) == 1  # no more than the files fill
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "b.safetensors", "wb") as f:  # sparse: no disk used
        f.truncate(1000 * fast_read.CHUNK_BYTES)
    assert imports.pinned_buffers(str(big)) == pool
    assert imports.pinned_buffers(str(tmp_path / "missing")) == 0


def test_the_cli_warms_cuda_recipes_unless_told_not_to():
    r = Recipe()
    r.load.device, r.load.params = "auto", "mxfp8"
    plan = imports.cuda_warmup(r, "load", {})
    assert plan is not None and plan.params == "mxfp8" and plan.dtype == r.model.dtype
    assert not plan.whole_amax
    assert imports.cuda_warmup(r, "load", {"QCKPT_CUDA_WARMUP": "0"}) is None
    r.load.reader = "plain"
    assert imports.cuda_warmup(r, "load", {}).pinned_buffers == 0  # no pinned pool there
    r.load.backend = "te"
    assert imports.cuda_warmup(r, "load", {}).params == "none"  # TE's kernels are its own
    r.calibrate.weights_resident = "fp8"
    assert imports.cuda_warmup(r, "calibrate", {}).params == "fp8"
    r.calibrate.weights_resident = "bf16"
    assert imports.cuda_warmup(r, "calibrate", {}).params == "none"
    r.parallel.ep = 2
    assert imports.cuda_warmup(r, "calibrate", {}).whole_amax
    r.load.device = "cpu"
    assert imports.cuda_warmup(r, "load", {}) is None
    assert imports.cuda_warmup(r, "calibrate", {"QCKPT_CUDA_WARMUP": "1"}) is None


def test_a_failing_warmup_thread_does_not_fail_the_load(tmp_path):
    """A real ``qckpt load`` (CPU) whose warm-up thread fails at its first CUDA call: the
    command loads and exits 0, the failure silent."""
    recipe = str(ROOT / "configs" / "tiny-moe.yaml")
    r = run_qckpt("convert", recipe, "dcp", "--set", "checkpoint.path=dcp", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    code = (
        "import threading, sys, torch\n"
        "real = torch.cuda.is_available\n"
        "seen = []\n"
        "def fake():\n"
        "    if threading.current_thread().name == 'qckpt-cuda-first-use':\n"
        "        seen.append(1)\n"
        "        raise RuntimeError('CUDA driver exploded')\n"
        "    return real()\n"
        "torch.cuda.is_available = fake\n"
        "from qckpt.cli.app import main\n"
        "try:\n    main(sys.argv[1:])\n    rc = 0\n"
        "except SystemExit as e:\n    rc = e.code if isinstance(e.code, int) else 1\n"
        "print('RESULT', rc, len(seen))\n"
    )
    argv = ["load", recipe, "--set", "checkpoint.path=dcp", "--set", "load.device=auto"]
    p = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert line == ["RESULT 0 1"], (p.stdout[-2000:], p.stderr[-2000:])
    assert "exploded" not in p.stderr and "loaded" in p.stdout + p.stderr
