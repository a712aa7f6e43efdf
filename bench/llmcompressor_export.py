"""llm-compressor 0.14 baselines of a quality model, calibrated on the very windows qckpt uses.

    python -m bench.llmcompressor_export --model DIR --calib CALIB.bin --out DIR
        --scheme w4a16|w8a8 [--device cuda|cpu]

Runs in a site that has llmcompressor 0.14.0 (compressed-tensors 0.19.0, transformers <= 5.17),
torch and safetensors, with this repository on ``PYTHONPATH`` for qckpt's calibration loader only
(``qckpt.calib.data``: no other part of qckpt is imported).

The calibration set is the one ``bench.quality`` calibrates its own variants on (its recipe's
``data: {source: text, path: CALIB, num_samples: 128, seq_len: 512, batch_size: 16}``), made by
qckpt's own loader: the text file's bytes, one token id per byte (the models have no tokenizer),
cut into 128 windows of 512. They go to ``oneshot`` as a ``datasets.Dataset`` of ``input_ids``
and ``attention_mask`` (already tokenized, so llm-compressor does not tokenize), with
``num_calibration_samples=128``, ``max_seq_length=512``, in order (no shuffle; GPTQ sums the
windows' Hessians, so order only moves rounding) and in batches of 16 as qckpt's.

Recipes (``--scheme``):

* ``w4a16``: ``GPTQModifier(scheme="W4A16", targets="Linear", ignore=["lm_head",
  "re:.*mlp.gate$"])``: llm-compressor's default GPTQ (INT4 symmetric, groups of 128, static
  per-group scales by its min-max observer, dampening 0.01, block 128, no activation order);
  the MoE router ``mlp.gate`` stays BF16 as qckpt's recipes ignore ``*.mlp.gate``.
* ``w8a8``: the INT8 recipe of llm-compressor's ``examples/quantization_w8a8_int8`` (0.14):
  ``SmoothQuantModifier(smoothing_strength=0.8)`` then ``GPTQModifier(scheme="W8A8",
  targets="Linear", ignore=[...the same...])``: INT8 per-channel symmetric weights, INT8
  per-token dynamic inputs; SmoothQuant's mappings are llm-compressor's for the architecture
  (Llama: q/k/v by input_layernorm, gate/up by post_attention_layernorm; Qwen3-MoE: q/k/v only).

The model is written with ``model.save_pretrained(OUT, save_compressed=True)``
(compressed-tensors ``pack-quantized`` for W4A16, ``int-quantized`` for W8A8); the wall time of
the whole run (load, calibrate, save) is printed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

IGNORE = ["lm_head", "re:.*mlp.gate$"]


class _NoProcessor:
    """The models have no tokenizer: llm-compressor 0.14 insists on a processor whenever a
    dataset is given (it tries ``AutoProcessor`` on the model dir when passed ``None`` and fails),
    though it never calls one on an already tokenized dataset with the truncation collator. This
    stands in for it; ``save_pretrained`` is the model's own, so nothing of it is written."""

    def save_pretrained(self, *_args, **_kwargs) -> None:
        pass


def calibration_windows(calib: Path, model: Path, vocab_size: int):
    """The ``[128, 512]`` token ids of bench.quality's recipe, by qckpt's own loader."""
    import torch

    from qckpt.calib.data import calibration_batches
    from qckpt.recipe import DataConfig

    cfg = DataConfig(source="text", path=str(calib), num_samples=128, seq_len=512, batch_size=16)
    batches = calibration_batches(cfg, vocab_size=vocab_size, model_source=str(model))
    return torch.cat(batches)


def recipe(scheme: str) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier

    if scheme == "w4a16":
        return [GPTQModifier(scheme="W4A16", targets="Linear", ignore=IGNORE)]
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    return [
        SmoothQuantModifier(smoothing_strength=0.8),
        GPTQModifier(scheme="W8A8", targets="Linear", ignore=IGNORE),
    ]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scheme", choices=("w4a16", "w8a8"), required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(args.model), dtype=torch.bfloat16, device_map=args.device
    )
    ids = calibration_windows(args.calib, args.model, model.config.vocab_size)
    ds = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )
    oneshot(
        model=model,
        processor=_NoProcessor(),
        dataset=ds,
        recipe=recipe(args.scheme),
        num_calibration_samples=int(ids.shape[0]),
        max_seq_length=int(ids.shape[1]),
        batch_size=16,
        shuffle_calibration_samples=False,
    )
    if args.out.exists():
        shutil.rmtree(args.out)
    model.save_pretrained(str(args.out), save_compressed=True)
    wall = time.perf_counter() - t0
    import llmcompressor

    print(
        f"llm-compressor {llmcompressor.__version__} {args.scheme} of {args.model} on "
        f"{args.device}: {ids.shape[0]} x {ids.shape[1]} calibration tokens, "
        f"wall {wall:.1f} s -> {args.out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
