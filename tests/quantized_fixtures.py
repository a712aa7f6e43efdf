"""Quantized source dirs made from qckpt's tiny models, for the quantized-source tests.

* ``blockwise_fp8``: a DeepSeek-V3-style dir (``weight`` float8_e4m3fn + float32
  ``weight_scale_inv`` per block, ``quantization_config: {quant_method: fp8, weight_block_size}``),
  quantized here with ``qckpt.formats`` (``fp8_block``, the same per-tile rule as DeepSeek's
  ``act_quant``); any block size, partial edge blocks included.
* ``compressed_tensors``: written by compressed-tensors' own compressors (FP8 per-channel and
  per-block ``float-quantized``, ``nvfp4-pack-quantized``; INT4 group ``pack-quantized``, INT8
  channel ``int-quantized``, ``mxfp4-pack-quantized``), scales computed here as
  llm-compressor's observers would (amax / qmax; NVFP4: global 448*6/amax, E4M3 per 16; the
  integer and MX kinds by compressed-tensors' ``calculate_qparams``).
* ``gpt_oss_mxfp4``: a tiny gpt-oss (``gpt_oss_bf16``: hidden 64, 2 layers, 4 experts) with
  its experts packed here as OpenAI's releases store them (``{proj}_blocks`` uint8 [E, rows,
  cols / 32, 16], ``{proj}_scales`` uint8 E8M0 [E, rows, cols / 32], ``quant_method: mxfp4``),
  each group's exponent OCP's ``floor(log2(amax)) - 2`` and its codes the nearest E2M1.
* qckpt's own exports (compressed-tensors per-tensor FP8, ModelOpt FP8 and NVFP4) come from
  ``tests.export_fixtures.run_export``.

As a script it writes the three kinds of dirs for a look: ``python -m tests.quantized_fixtures OUT``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qckpt.formats import quantize

# the linears a quantized release quantizes (routers, embeddings, norms and lm_head stay BF16)
QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
FP8_MAX = 448.0


def bf16_dir(root: Path, source: str = "tiny-moe", seed: int = 0) -> Path:
    """The tiny model saved by transformers (BF16, per-expert names)."""
    from qckpt.models.build import build_model

    out = root / f"{source}-bf16"
    if not out.exists():
        build_model(source, dtype="bfloat16", seed=seed).save_pretrained(out)
    return out


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _write(src: Path, out: Path, tensors: dict[str, torch.Tensor], qc: dict) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def blockwise_fp8(src: Path, out: Path, block: tuple[int, int] = (32, 32)) -> Path:
    """A DeepSeek-V3-style blockwise FP8 dir of the BF16 dir ``src``."""
    tensors: dict[str, torch.Tensor] = {}
    for k, t in _tensors(src).items():
        if QUANTIZED.search(k):
            q = quantize(t, "fp8_block", block_size=block)
            tensors[k] = q.qdata
            tensors[f"{k}_scale_inv"] = q.scale.to(torch.float32)
        else:
            tensors[k] = t
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    return _write(src, out, tensors, qc)


def _amax_blocks(w: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    r, c = w.shape
    rb, cb = math.ceil(r / b0), math.ceil(c / b1)
    wp = torch.nn.functional.pad(w.float().abs(), (0, cb * b1 - c, 0, rb * b0 - r))
    return wp.reshape(rb, b0, cb, b1).amax((1, 3))


# integer and MX kinds as llm-compressor writes them: INT4 W4A16 group 32 (its GPTQ / AWQ
# output, pack-quantized), INT8 W8A8 per channel with dynamic per-token inputs (int-quantized),
# MXFP4A16 (mxfp4-pack-quantized); the group is 32 since the tiny dims are 64 and 128
INT_MX = {
    "int4": ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}, None),
    "int8": (
        {"num_bits": 8, "type": "int", "strategy": "channel"},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True},
    ),
    "mxfp4": (
        {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
         "scale_dtype": torch.uint8, "zp_dtype": torch.uint8},
        None,
    ),
}  # fmt: skip
INT_MX_FORMAT = {"int4": "pack-quantized", "int8": "int-quantized", "mxfp4": "mxfp4-pack-quantized"}


def ct_args(kind: str, block: tuple[int, int]) -> dict:
    base = {"symmetric": True, "dynamic": False, "group_size": None, "block_structure": None}
    if kind in INT_MX:
        return {**base, **INT_MX[kind][0]}
    if kind == "nvfp4":
        return {
            **base,
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
        }
    args = {**base, "num_bits": 8, "type": "float", "strategy": kind}
    if kind == "block":
        args["block_structure"] = list(block)
    return args


def _ct_module(w: torch.Tensor, kind: str, block: tuple[int, int], scheme) -> dict:
    """One linear compressed by compressed-tensors' own compressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    if kind in INT_MX:
        return _ct_int_mx(w, kind, scheme)
    if kind == "nvfp4":
        amax = w.float().abs().amax().clamp_min(1e-12)
        gs = (FP8_MAX * 6.0 / amax).reshape(1)
        groups = _amax_blocks(w, 1, 16)
        sb = (gs * groups / 6.0).clamp(2.0**-9, FP8_MAX).to(torch.float8_e4m3fn).float()
        sd = {"weight": w, "weight_scale": sb, "weight_global_scale": gs}
        return dict(NVFP4PackedCompressor.compress(sd, scheme))
    if kind == "channel":
        scale = (w.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX).to(w.dtype)
    else:
        scale = (_amax_blocks(w, *block).clamp_min(1e-12) / FP8_MAX).to(w.dtype)
    return dict(FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme))


