"""vLLM serves every export layout of two checkable models with the BF16 model's tokens.

Runs ``matrix.py`` (train a Llama and a Qwen3-MoE on strided counting, export both layouts x
three schemes, serve each in vLLM, one process per engine). Needs CUDA and vLLM, importable or
installed in ``QCKPT_VLLM_SITE`` (default ``/tmp/site``, where ``shared/device-vllm`` puts it);
about three minutes on an H200. The results it gave are in docs/CLIENTS.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from tests.gpu.vllm import matrix

SITE = os.environ.get("QCKPT_VLLM_SITE", "/tmp/site")
HAVE_VLLM = Path(SITE, "vllm").is_dir() or importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_VLLM), reason="needs CUDA and vLLM"
)
# vLLM 0.26 cannot load per-channel weight scales of MoE experts in the ModelOpt layout;
# ModelOpt's own export fails the same way (docs/CLIENTS.md)
KNOWN_REFUSED = {"moe-modelopt-channel"}


def test_every_layout_serves_the_bf16_models_tokens(tmp_path):
    out = tmp_path / "vllm.json"
    site = SITE if Path(SITE, "vllm").is_dir() else os.environ.get("PYTHONPATH", "")
    assert matrix.main(["--out", str(out), "--work", str(tmp_path / "w"), "--site", site]) == 0
    res = json.loads(out.read_text())
    for kind, m in res["models"].items():
        assert m["hf_bf16_task_accuracy"] >= 0.95, kind  # the model is checkable
    for r in res["rows"]:
        if r["name"] in KNOWN_REFUSED:
            assert not r["accepted"], r["name"]
            continue
        assert "export_error" not in r, r
        assert r["accepted"], (r["name"], r.get("error"))
        assert r["agreement"] >= 0.95, (r["name"], r["agreement"])
        assert r["name_problems"] == [], r["name_problems"]
