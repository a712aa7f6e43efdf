"""Checkable tiny models for the vLLM serving test: trained here on a deterministic task.

Random weights make a weak serving check (served right or wrong, their outputs look alike), and
the GPU machine has no network for a real model. So two small models (a Llama and a Qwen3-MoE)
are trained from scratch, for a few hundred steps, on *strided counting*: a sequence
``a, a+d, a+2d, ...`` (mod the vocab) with a random start ``a`` and stride ``d`` in 1..4. Given
the first ``PROMPT`` tokens, the right greedy continuation is known exactly, so one can check
that the BF16 model is right, and then that every served export gives the BF16 model's tokens.
"""

from __future__ import annotations

import time

import torch

VOCAB = 256
PROMPT = 8
GEN = 16
STRIDES = 4
MOD = 128  # the sequences use tokens 0..127: a table small enough to learn in a minute


def model_config(kind: str, hidden: int = 256):
    """A small Llama ("dense") or Qwen3-MoE ("moe"); head_dim 64 as the serving kernels like."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    if kind == "dense":
        cfg = LlamaConfig(intermediate_size=2 * hidden, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = Qwen3MoeConfig(
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **common,
        )
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def sequences(n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, MOD, (n, 1), generator=g)
    stride = torch.randint(1, STRIDES + 1, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % MOD


def train(
    kind: str,
    *,
    steps: int,
    device: str,
    hidden: int = 256,
    seed: int = 0,
    batch: int = 128,
    max_seconds: float = 1e9,
    log=print,
):
    """Train one model (``steps`` or ``max_seconds``, whichever ends first); bfloat16, eval."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(kind, hidden), dtype=torch.float32)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    t0 = time.perf_counter()
    for step in range(steps):
        ids = sequences(batch, PROMPT + GEN, seed * 100_003 + step).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        late = time.perf_counter() - t0 > max_seconds
        if step % 200 == 0 or step == steps - 1 or late:
            log(f"{kind} step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.1f}s)")
        if late:
            break
    return model.to(torch.bfloat16).eval()


def prompts(n: int = 64, seed: int = 12345) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, the right continuations) of held-out sequences."""
    seq = sequences(n, PROMPT + GEN, seed)
    return seq[:, :PROMPT].tolist(), seq[:, PROMPT:].tolist()


@torch.no_grad()
def greedy(model, prompt_ids: list[list[int]], n: int = GEN) -> list[list[int]]:
    """Greedy continuation, recomputed from scratch each step (no cache to get wrong)."""
    dev = next(model.parameters()).device
    ids = torch.tensor(prompt_ids, device=dev)
    for _ in range(n):
        nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, len(prompt_ids[0]) :].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    total = sum(len(x) for x in a)
    same = sum(
        int(x == y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
    )
    return same / total if total else 0.0
