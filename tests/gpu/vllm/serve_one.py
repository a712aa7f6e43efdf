"""Serve one model dir with vLLM and write its greedy tokens (run by ``matrix.py``, one process
per engine: a second ``LLM`` in the same process is not reliable).

    python serve_one.py MODEL_DIR PROMPTS_JSON OUT_JSON [--kv-fp8]

Writes ``{"load_s", "gen_s", "tokens", "methods"}``: ``methods`` maps each vLLM module that has a
quant method to that method's class (the names vLLM gives the modules, fused ones included).
"""

from __future__ import annotations

import json
import sys
import time


def _methods(model) -> dict[str, str]:
    return {
        name: type(m.quant_method).__name__
        for name, m in model.named_modules()
        if getattr(m, "quant_method", None) is not None
    }


def main(argv: list[str]) -> None:
    model_dir, prompts_path, out_path = argv[:3]
    kv_fp8 = "--kv-fp8" in argv
    prompts = json.loads(open(prompts_path).read())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter()
    llm = LLM(
        model=model_dir,
        enforce_eager=True,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=256,
        max_num_seqs=64,
        kv_cache_dtype="fp8" if kv_fp8 else "auto",
        seed=0,
    )
    t_load = time.perf_counter()
    params = SamplingParams(
        temperature=0.0, max_tokens=len(prompts["expect"][0]), ignore_eos=True, detokenize=False
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts["prompts"]], params)
    t_gen = time.perf_counter()
    import vllm

    result = {
        "vllm": vllm.__version__,
        "import_s": t_import - t0,
        "load_s": t_load - t_import,
        "gen_s": t_gen - t_load,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    try:
        result["methods"] = llm.apply_model(_methods)[0]
    except Exception as exc:  # the tokens matter more than the module listing
        result["methods_error"] = f"{type(exc).__name__}: {exc}"[:300]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
