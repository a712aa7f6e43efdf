"""Every tensor a model holds, from its config alone: no torch, no transformers (``qckpt plan``).

A twin of what ``models.build.build_model`` makes on the meta device for the model families
qckpt builds: dense Llama / Mistral / Qwen2 / Qwen3, Qwen3-MoE and Mixtral (fused routed experts),
DeepSeek-V3 (MLA attention, shared experts, dense first layers). Names, shapes and dtypes in
state-dict order, tied weights under one tensor, the non-persistent rotary tables, and which
modules are linears, fused experts or routers. The config is read the way transformers' config
classes read it: the keys ``config.json`` gives, the class's defaults for the rest (``_FAMILIES``).

:func:`model_spec` returns None and a reason for what it does not know (another model type, a
feature that changes shapes and is not modeled here); the plan then builds the model on meta, as
it always did (``tests/unit/test_plan_spec.py`` holds the two equal, byte for byte).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qckpt.errors import UsageError


@dataclass(frozen=True)
class DType:
    """A torch dtype by name and item size (what a plan reads of a dtype)."""

    name: str
    itemsize: int


DTYPES = {
    n: DType(n, s) for n, s in (("bfloat16", 2), ("float16", 2), ("float32", 4))
}  # fmt: skip
_F32 = DTYPES["float32"]


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    persistent: bool = True
    aliases: tuple[str, ...] = ()  # tied weights: the other state-dict names of this tensor


@dataclass(kw_only=True)
class ModelSpec:
    """A model as its meta build holds it (see the module doc)."""

    model_type: str
    dtype: DType
    attrs: dict[str, Any]  # the config's attributes as transformers' config class has them
    tensors: list[TensorSpec] = field(default_factory=list)
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # module -> (out, in)
    biased: set[str] = field(default_factory=set)  # linears with a bias
    experts: list[str] = field(default_factory=list)  # fused experts modules
    routers: list[str] = field(default_factory=list)
    output_embedding: str = "lm_head"

    def add(self, name: str, *shape: int, dtype: DType | None = None) -> None:
        self.tensors.append(TensorSpec(name=name, shape=tuple(shape), dtype=dtype or self.dtype))

    def linear(self, module: str, out: int, inp: int, bias: bool = False) -> None:
        self.linears[module] = (out, inp)
        self.add(f"{module}.weight", out, inp)
        if bias:
            self.biased.add(module)
            self.add(f"{module}.bias", out)


# per model type: the config class's defaults of the keys that size tensors; "heads" stands
# for num_attention_heads, None for "not an attribute" (transformers then derives it)
_COMMON = {"num_key_value_heads": "heads", "tie_word_embeddings": False, "head_dim": None}
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False, "mlp_bias": False},
    "mistral": {"num_key_value_heads": 8},
    "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "attention_bias": False},
    "qwen3_moe": {
        "num_key_value_heads": 4, "attention_bias": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_experts": 128, "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
    },
    "mixtral": {"num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v3": {
        "num_key_value_heads": 128, "attention_bias": False, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "num_experts_per_tok": 8,
    },
}  # fmt: skip
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")  # fmt: skip
# built-in tiny models (models/build.py's BUILTIN): the same keys, by name
_TINY_COMMON = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
BUILTIN = {
    "tiny-moe": {
        **_TINY_COMMON, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True,
    },
    "tiny-dense": {**_TINY_COMMON, "model_type": "llama"},
}  # fmt: skip


def config_of(source: str) -> dict[str, Any]:
    """The config dict of a built-in name or a model dir's ``config.json`` (its text config)."""
    if source in BUILTIN:
        return dict(BUILTIN[source])
    path = Path(source) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"model.source: cannot read {path}: {exc}") from None


# the config classes' attribute maps: another name a config.json may give a key under
_ALIASES = {
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "mixtral": {"num_local_experts": "num_experts"},
    "deepseek_v3": {"n_routed_experts": "num_local_experts"},
}