def _ct_int_mx(w: torch.Tensor, kind: str, scheme) -> dict:
    """An INT4 / INT8 / MXFP4 linear: qparams by compressed-tensors' ``calculate_qparams`` from
    each group's (row's) min and max, as its observers give them, then its compressor."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    rows, cols = w.shape
    g = scheme.weights.group_size or cols
    groups = w.reshape(rows, cols // g, g)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    sd = {"weight": w, "weight_scale": scale}
    if kind == "mxfp4":
        return dict(MXFP4PackedCompressor.compress(sd, scheme))
    sd["weight_zero_point"] = zp
    comp = PackedQuantizationCompressor if kind == "int4" else IntQuantizationCompressor
    return dict(comp.compress(sd, scheme))


def _ct_scheme(kind: str, wargs: dict):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if kind in INT_MX:
        inputs = INT_MX[kind][1]
        return QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(**wargs),
            input_activations=QuantizationArgs(**inputs) if inputs else None,
        )
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**wargs),
        input_activations=QuantizationArgs(
            num_bits=wargs["num_bits"], type="float", strategy="token", dynamic=True
        ),
    )


def compressed_tensors(
    src: Path, out: Path, kind: str = "channel", block: tuple[int, int] = (32, 32)
) -> Path:
    """A compressed-tensors dir (``kind``: channel | block | nvfp4 | int4 | int8 | mxfp4), written
    by its compressors."""
    wargs = ct_args(kind, block)
    scheme = _ct_scheme(kind, wargs)
    tensors: dict[str, torch.Tensor] = {}
    for k, t in _tensors(src).items():
        if not QUANTIZED.search(k):
            tensors[k] = t
            continue
        mod = k[: -len(".weight")]
        for leaf, v in _ct_module(t, kind, block, scheme).items():
            tensors[f"{mod}.{leaf}"] = v
    fmt = "nvfp4-pack-quantized" if kind == "nvfp4" else INT_MX_FORMAT.get(kind, "float-quantized")
    inputs = {"num_bits": wargs["num_bits"], "type": "float", "strategy": "token", "dynamic": True}
    if kind in INT_MX:  # the config as compressed-tensors serializes its own args
        inputs = INT_MX[kind][1] and scheme.input_activations.model_dump(mode="json")
        wargs = scheme.weights.model_dump(mode="json")
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": wargs,
                "input_activations": inputs,
                "format": fmt,
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    return _write(src, out, tensors, qc)


# gpt-oss's own choice of what stays BF16 (its releases' config.json)
GPT_OSS_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def gpt_oss_bf16(root: Path, seed: int = 0) -> Path:
    """A tiny gpt-oss saved by transformers (BF16; its experts fused and transposed, biased)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    out = root / "gpt-oss-bf16"
    if out.exists():
        return out
    cfg = GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,  # not the hidden size: a transposed read cannot pass unseen
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():  # biases that matter, so that a lost one shows in the logits
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0.0, 0.02)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out)
    return out


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., rows, cols] -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8
    [..., rows, cols / 32]): per 32 columns the exponent ``floor(log2(amax)) - 2`` (E2M1's
    largest is 6 = 1.5 * 2**2), codes the nearest E2M1 of ``w / 2**e`` (saturated at 6), the
    even column in the low nibble."""
    *lead, rows, cols = w.shape
    g = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    x = (g / torch.exp2(e)).clamp(-6.0, 6.0)
    mag = (x.abs().unsqueeze(-1) - E2M1_GRID).abs().argmin(-1).to(torch.uint8)
    codes = mag | ((x < 0).to(torch.uint8) << 3)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (e.squeeze(-1) + 127).to(torch.uint8)


def gpt_oss_mxfp4(src: Path, out: Path) -> Path:
    """The gpt-oss dir ``src`` with its experts stored as its MXFP4 releases store them."""
    tensors: dict[str, torch.Tensor] = {}
    for k, t in _tensors(src).items():
        if k.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # the model's [E, in, out] is stored as each expert's [out, in] linear
            blocks, scales = mxfp4_pack(t.transpose(1, 2))
            tensors[f"{k}_blocks"], tensors[f"{k}_scales"] = blocks, scales
        else:
            tensors[k] = t
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": list(GPT_OSS_NOT_CONVERTED)}
    return _write(src, out, tensors, qc)


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "runs/quantized-sources")
    src = bf16_dir(root)
    for block in ((32, 32), (24, 40)):
        print(blockwise_fp8(src, root / f"fp8-blockwise-{block[0]}x{block[1]}", block))
    for kind in ("channel", "block", "nvfp4"):
        print(compressed_tensors(src, root / f"ct-{kind}", kind))
    print(gpt_oss_mxfp4(gpt_oss_bf16(root), root / "gpt-oss-mxfp4"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
