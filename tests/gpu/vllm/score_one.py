"""Score held-out windows with vLLM: the prompt log-probabilities of one model dir, as bits per
token (bits per byte for a byte-vocabulary model). One process per engine (a second ``LLM`` in
the same process is not reliable).

    python score_one.py MODEL_DIR WINDOWS_PT OUT_JSON

``WINDOWS_PT``: an int64 tensor [n, seq + 1] of token ids (``torch.save``). Writes
``{"vllm", "bits_per_token", "tokens", "load_s", "score_s", "methods"}``.
"""

from __future__ import annotations

import json
import math
import sys
import time


def _methods(model) -> list[str]:
    return [
        type(m.quant_method).__name__
        for m in model.modules()
        if getattr(m, "quant_method", None) is not None
    ]


def main(argv: list[str]) -> None:
    model_dir, windows_path, out_path = argv[:3]
    import torch

    windows = torch.load(windows_path, weights_only=True)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        enforce_eager=True,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.1,
        # engines start side by side (test_vllm_quality: three at once); a KV cache sized
        # outright skips vLLM's start-up profiling, which reads the free GPU memory that the
        # other engines change under it ("Error in memory profiling", 2026-12-03)
        kv_cache_memory_bytes=1 << 30,
        max_model_len=windows.shape[1] + 8,
        max_num_seqs=64,
        seed=0,
    )
    t_load = time.perf_counter()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=w.tolist()) for w in windows]
    outs = llm.generate(prompts, params)
    nll, n = 0.0, 0
    for w, o in zip(windows.tolist(), outs, strict=True):
        # prompt_logprobs[0] is None (the first token has no context); entry i scores token i
        for tok, lp in zip(w[1:], o.prompt_logprobs[1:], strict=True):
            nll -= lp[tok].logprob
            n += 1
    import vllm

    try:
        methods = sorted(set(llm.apply_model(_methods)[0]))
    except Exception as exc:  # the scores matter more than the module listing
        methods = [f"{type(exc).__name__}: {exc}"[:300]]
    res = {
        "vllm": vllm.__version__,
        "bits_per_token": nll / n / math.log(2),
        "tokens": n,
        "load_s": t_load - t0,
        "score_s": time.perf_counter() - t_load,
        "methods": methods,
    }
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
