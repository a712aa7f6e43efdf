"""``qckpt eval --client vllm`` without a GPU: the figures made from vLLM-shaped prompt
log-probabilities (exact NLL and top-1, KL over the source's top-k), and the worker's reading of
vLLM's ``prompt_logprobs`` structure."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from qckpt.evaluate.vllm_client import figures
from qckpt.evaluate.vllm_worker import window_rows


@dataclass
class _Logprob:  # the fields of vllm.sequence.Logprob the worker reads
    logprob: float
    rank: int | None
    decoded_token: str | None = None


def _served(logits: torch.Tensor, ids: torch.Tensor, k: int) -> dict:
    """What the worker saves for one model, from full logits [w, t, vocab] (t = seq_len)."""
    lp = torch.log_softmax(logits.double(), -1)
    top = lp.topk(k, dim=-1)
    return {
        "target": lp.gather(-1, ids[:, 1:, None])[..., 0],
        "top_ids": top.indices,
        "top_logprobs": top.values,
    }


def _exact(ls: torch.Tensor, le: torch.Tensor) -> torch.Tensor:
    ps, pe = torch.log_softmax(ls.double(), -1), torch.log_softmax(le.double(), -1)
    return (ps.exp() * (ps - pe)).sum(-1)


def test_figures_from_full_top_k_are_exact():
    g = torch.Generator().manual_seed(0)
    w, t, v = 3, 9, 32
    ids = torch.randint(0, v, (w, t + 1), generator=g)
    ls = torch.randn(w, t, v, generator=g) * 3
    le = ls + 0.3 * torch.randn(w, t, v, generator=g)
    fig = figures(_served(ls, ids, v), _served(le, ids, v), ids, w * t, "byte", v)
    assert fig["kl_mean"] == pytest.approx(float(_exact(ls, le).mean()), rel=1e-9)
    nll = float(-torch.log_softmax(le.double(), -1).gather(-1, ids[:, 1:, None]).sum())
    assert fig["export_bits_per_byte"] == pytest.approx(
        nll / torch.log(torch.tensor(2.0)).item() / (w * t)
    )
    agree = (ls.argmax(-1) == le.argmax(-1)).double().mean().item()
    assert fig["top1_agreement"] == pytest.approx(agree)


def test_kl_over_a_small_top_k_is_a_lower_bound_close_to_the_truth():
    g = torch.Generator().manual_seed(1)
    w, t, v = 2, 16, 256
    ids = torch.randint(0, v, (w, t + 1), generator=g)
    ls = torch.randn(w, t, v, generator=g) * 4  # peaked, as a trained model's
    le = ls + 0.2 * torch.randn(w, t, v, generator=g)
    exact = float(_exact(ls, le).mean())
    fig = figures(_served(ls, ids, 20), _served(le, ids, 20), ids, w * t, "byte", 20)
    assert 0.5 * exact < fig["kl_mean"] <= exact * 1.0001
    assert "top-20" in fig["kl_note"]


def test_the_worker_reads_prompt_logprobs_by_rank():
    ids = [5, 7, 1]
    plp = [
        None,  # vLLM gives no log-probability for the first prompt token
        {3: _Logprob(-0.1, 1), 7: _Logprob(-2.5, 3), 9: _Logprob(-1.0, 2)},
        {1: _Logprob(-0.2, 1), 4: _Logprob(-1.9, 2), 8: _Logprob(-3.0, 3)},
    ]
    plp[1][7] = _Logprob(-2.5, 3)
    target, top_ids, top_lp = window_rows(plp, ids, 2)
    assert target == [-2.5, -0.2]
    assert top_ids == [[3, 9], [1, 4]] and top_lp == [[-0.1, -1.0], [-0.2, -1.9]]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_without_vllm_the_client_is_one_line_and_exit_1(tmp_path):
    from tests.conftest import run_qckpt

    exp, src = tmp_path / "exp", tmp_path / "src"
    exp.mkdir()
    src.mkdir()
    data = tmp_path / "d.bin"
    data.write_bytes(b"x" * 100)
    r = run_qckpt("eval", str(exp), "--source", str(src), "--data", str(data), "--client", "vllm")
    assert r.returncode == 1
    assert (
        r.stderr.strip() == "qckpt: error: --client vllm: vllm is not installed in this environment"
    )
