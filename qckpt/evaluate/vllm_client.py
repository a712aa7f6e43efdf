"""``qckpt eval --client vllm``: the source and the export served by vLLM, the same figures.

Each model runs in its own vLLM engine, in its own process (:mod:`qckpt.evaluate.vllm_worker`:
``LLM(model=DIR, enforce_eager=True, skip_tokenizer_init=True)``, ``TokensPrompt`` of each
window, ``SamplingParams(max_tokens=1, prompt_logprobs=k)``), one after the other.

What is exact and what is approximated from the top-k prompt log-probabilities:

* NLL, bits per byte, perplexity: exact (vLLM returns the log-probability of every prompt
  token, whatever its rank).
* top-1 agreement: exact (the rank-1 token of each model at each position).
* KL(source || export): the sum over the *source's* top-k tokens of
  ``p_s (log p_s - log p_e)``; where such a token is not among the export's top-k (nor the
  prompt token), ``log p_e`` is taken as the export's k-th log-probability, an upper bound of
  it, so that term is a lower bound. The source mass outside its top-k is left out. With a
  vocabulary of 256 and k = 20 the left-out mass is small; the report says k.
* layer errors: not available (vLLM does not return hidden states).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from qckpt.errors import QckptError, UsageError
from qckpt.evaluate.options import EvalOptions

# the settings vLLM 0.26 needs on a machine without flashinfer, one engine per process
# (shared/device-vllm's README); a user's own values win
VLLM_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "NCCL_NVLS_ENABLE": "0",
}


def vllm_site() -> str | None:
    """``QCKPT_VLLM_SITE``: a dir that holds vLLM and its pinned packages (kept off the main
    process's path: they pin other versions of compressed-tensors and friends)."""
    site = os.environ.get("QCKPT_VLLM_SITE")
    return site if site and Path(site, "vllm").is_dir() else None


def vllm_available() -> bool:
    return vllm_site() is not None or importlib.util.find_spec("vllm") is not None


def worker_env() -> dict[str, str]:
    """The environment of a vLLM worker: qckpt importable, the vLLM site first when there is
    one, :data:`VLLM_ENV` where the user set nothing."""
    env = {**VLLM_ENV, **os.environ}
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in (vllm_site(), root, os.environ.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def _serve(model_dir: Path, windows: Path, out: Path, k: int, log: Callable[[str], None]) -> Any:
    import torch

    log(f"vLLM: serving {model_dir}")
    cmd = [sys.executable, "-m", "qckpt.evaluate.vllm_worker", str(model_dir), str(windows)]
    r = subprocess.run([*cmd, str(out), str(k)], capture_output=True, text=True, env=worker_env())
    if r.returncode != 0 or not out.is_file():
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise QckptError(f"vLLM could not serve {model_dir} (exit {r.returncode}): {tail}")
    return torch.load(out, weights_only=True)


def _kl_topk(src: dict, exp: dict, targets: Any) -> Any:
    """Per position, the top-k approximation of KL(source || export) (see the module doc)."""
    import torch

    ids_s, lp_s = src["top_ids"], src["top_logprobs"]
    ids_e, lp_e = exp["top_ids"], exp["top_logprobs"]
    match = ids_s[..., :, None] == ids_e[..., None, :]  # [w, t, k, k]
    found = match.any(-1)
    lp_e_at = (lp_e[..., None, :] * match).sum(-1)
    floor = lp_e.min(-1, keepdim=True).values.expand_as(lp_s)
    lp_e_at = torch.where(found, lp_e_at, floor)
    is_tgt = ids_s == targets[..., None]
    lp_e_at = torch.where(is_tgt & ~found, exp["target"][..., None].expand_as(lp_s), lp_e_at)
    return (lp_s.exp() * (lp_s - lp_e_at)).sum(-1)


def figures(src: dict, exp: dict, ids: Any, nbytes: int, unit: str, k: int) -> dict[str, Any]:
    targets = ids[:, 1:]
    n = targets.numel()
    nll_s, nll_e = float(-src["target"].sum()), float(-exp["target"].sum())
    kl = _kl_topk(src, exp, targets)
    bits_s = nll_s / math.log(2) / nbytes
    bits_e = nll_e / math.log(2) / nbytes
    return {
        f"source_bits_per_{unit}": bits_s,
        f"export_bits_per_{unit}": bits_e,
        "relative_increase": bits_e / bits_s - 1.0,
        "source_perplexity": math.exp(nll_s / n),
        "export_perplexity": math.exp(nll_e / n),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_note": f"over the source's top-{k} tokens, a lower bound",
        "top1_agreement": float((src["top_ids"][..., 0] == exp["top_ids"][..., 0]).double().mean()),
        "tokens": n,
        "bytes": nbytes,
        "layers": None,
        "layers_moved_most": None,
    }


def evaluate_vllm(
    export_dir: Path,
    source_dir: Path,
    data: Path,
    opts: EvalOptions,
    *,
    top_k: int = 20,
    log: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    """``qckpt eval``'s report, with both models served by vLLM."""
    if not vllm_available():
        raise QckptError("--client vllm: vllm is not installed in this environment")
    if opts.device == "cpu":
        raise UsageError("--client vllm runs on the GPU; drop --device cpu")
    import torch

    from qckpt.evaluate.windows import data_section, make_windows, tokenizer_of
    from qckpt.layouts.source_layout import read_json_if_any

    cfg = read_json_if_any(source_dir / "config.json") or {}
    tok = tokenizer_of(source_dir)
    win = make_windows(
        data,
        vocab_size=int(cfg.get("vocab_size") or 0),
        tokenizer=tok,
        windows=opts.windows,
        seq_len=opts.seq_len,
        seed=opts.seed,
    )
    with tempfile.TemporaryDirectory(prefix="qckpt-eval-vllm-") as tmp:
        wpath = Path(tmp) / "windows.pt"
        torch.save(win.ids, wpath)
        src = _serve(source_dir, wpath, Path(tmp) / "source.pt", top_k, log)
        exp = _serve(export_dir, wpath, Path(tmp) / "export.pt", top_k, log)
    unit = "token" if win.kind == "tokens" else "byte"
    fig = figures(src, exp, win.ids, sum(win.nbytes), unit, top_k)
    from qckpt.evaluate.run import quality_warnings

    return {
        "client": "vllm",
        "export": str(export_dir),
        "source": str(source_dir),
        "data": data_section(win, data),
        "unit": unit,
        "top_k": top_k,
        "options": asdict(opts),
        **fig,
        "warnings": quality_warnings(fig, unit),
        "seconds": {"source": src["seconds"], "export": exp["seconds"]},
    }