def _attrs(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    out = {**_COMMON, **_FAMILIES[model_type], **cfg}
    for key, other in _ALIASES.get(model_type, {}).items():
        if key not in cfg and other in cfg:
            out[key] = cfg[other]
    heads = out["num_attention_heads"]
    if out["num_key_value_heads"] in ("heads", None):
        out["num_key_value_heads"] = heads
    if model_type in ("llama", "mistral") and out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // heads  # the config class derives it
    if model_type == "deepseek_v3" and cfg.get("head_dim") is None:
        out["head_dim"] = out["qk_rope_head_dim"]
    return out


def _unmodeled(cfg: dict[str, Any], model_type: str) -> str | None:
    """Why this config is not sized here (None: it is)."""
    if model_type not in _FAMILIES:
        return f"model_type {model_type!r} is not sized from config.json"
    missing = [k for k in _REQUIRED if not isinstance(cfg.get(k), int)]
    if missing:
        return f"config.json gives no {', '.join(missing)}"
    if any(k in cfg for k in ("text_config", "vision_config", "quantization_config")):
        return "a multimodal or quantized config is sized by its model code"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "partial_rotary_factor" in cfg or "partial_rotary_factor" in rope:
        return "a partial rotary factor is sized by the model code"
    if model_type == "deepseek_v3" and cfg.get("attention_bias"):
        return "deepseek_v3 with attention_bias is sized by its model code"
    return None


def model_spec(source: str, dtype: str) -> tuple[ModelSpec | None, str | None]:
    """The spec of ``source`` at ``dtype`` (a ``model.dtype``), or (None, why not)."""
    cfg = config_of(source)
    mt = str(cfg.get("model_type") or "")
    why = _unmodeled(cfg, mt)
    if why is not None or dtype not in DTYPES:
        return None, why or f"model.dtype {dtype!r} is not sized from config.json"
    a = _attrs(cfg, mt)
    spec = ModelSpec(model_type=mt, dtype=DTYPES[dtype], attrs=a)
    h = a["hidden_size"]
    spec.add("model.embed_tokens.weight", a["vocab_size"], h)
    for i in range(a["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        (_mla if mt == "deepseek_v3" else _attention)(spec, f"{pre}.self_attn")
        _mlp(spec, pre, i)
        spec.add(f"{pre}.input_layernorm.weight", h)
        spec.add(f"{pre}.post_attention_layernorm.weight", h)
    spec.add("model.norm.weight", h)
    if a["tie_word_embeddings"]:
        embed = spec.tensors[0]
        spec.tensors[0] = TensorSpec(
            name=embed.name, shape=embed.shape, dtype=embed.dtype, aliases=("lm_head.weight",)
        )
        spec.linears["lm_head"] = (a["vocab_size"], h)
    else:
        spec.linear("lm_head", a["vocab_size"], h)
    _rotary(spec)
    return spec, None


def _attention(spec: ModelSpec, pre: str) -> None:
    a = spec.attrs
    heads, kv, h = a["num_attention_heads"], a["num_key_value_heads"], a["hidden_size"]
    hd = a["head_dim"] or h // heads
    qkv_bias = spec.model_type == "qwen2" or bool(a.get("attention_bias"))
    spec.linear(f"{pre}.q_proj", heads * hd, h, qkv_bias)
    spec.linear(f"{pre}.k_proj", kv * hd, h, qkv_bias)
    spec.linear(f"{pre}.v_proj", kv * hd, h, qkv_bias)
    spec.linear(f"{pre}.o_proj", h, heads * hd, bool(a.get("attention_bias")))
    if spec.model_type in ("qwen3", "qwen3_moe"):
        spec.add(f"{pre}.q_norm.weight", hd)
        spec.add(f"{pre}.k_norm.weight", hd)


def _mla(spec: ModelSpec, pre: str) -> None:
    """DeepSeek's multi-head latent attention."""
    a = spec.attrs
    heads, h = a["num_attention_heads"], a["hidden_size"]
    nope, rope, v = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
    q_lora, kv_lora = a["q_lora_rank"], a["kv_lora_rank"]
    if q_lora is None:
        spec.linear(f"{pre}.q_proj", heads * (nope + rope), h)
    else:
        spec.linear(f"{pre}.q_a_proj", q_lora, h)
        spec.add(f"{pre}.q_a_layernorm.weight", q_lora)
        spec.linear(f"{pre}.q_b_proj", heads * (nope + rope), q_lora)
    spec.linear(f"{pre}.kv_a_proj_with_mqa", kv_lora + rope, h)
    spec.add(f"{pre}.kv_a_layernorm.weight", kv_lora)
    spec.linear(f"{pre}.kv_b_proj", heads * (nope + v), kv_lora)
    spec.linear(f"{pre}.o_proj", h, heads * v)


def _dense_mlp(spec: ModelSpec, pre: str, inter: int, bias: bool = False) -> None:
    h = spec.attrs["hidden_size"]
    spec.linear(f"{pre}.gate_proj", inter, h, bias)
    spec.linear(f"{pre}.up_proj", inter, h, bias)
    spec.linear(f"{pre}.down_proj", h, inter, bias)


def _experts(spec: ModelSpec, pre: str, n: int, inter: int) -> None:
    h = spec.attrs["hidden_size"]
    spec.experts.append(f"{pre}.experts")
    spec.add(f"{pre}.experts.gate_up_proj", n, 2 * inter, h)
    spec.add(f"{pre}.experts.down_proj", n, h, inter)


def _router(spec: ModelSpec, pre: str, n: int, dtype: DType | None = None) -> None:
    spec.routers.append(f"{pre}.gate")
    spec.add(f"{pre}.gate.weight", n, spec.attrs["hidden_size"], dtype=dtype)


def _mlp(spec: ModelSpec, layer: str, i: int) -> None:
    a, mt, pre = spec.attrs, spec.model_type, f"{layer}.mlp"
    if mt == "qwen3_moe":
        n, step = a["num_experts"], a["decoder_sparse_step"]
        if i not in a["mlp_only_layers"] and n > 0 and (i + 1) % step == 0:
            _experts(spec, pre, n, a["moe_intermediate_size"])
            _router(spec, pre, n)
            return
    elif mt == "mixtral":
        _router(spec, pre, a["num_local_experts"])
        _experts(spec, pre, a["num_local_experts"], a["intermediate_size"])
        return
    elif mt == "deepseek_v3" and i >= a["first_k_dense_replace"]:
        n, inter = a["n_routed_experts"], a["moe_intermediate_size"]
        _experts(spec, pre, n, inter)
        _router(spec, pre, n, _F32)  # the router's weight and bias stay float32
        spec.add(f"{pre}.gate.e_score_correction_bias", n, dtype=_F32)
        _dense_mlp(spec, f"{pre}.shared_experts", inter * a["n_shared_experts"])
        return
    _dense_mlp(spec, pre, a["intermediate_size"], bool(a.get("mlp_bias")))


def _rotary(spec: ModelSpec) -> None:
    """The rotary embedding's two non-persistent float32 tables of ``dim / 2`` frequencies."""
    a = spec.attrs
    hd = a["head_dim"] or a["hidden_size"] // a["num_attention_heads"]
    n = len(range(0, int(hd), 2))
    for b in ("inv_freq", "original_inv_freq"):
        t = TensorSpec(name=f"model.rotary_emb.{b}", shape=(n,), dtype=_F32, persistent=False)
        spec.tensors.append(t)
