"""llm-compressor 0.14 exports of a shared quality model (its default recipes), calibrated on the
same 128 x 512 bytes of calib.bin as qckpt's benchmark. Runs in its own venv (llm-compressor pins
transformers <= 5.17 and compressed-tensors 0.19):

    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /tmp/llmc/bin/python bench/peers/llmcompressor_export.py MODEL_DIR OUT_ROOT FP8,NVFP4,NVFP4+gptq
"""

import sys
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

Q = Path(__file__).resolve().parents[3] / "shared" / "quality"


def main() -> None:

    model_dir, out_root = Path(sys.argv[1]), Path(sys.argv[2])
    schemes = sys.argv[3].split(",")
    raw = (Q / "calib.bin").read_bytes()
    text = raw.decode("utf-8", errors="replace").encode("utf-8")
    ids = torch.frombuffer(bytearray(text[: 128 * 512]), dtype=torch.uint8).long().reshape(128, 512)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 512] * 128})
    moe = "qwen3" in model_dir.name or "moe" in model_dir.name
    ignore = ["lm_head"] + (["re:.*mlp.gate$"] if moe else [])

    # a byte vocabulary (id = byte); the dataset is already token ids, oneshot only wants a processor
    vocab = {f"<{i}>": i for i in range(256)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<0>")), pad_token="<0>"
    )
    for name in schemes:
        scheme, algo = (name.split("+") + ["rtn"])[:2]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        mod = (GPTQModifier if algo == "gptq" else QuantizationModifier)(
            targets="Linear", scheme=scheme, ignore=ignore
        )
        out = out_root / f"llmc-{name.replace('+', '-').lower()}"
        oneshot(
            model=model,
            dataset=ds,
            recipe=[mod],
            num_calibration_samples=128,
            max_seq_length=512,
            processor=tok,
            output_dir=str(out),
        )
        print("wrote", out)


if __name__ == "__main__":
    main()
