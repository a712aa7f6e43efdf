"""Expert parallelism over NCCL on 2 GPUs (EP2): forward and calibration match one GPU.

python -m pytest -q -s tests/gpu/test_ep_nccl.py      # on nvidia-h200-x2
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def test_ep2_over_nccl_matches_one_gpu(tmp_path):
    out = tmp_path / "ep.jsonl"
    worker = Path(__file__).with_name("ep_nccl_worker.py")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(worker), str(out)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    (tmp_path / "stderr.log").write_text(r.stderr)
    if r.returncode != 0:
        errs = out.read_text() if out.exists() else ""
        lines = [ln for ln in r.stderr.splitlines() if "rror" in ln or "what()" in ln]
        raise AssertionError("EP2 worker failed:\n" + errs + "\n".join(lines[:40]))
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2
    for rec in recs:
        print(json.dumps(rec))
        assert rec["backend"] == "nccl"
        assert rec["amax_keys_equal"]
        # GPU matmuls need not be batch-invariant, so allow bf16 rounding differences here
        assert rec["logits_max_abs_diff"] < 5e-2
        assert rec["amax_max_rel_diff"] < 2e-2
