import json

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from qckpt.models.build import build_model
from tests.conftest import run_qckpt


def _inspect(path, tmp_path):
    out = tmp_path / "i.json"
    r = run_qckpt("inspect", str(path), "--json", str(out))
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_inspect_dcp_hf_and_file(tmp_path):
    sd = {"a.weight": torch.ones(4, 8, dtype=torch.bfloat16), "b": torch.zeros(3)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r, info = _inspect(tmp_path / "dcp", tmp_path)
    assert r.returncode == 0, r.stderr
    assert info["kind"] == "dcp" and info["tensors"] == 2 and info["bytes"] == 4 * 8 * 2 + 3 * 4
    assert info["largest"]["name"] == "a.weight"
    assert "dcp" in r.stdout  # the result goes to stdout

    build_model("tiny-dense").save_pretrained(str(tmp_path / "hf"))
    r, info = _inspect(tmp_path / "hf", tmp_path)
    assert r.returncode == 0, r.stderr
    assert info["kind"] == "hf" and info["model_type"] == "llama" and info["dtypes"] == {"BF16": 21}

    save_file({"x": torch.zeros(2, 2)}, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    r, info = _inspect(tmp_path / "x.safetensors", tmp_path)
    assert r.returncode == 0 and info["kind"] == "safetensors" and info["metadata"] == {"k": "v"}


def test_inspect_garbage_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01\x02")
    r, _ = _inspect(bad, tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("qckpt: error:") and len(r.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    r, _ = _inspect(empty, tmp_path)
    assert r.returncode == 1 and "no .metadata (DCP) and no *.safetensors (HF)" in r.stderr
