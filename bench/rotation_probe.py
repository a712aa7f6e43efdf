"""Does rotating the residual stream help NVFP4 W4A4? A probe, not a qckpt feature.

    python -m bench.rotation_probe MODEL_DIR OUT_DIR [--seed 0]
    python -m bench.quality --model rotated=OUT_DIR --algorithms max,gptq+mse --no-vllm

Writes OUT_DIR: the dense Llama-style model of MODEL_DIR with each RMSNorm's gain folded into
the linears that read it (gains become 1) and the residual stream turned by an orthogonal
Q = H diag(signs) / sqrt(n) (H the Sylvester Hadamard matrix, signs drawn from ``--seed``):
embeddings E Q, readers of the residual W Q, writers to it Q^T W. RMSNorm is invariant under an
orthogonal turn, so in exact arithmetic the model computes the same logits; what changes is
what q/k/v, gate/up and lm_head see as inputs (spread over all channels: fewer outliers per
NVFP4 block of 16). o_proj's and down_proj's inputs are not turned (that needs a rotation at
run time, which a plain exported model cannot carry). Weights are turned in float64 and stored
in BF16, which costs a little by itself: measure the BF16 of OUT_DIR too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def hadamard_rotation(n: int, seed: int) -> torch.Tensor:
    """An n x n orthogonal matrix: a Sylvester Hadamard matrix with random column signs."""
    if n < 1 or n & (n - 1):
        raise SystemExit(f"hidden_size {n}: the Sylvester construction needs a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return h * signs[:, None] / n**0.5


def rotate(sd: dict[str, torch.Tensor], layers: int, q: torch.Tensor) -> None:
    """Fold the norms and turn the residual stream of a dense Llama state dict, in place."""

    def fold_and_turn(norm: str, readers: list[str]) -> None:
        gain = sd[norm]
        for r in readers:
            sd[r] = sd[r] * gain[None, :] @ q
        sd[norm] = torch.ones_like(gain)

    for i in range(layers):
        p = f"model.layers.{i}."
        if p + "mlp.gate_proj.weight" not in sd:
            raise SystemExit(f"{p}mlp: not a dense gate/up/down MLP (this probe turns those only)")
        fold_and_turn(
            p + "input_layernorm.weight", [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        )
        fold_and_turn(
            p + "post_attention_layernorm.weight",
            [p + f"mlp.{x}_proj.weight" for x in ("gate", "up")],
        )
        for writer in (p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"):
            sd[writer] = q.T @ sd[writer]
    fold_and_turn("model.norm.weight", ["lm_head.weight"])
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] @ q


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = json.loads((args.model / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        raise SystemExit("tied embeddings: folding the final norm into lm_head would untie them")
    sd = {k: v.double() for k, v in load_file(str(args.model / "model.safetensors")).items()}
    rotate(sd, cfg["num_hidden_layers"], hadamard_rotation(cfg["hidden_size"], args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    out = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    save_file(out, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if (args.model / f).is_file():
            shutil.copy(args.model / f, args.out / f)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
