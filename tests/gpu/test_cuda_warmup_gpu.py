"""The start-up's CUDA warm-up on a GPU (issue 18): after it, the load's quantized
destinations compile no Triton kernel (the entries of an empty ``TRITON_CACHE_DIR`` are the
same before and after the load), and the fast load's values equal the plain reader's.

Skipped without CUDA. Each case is a fresh process: Triton keeps compiled kernels in memory too,
so only a process that has not quantized yet shows what the warm-up made ready."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# the weights: (2048, 2048) and (2048, 768), the dims WARM_SHAPES was chosen for (numel a
# multiple of 65536; mxfp8 blocks per row 64 and 24)
SCRIPT = r"""
import json, os, sys
import torch
from torch import nn

from qckpt.pipeline.imports import CudaWarmup, warm_imports

fmt, ckpt = sys.argv[1], sys.argv[2]
cache = os.environ["TRITON_CACHE_DIR"]


def entries():
    return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


plan = CudaWarmup(params=fmt, dtype="bfloat16", pinned_buffers=2)
warm_imports(None, "qckpt.load.loader", cuda_first_use=plan)
warmed = entries()

from qckpt.load.loader import load_checkpoint
from qckpt.formats import triton_kernels
from qckpt.models.quantize_params import quantize_model_params
from tests.toy import same_tensor


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16, device="meta")
        self.b = nn.Linear(768, 2048, bias=False, dtype=torch.bfloat16, device="meta")


def model():
    m = Two()
    quantize_model_params(m, fmt)
    return m.to_empty(device="cuda")


fast = model()
load_checkpoint(fast, ckpt, reader="fast")
loaded = entries()
plain = model()
load_checkpoint(plain, ckpt, reader="plain")
sa, sb = fast.state_dict(keep_vars=True), plain.state_dict(keep_vars=True)
out = {
    "usable": triton_kernels.usable("mxfp8" if fmt == "mxfp8" else "fp8"),
    "warmed": warmed,
    "loaded": loaded,
    "same": all(same_tensor(sa[k], sb[k]) for k in sa),
}
print("RESULT", json.dumps(out))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from qckpt.convert.dcp import save_model_dcp

    g = torch.Generator().manual_seed(0)
    sd = {
        "a.weight": torch.randn(2048, 2048, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(2048, 768, generator=g).to(torch.bfloat16),
    }
    root = tmp_path_factory.mktemp("warmup")
    save_model_dcp(sd, root / "dcp")
    return root / "dcp"


@pytest.mark.parametrize("fmt", ["fp8", "fp8_delayed", "mxfp8"])
def test_after_the_warmup_the_load_compiles_no_triton_kernel(ckpt, tmp_path, fmt):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, fmt, str(ckpt)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    out = json.loads(line[0][len("RESULT ") :])
    assert out["same"], fmt
    if not out["usable"]:
        pytest.skip("the Triton kernels are not usable on this GPU")
    assert out["warmed"], "the warm-up compiled nothing"
    assert out["loaded"] == out["warmed"], "the load compiled Triton kernels the warm-up missed"
