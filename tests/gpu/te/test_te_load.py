"""The streaming loader on Transformer Engine destinations (skipped without TE and CUDA).

The loader's test list, on TE's quantized parameters (``load.backend: te``): stream == bulk,
delayed-scaling amax history and scale untouched, plain tensors untouched, no planner state
after a load, prepended axes unwrapped with ``view``, and a checkpoint saved on 2 ranks loading
on 1 with the values of an unsharded load (per-tensor scaling quantized once, from the whole).
Formats: Float8Tensor (delayed and current scaling) and Float8BlockwiseQTensor; MXFP8 and NVFP4
need a Blackwell GPU (TE cannot dequantize them on Hopper), so they run only where supported.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs TE"),
]

DIM, OUT = 512, 1024
HOPPER_FORMATS = ["fp8_delayed", "fp8", "fp8_block"]


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10


FORMATS = HOPPER_FORMATS + (["mxfp8", "nvfp4"] if _blackwell() else [])


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        kw = {"dtype": torch.bfloat16, "device": "cuda"}
        self.up = nn.Linear(DIM, OUT, bias=False, **kw)
        self.down = nn.Linear(OUT, DIM, bias=True, **kw)
        self.norm = nn.LayerNorm(DIM, **kw)


def _checkpoint_sd(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in (("up.weight", (OUT, DIM)), ("down.weight", (DIM, OUT))):
        w = torch.randn(shape, generator=g)
        # rows differ in magnitude: a per-slice scale would differ from the whole-tensor scale
        w *= 2.0 ** ((torch.arange(shape[0]) % 8) - 4).float().view(-1, 1)
        sd[name] = w.to(torch.bfloat16)
    sd["down.bias"] = torch.randn(DIM, generator=g).to(torch.bfloat16)
    sd["norm.weight"] = torch.randn(DIM, generator=g).to(torch.bfloat16)
    sd["norm.bias"] = torch.randn(DIM, generator=g).to(torch.bfloat16)
    return sd


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    sd = _checkpoint_sd()
    path = tmp_path_factory.mktemp("te") / "dcp"
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path, sd


def _te_model(fmt: str) -> nn.Module:
    from qckpt.models.quantize_params import quantize_model_params

    m = Tiny()
    done = quantize_model_params(m, fmt, backend="te", ignore=[])
    assert set(done) == {"up.weight", "down.weight"}
    return m


def _deq(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: m.get_submodule(k.rpartition(".")[0]).weight.dequantize(dtype=torch.float32)
            for k in ("up.weight", "down.weight")}  # fmt: skip


def _history(m: nn.Module) -> list[torch.Tensor]:
    out = []
    for mod in (m.up, m.down):
        meta = getattr(mod, "fp8_meta", {}) or {}
        st = meta.get("scaling_fwd")
        if st is not None:
            out += [st.amax_history, st.scale]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_equals_bulk_and_plain_tensors_are_untouched(ckpt, fmt):
    from qckpt.load.loader import load_checkpoint

    path, sd = ckpt
    a, b = _te_model(fmt), _te_model(fmt)
    ra = load_checkpoint(a, path, stream=True)
    load_checkpoint(b, path, stream=False)
    da, db = _deq(a), _deq(b)
    for k in da:
        assert torch.equal(da[k], db[k]), k
        # and the value is the checkpoint's, within the format's error
        ref = sd[k].float().cuda()
        rel = (da[k] - ref).norm() / ref.norm()
        assert rel < 0.1, (k, float(rel))
    for k in ("down.bias", "norm.weight", "norm.bias"):
        assert torch.equal(a.state_dict()[k].cpu(), sd[k]), k
    assert ra.tensors_per_format.get(f"te:{type(a.up.weight).__name__}") == 2


def test_delayed_scaling_history_and_scale_untouched(ckpt):
    from qckpt.load.loader import load_checkpoint

    path, _ = ckpt
    m = _te_model("fp8_delayed")
    state = _history(m)
    assert state, "DelayedScaling params must carry fp8_meta amax history"
    with torch.no_grad():
        for i, t in enumerate(state):
            t.fill_(0.5 + i)  # a sentinel no quantize would write
    before = [t.clone() for t in state]
    load_checkpoint(m, path, stream=True)
    for t, b in zip(_history(m), before, strict=True):
        assert torch.equal(t, b)


def test_planner_holds_nothing_after_a_load(ckpt):
    from qckpt.load.planner import StreamingDequantLoadPlanner
    from qckpt.load.preflight import destinations
    from qckpt.storage.dcp_metadata import SafeFileSystemReader

    path, _ = ckpt
    m = _te_model("fp8")
    reader = SafeFileSystemReader(str(path))
    state = destinations(m, reader.read_metadata())
    planner = StreamingDequantLoadPlanner()
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner, no_dist=True)
    left = planner.pending()
    assert left["destinations"] == 0 and left["scratch_buffers"] == 0 and left["scratch_bytes"] == 0


def test_prepended_axes_are_unwrapped_with_view(tmp_path):
    from qckpt.load.loader import load_checkpoint

    sd = _checkpoint_sd(1)
    big = ("up.weight", "down.weight")
    wrapped = {k: (v.view(1, 1, *v.shape) if k in big else v) for k, v in sd.items()}
    dcp.save(wrapped, checkpoint_id=str(tmp_path / "p"), no_dist=True)
    dcp.save(sd, checkpoint_id=str(tmp_path / "q"), no_dist=True)
    a, b = _te_model("fp8"), _te_model("fp8")
    load_checkpoint(a, tmp_path / "p")
    load_checkpoint(b, tmp_path / "q")
    da, db = _deq(a), _deq(b)
    for k in da:
        assert torch.equal(da[k], db[k]), k


def _save_on_two_ranks(rank, world, out):
    from qckpt.convert.dcp import save_model_dcp

    save_model_dcp(_checkpoint_sd(2), out)
    return True


def test_checkpoint_saved_on_two_ranks_loads_on_one(tmp_path):
    from qckpt.load.loader import load_checkpoint
    from tests.dist.harness import run_once

    out = run_once(_save_on_two_ranks, 2, str(tmp_path / "sharded"), deadline_s=120)
    assert all(o.ok for o in out), [o.error for o in out]
    dcp.save(_checkpoint_sd(2), checkpoint_id=str(tmp_path / "whole"), no_dist=True)
    a, b = _te_model("fp8"), _te_model("fp8")
    rep = load_checkpoint(a, tmp_path / "sharded")
    load_checkpoint(b, tmp_path / "whole")
    assert rep.read_items > 5  # the sharded destinations arrived in several items
    da, db = _deq(a), _deq(b)
    for k in da:
        assert torch.equal(da[k], db[k]), k


def test_without_te_backend_is_a_clear_error(monkeypatch):
    from qckpt.errors import UsageError
    from qckpt.formats import te

    monkeypatch.setattr(te, "te_available", lambda: False)
    with pytest.raises(UsageError, match=r"pip install 'qckpt\[te\]'"):
        te.require_te()
