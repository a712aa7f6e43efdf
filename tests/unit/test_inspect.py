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


def _without_light(insp, path):
    """What ``inspect`` says when torch's classes read the metadata (the light reader off)."""
    real = insp.light_dcp
    insp.light_dcp = lambda p: None
    try:
        return insp.inspect_path(path)
    finally:
        insp.light_dcp = real


def test_the_torch_free_dcp_reader_says_what_torchs_classes_say(tmp_path):
    """``inspect`` of a plain DCP dir reads its metadata without torch (issue 30): the same dict
    as the full reader, byte entries, several chunks and another dtype included; a training
    framework's dir, an unknown class, a truncated data file and a missing one go to the full
    reader (which words the error)."""
    import pickle

    from qckpt import inspect as insp
    from tests.unit.test_training_sources import MEGATRON, TITAN

    sd = {
        "a.weight": torch.ones(4, 8, dtype=torch.bfloat16),
        "b": torch.zeros(3),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "f8": torch.zeros(2, 2).to(torch.float8_e4m3fn),
        "extra": {"step": 3, "note": "bytes"},
    }
    d = tmp_path / "dcp"
    dcp.save(sd, checkpoint_id=str(d), no_dist=True)
    light = insp.light_dcp(d)
    assert light is not None and light[""] == {"non_tensor_items": 2}
    got = insp.inspect_path(d)
    assert got == _without_light(insp, d)
    assert got["dtypes"] == {"BF16": 1, "F32": 1, "F8_E4M3": 1, "I64": 1}, got
    assert got["non_tensor_items"] == 2

    for fw in (MEGATRON / "moe_ep2", TITAN / "qwen3_moe"):
        assert insp.light_dcp(fw) is None, fw  # the full reader names the framework
    # a class the allow-list does not know: refused by the full reader, in its words
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(__import__("collections").Counter()))
    assert insp.light_dcp(bad) is None
    r, _ = _inspect(bad, tmp_path)
    assert r.returncode == 1 and "refusing to load collections.Counter" in r.stderr, r.stderr
    # a data file cut short, then gone: the full reader's error
    data = next(d.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    assert insp.light_dcp(d) is None
    r, _ = _inspect(d, tmp_path)
    assert r.returncode == 1 and "truncated" in r.stderr, r.stderr
    data.unlink()
    assert insp.light_dcp(d) is None
    r, _ = _inspect(d, tmp_path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
