"""One vLLM engine in its own process: the prompt log-probabilities of the eval windows.

    python -m qckpt.evaluate.vllm_worker MODEL_DIR WINDOWS.pt OUT.pt TOP_K [GPU_FRACTION]

``WINDOWS.pt``: an int64 tensor [windows, seq_len + 1]. ``OUT.pt``: ``target`` [w, t] (the
log-probability of each next token), ``top_ids`` / ``top_logprobs`` [w, t, k] (vLLM's top-k by
rank), ``seconds`` (engine start, prompts). A process per engine, so that each one's GPU memory
is freed when it exits, whatever vLLM keeps alive.
"""

from __future__ import annotations

import sys
import time

KV_CACHE_BYTES = 1 << 30


def window_rows(
    plp: list, ids: list[int], k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    target, top_ids, top_lp = [], [], []
    for pos in range(1, len(ids)):
        d = plp[pos]
        target.append(float(d[ids[pos]].logprob))
        ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in d.items()), key=lambda r: r[0])
        ranked = [r for r in ranked if r[0] is not None and r[0] <= k][:k]
        while len(ranked) < k:  # never expected; keeps the tensor rectangular
            ranked.append((k + 1, -1, float("-inf")))
        top_ids.append([int(r[1]) for r in ranked])
        top_lp.append([float(r[2]) for r in ranked])
    return target, top_ids, top_lp


def _kv_fp8(model_dir: str) -> bool:
    """Whether the export carries FP8 KV-cache scales: vLLM uses them only when asked for an
    FP8 cache (``kv_cache_dtype="fp8"``)."""
    import json
    from pathlib import Path

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    if (cfg.get("quantization_config") or {}).get("kv_cache_scheme"):
        return True
    hq = d / "hf_quant_config.json"
    algo = (
        (json.loads(hq.read_text()).get("quantization") or {}).get("kv_cache_quant_algo")
        if hq.is_file()
        else None
    )
    return algo == "FP8"


def main(argv: list[str]) -> int:
    model_dir, windows_path, out_path, k = argv[0], argv[1], argv[2], int(argv[3])
    # the share of the GPU this engine may take (several engines at once: a benchmark). The KV
    # cache is then sized outright: vLLM's memory profiling reads the GPU's free memory, which
    # engines starting beside it change under it ("Error in memory profiling" with 10 at once);
    # 1 GiB holds far more than the windows' tokens of the models this serves.
    extra: dict = (
        {"gpu_memory_utilization": float(argv[4]), "kv_cache_memory_bytes": KV_CACHE_BYTES}
        if len(argv) > 4
        else {}
    )
    if _kv_fp8(model_dir):
        extra["kv_cache_dtype"] = "fp8"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    win = torch.load(windows_path, weights_only=True)
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_logprobs=k,
        max_model_len=int(win.shape[1]) + 1,
        seed=0,
        **extra,
    )
    t1 = time.perf_counter()
    params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False, temperature=0.0)
    prompts = [TokensPrompt(prompt_token_ids=w.tolist()) for w in win]
    outs = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.perf_counter()
    rows = [window_rows(o.prompt_logprobs, w.tolist(), k) for o, w in zip(outs, win, strict=True)]
    torch.save(
        {
            "target": torch.tensor([r[0] for r in rows], dtype=torch.float64),
            "top_ids": torch.tensor([r[1] for r in rows], dtype=torch.long),
            "top_logprobs": torch.tensor([r[2] for r in rows], dtype=torch.float64),
            "seconds": {"engine_start": t1 - t0, "prompts": t2 - t1},
        },
        out_path,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
