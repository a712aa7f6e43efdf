"""vLLM serves qckpt's NVFP4 exports of the shared real-text Llama within 3 % of the BF16 model's
held-out bits per byte (compressed-tensors and ModelOpt layouts).

On today's Hopper machines vLLM 0.26 runs NVFP4 as Marlin W4A16 (weights in NVFP4, activations in
BF16) and keeps one global scale per fused weight (q/k/v, gate/up); before the export gave those
parts one global scale (qckpt/export/shared_scales.py) this served the model at 4.78 bits per
byte against BF16's 1.09. Needs CUDA, vLLM (``QCKPT_VLLM_SITE``, default ``/tmp/site``) and the
quality folder (``QCKPT_QUALITY``, default ``../shared/quality`` beside the repo). Extra export
dirs to score beside ours (another tool's, say): ``QCKPT_VLLM_EXTRA=name=dir,name=dir``; their
figures land in the JSON (``QCKPT_VLLM_QUALITY_JSON``) but are not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.vllm.matrix import VLLM_ENV

REPO = Path(__file__).resolve().parents[3]
QUALITY = Path(os.environ.get("QCKPT_QUALITY", REPO.parent / "shared" / "quality"))
SITE = os.environ.get("QCKPT_VLLM_SITE", "/tmp/site")
HAVE_VLLM = Path(SITE, "vllm").is_dir()
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_VLLM and (QUALITY / "heldout.bin").is_file()),
    reason="needs CUDA, vLLM and the shared quality folder",
)
HERE = Path(__file__).parent

RECIPE = """\
model: {{source: {model}, dtype: bfloat16}}
checkpoint: {{path: {model}}}
load: {{params: none}}
quant:
  weights: {{format: nvfp4}}
  inputs: {{format: nvfp4, dynamic: false}}
  ignore: ["lm_head"]
calibrate:
  data: {{source: text, path: {calib}, num_samples: 128, seq_len: 512, batch_size: 16}}
  output: {work}/calib.safetensors
parallel: {{timeout_s: 120}}
export: {{format: {layout}, output: {work}/{layout}}}
"""


def heldout_windows(n: int = 64, seq: int = 512) -> torch.Tensor:
    """The quality README's windows: 64 x 513 bytes of heldout.bin, starts from seed 7."""
    data = torch.frombuffer(bytearray((QUALITY / "heldout.bin").read_bytes()), dtype=torch.uint8)
    g = torch.Generator().manual_seed(7)
    starts = torch.randint(0, data.numel() - seq - 1, (n,), generator=g)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()


def _qckpt(*args: str, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "qckpt", *args], cwd=cwd, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:]


def score_all(dirs: dict[str, Path], windows: Path, work: Path) -> dict[str, dict]:
    """vLLM's bits per token of each model dir, all engines at once (one process each)."""
    env = dict(os.environ, **VLLM_ENV, PYTHONPATH=SITE)
    procs = {}
    for name, d in dirs.items():
        log = open(work / f"{name}.vllm.log", "w")
        cmd = [sys.executable, str(HERE / "score_one.py"), str(d), str(windows)]
        cmd.append(str(work / f"{name}.vllm.json"))
        procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    out = {}
    for name, p in procs.items():
        rc = p.wait(timeout=600)
        f = work / f"{name}.vllm.json"
        if rc == 0 and f.is_file():
            out[name] = json.loads(f.read_text())
        else:
            tail = (work / f"{name}.vllm.log").read_text(errors="replace")[-1500:]
            out[name] = {"error": f"exit {rc}: {tail}"}
    return out


def test_vllm_serves_nvfp4_exports_within_3_percent(tmp_path):
    model = QUALITY / "models" / "llama-textlm"
    windows = tmp_path / "windows.pt"
    torch.save(heldout_windows(), windows)
    dirs = {"bf16": model}
    for i, layout in enumerate(("compressed-tensors", "modelopt")):
        recipe = tmp_path / f"{layout}.yaml"
        recipe.write_text(
            RECIPE.format(model=model, calib=QUALITY / "calib.bin", work=tmp_path, layout=layout)
        )
        if i == 0:
            _qckpt("calibrate", str(recipe), cwd=tmp_path)
        _qckpt("export", str(recipe), cwd=tmp_path)
        dirs[f"nvfp4-{layout}"] = tmp_path / layout
    for item in filter(None, os.environ.get("QCKPT_VLLM_EXTRA", "").split(",")):
        name, _, d = item.partition("=")
        dirs[name] = Path(d)
    res = score_all(dirs, windows, tmp_path)
    dump = os.environ.get("QCKPT_VLLM_QUALITY_JSON")
    if dump:
        Path(dump).write_text(json.dumps(res, indent=1))
    bf16 = res["bf16"]["bits_per_token"]
    assert abs(bf16 - 1.0927) < 0.002, res["bf16"]
    for layout in ("compressed-tensors", "modelopt"):
        r = res[f"nvfp4-{layout}"]
        assert "error" not in r, (layout, r["error"])
        assert r["bits_per_token"] <= bf16 * 1.03, (layout, r["bits_per_token"], bf16)
