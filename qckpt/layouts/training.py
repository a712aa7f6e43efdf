"""Training checkpoints' layouts mapped onto Hugging Face names: Megatron-Core and torchtitan.

A training framework's DCP checkpoint stores the model under its own names and layouts. This
module says, for every HF checkpoint tensor a model config expects (``hf_targets``), which
rectangles of which stored tensors make it (:class:`Piece`: a stored region and where it lands
in the HF tensor), from the stored names and shapes alone (no tensor data). Readers
(``training_sources``) then read each region as it lies and place it; nothing here reads bytes.

Megatron-Core ``torch_dist`` (checked against NVIDIA/Megatron-LM ``megatron/core``:
``transformer/transformer_block.py`` sharded_state_dict, ``transformer/mlp.py``
``apply_swiglu_sharded_factory``, ``transformer/moe/experts.py`` SequentialMLP / TEGroupedMLP
sharded_state_dict, ``dist_checkpointing/strategies/torch.py``):

* layers stacked (``decoder.layers.<leaf>`` with a leading [L] axis, one chunk per layer and TP
  shard) or per layer (``decoder.layers.<i>.<leaf>``: non-homogeneous stacks such as
  DeepSeek-V3's dense-then-MoE);
* ``self_attention.linear_qkv.weight``: per query group g (of ``num_key_value_heads``), rows
  ``[q of heads/groups heads, k, v]``, each head ``head_dim`` rows (the split is by head dim,
  not hidden/heads); the groups in order (TP shards hold whole groups);
* ``mlp.linear_fc1.weight`` [2F, H] = [gate; up] globally whatever the TP (the swiglu factory
  saves each rank's gate at offset t and up at TP + t of 2·TP fragments); some versions
  (``singleton_local_shards``) wrote ``linear_fc1.weight_w`` (gate) and ``weight_v`` (up);
* routed experts ``mlp.experts.experts.linear_fc1.weight`` with an expert axis after the layer
  axis ([L, E, 2F, H] stacked; [E, 2F, H] per layer), or one key per expert
  (``mlp.experts.experts.<e>.linear_fc1.weight``); ``mlp.router.weight``,
  ``mlp.router.expert_bias``, ``mlp.shared_experts.linear_fc1/linear_fc2``;
* norms under their local names (``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm``,
  ``k_layernorm``, ``kv_layernorm``) or fused into the next linear by Transformer Engine
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``,
  ``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``);
* MLA (DeepSeek-V3): ``linear_q_down_proj`` / ``linear_q_up_proj`` (or ``linear_q_proj``),
  ``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``: one to one (same row order
  per head as HF's q_b_proj / kv_b_proj: Megatron views them [heads, head dim] too);
* ``embedding.word_embeddings.weight`` and ``output_layer.weight`` padded to the padded vocab:
  the config's first ``vocab_size`` rows are read;
* ``*._extra_state`` (TE's FP8 metadata, pickled bytes) skipped, never read.

torchtitan (checked against pytorch/torchtitan ``models/llama3/model/state_dict_adapter.py``
and ``models/qwen3/state_dict_adapter.py``): ``tok_embeddings``, ``layers.<i>.attention.wq/wk/
wv/wo`` (or ``attention.qkv_linear.wq/...``), ``attention.q_norm/k_norm``, ``attention_norm``,
``ffn_norm``, ``feed_forward.w1/w3/w2`` (gate/up/down), ``moe.experts.w1/w3/w2`` [E, F, H] /
[E, H, F] (0.3: ``moe.routed_experts.inner_experts.w1_EFD/w3_EFD/w2_EDF``), ``moe.router.gate``,
``moe.shared_experts.w1/w3/w2``, ``moe.expert_bias`` (0.3: ``expert_bias_E``), ``norm``,
``output`` (or ``lm_head``). torchtitan 0.3.0's own save (its fused ``wqkv`` split by the save
hook into ``qkv_linear.wq/wk/wv``) and ``to_hf`` were run to make tests/fixtures/torchtitan. The Llama adapter's ``to_hf`` permutes wq and wk per head
(``view(heads, D/2, 2, H).transpose(1, 2)``: RoPE's interleaved pairs to HF's halves); the
Qwen3 adapter applies none. So the permutation is applied for ``model_type`` llama only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qckpt.errors import CheckpointError

FRAMEWORKS = ("megatron", "torchtitan")


# stored keys that are never model tensors (TE's pickled FP8 state; training state)
_SKIP_RE = re.compile(r"(^|\.)_extra_state(\.|$)|^optimizer\.|^rng_state|^rerun_state")


@dataclass(frozen=True)
class Piece:
    """A rectangle of a stored tensor placed in an HF tensor.

    ``src_offsets`` / ``src_sizes``: the region in the stored tensor's global coordinates;
    ``dest_offsets`` / ``dest_sizes``: where it lands in the HF tensor. The two shapes agree
    once their length-1 axes are dropped (same elements in the same row-major order), except
    that ``interleave`` (torchtitan Llama q/k) says the region's rows come in RoPE-interleaved
    order, per head of that many rows, and are permuted into HF's order.
    """

    stored: str
    src_offsets: tuple[int, ...]
    src_sizes: tuple[int, ...]
    dest_offsets: tuple[int, ...]
    dest_sizes: tuple[int, ...]
    interleave: int = 0


@dataclass
class Target:
    """One HF checkpoint tensor and the pieces that fill it."""

    name: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    dtype: Any = None  # the stored dtype (all pieces share it)


@dataclass
class Mapping:
    """What a training checkpoint holds, in HF terms."""

    framework: str
    targets: dict[str, Target]
    stacking: str  # "stacked" | "per-layer" | "mixed" | "none"
    leftover: list[str]  # stored model tensors no HF tensor uses (each named to the user)
    skipped: list[str]  # stored keys that are no model tensor (_extra_state, optimizer, ...)
    detail: dict[str, Any] = field(default_factory=dict)


class _Cfg:
    """The HF config's fields, from a transformers config or a dict."""

    def __init__(self, config: Any) -> None:
        self.c = config

    def get(self, key: str, default: Any = None) -> Any:
        if isinstance(self.c, dict):
            v = self.c.get(key, default)
        else:
            v = getattr(self.c, key, default)
        return default if v is None else v

    @property
    def heads(self) -> int:
        return int(self.get("num_attention_heads"))

    @property
    def groups(self) -> int:
        return int(self.get("num_key_value_heads", self.heads))

    @property
    def head_dim(self) -> int:
        return int(self.get("head_dim", int(self.get("hidden_size")) // self.heads))


# ---- stored regions ------------------------------------------------------------------------


class _Stored:
    """The stored names and shapes, and which ones the mapping used."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, Any]) -> None:
        self.shapes = shapes
        self.dtypes = dtypes
        self.used: set[str] = set()
        self.layouts: set[str] = set()

    def find(self, candidates: list[tuple[str, tuple[int, ...]]], ndim: int) -> tuple | None:
        """The first (key, lead index) whose stored tensor has ``len(lead) + ndim`` axes."""
        for key, lead in candidates:
            shape = self.shapes.get(key)
            if shape is not None and len(shape) == len(lead) + ndim:
                for i, n in zip(lead, shape, strict=False):
                    if i >= n:
                        raise CheckpointError(
                            f"{key}: index {list(lead)} is outside its shape {list(shape)}"
                        )
                return key, lead
        return None


def _piece(
    key: str,
    lead: tuple[int, ...],
    stored_shape: tuple[int, ...],
    rows: tuple[int, int] | None,
    dest_row: int,
    interleave: int = 0,
) -> Piece:
    """Rows ``rows`` (start, count; None: all) of the local tensor at ``lead`` of ``key``."""
    local = stored_shape[len(lead) :]
    start, n = rows if rows is not None else (0, local[0] if local else 1)
    if local and start + n > local[0]:
        raise CheckpointError(
            f"{key}: needs rows {start}..{start + n} of a tensor of {local[0]} rows "
            "(the HF config does not match the checkpoint)"
        )
    rest = tuple(local[1:])
    if not local:
        return Piece(key, lead, (1,) * len(lead), (), ())
    return Piece(
        key,
        (*lead, start, *(0,) * len(rest)),
        (*(1,) * len(lead), n, *rest),
        (dest_row, *(0,) * len(rest)),
        (n, *rest),
        interleave,
    )


# ---- Megatron-Core ---------------------------------------------------------------------------


def _mcore_layer(st: _Stored, i: int, leaf: str, ndim: int) -> tuple | None:
    return st.find([(f"decoder.layers.{i}.{leaf}", ()), (f"decoder.layers.{leaf}", (i,))], ndim)


def _mcore_expert(st: _Stored, i: int, e: int, leaf: str, ndim: int) -> tuple | None:
    """An expert's tensor: with an expert axis (stacked or per layer) or one key per expert."""
    pre = "mlp.experts.experts"
    return st.find(
        [
            (f"decoder.layers.{i}.{pre}.{leaf}", (e,)),
            (f"decoder.layers.{pre}.{leaf}", (i, e)),
            (f"decoder.layers.{i}.{pre}.{e}.{leaf}", ()),
            (f"decoder.layers.{pre}.{e}.{leaf}", (i,)),
        ],
        ndim,
    )


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


_GLU = {"gate_proj": 0, "up_proj": 1}


def _glu_half(
    st: _Stored, found: Callable[[str, int], tuple | None], which: str, rows: int
) -> list[Piece] | None:
    """The gate or up half of a GLU fc1 (``linear_fc1.weight`` = [gate; up], or the
    ``weight_w`` / ``weight_v`` split)."""
    half = _GLU[which]
    hit = found("linear_fc1.weight", 2)
    if hit is not None:
        key, lead = hit
        return [_piece(key, lead, st.shapes[key], (half * rows, rows), 0)]
    hit = found("linear_fc1.weight_" + "wv"[half], 2)
    if hit is not None:
        key, lead = hit
        return [_piece(key, lead, st.shapes[key], None, 0)]
    return None


def _mcore_qkv(st: _Stored, cfg: _Cfg, i: int, proj: str, leaf: str, shape: tuple) -> list | None:
    ndim = len(shape)
    hit = _mcore_layer(st, i, f"self_attention.linear_qkv.{leaf}", ndim)
    if hit is None:
        return None
    key, lead = hit
    groups, d = cfg.groups, cfg.head_dim
    qpg = cfg.heads // groups
    per = (qpg + 2) * d  # rows of one query group: its q heads, then k, then v
    pieces = []
    for g in range(groups):
        if proj == "q_proj":
            pieces.append(_piece(key, lead, st.shapes[key], (g * per, qpg * d), g * qpg * d))
        else:
            at = g * per + (qpg + (proj == "v_proj")) * d
            pieces.append(_piece(key, lead, st.shapes[key], (at, d), g * d))
    return pieces


_MCORE_ATTN = {
    "self_attn.o_proj.weight": ["self_attention.linear_proj.weight"],
    "self_attn.q_norm.weight": ["self_attention.q_layernorm.weight"],
    "self_attn.k_norm.weight": ["self_attention.k_layernorm.weight"],
    "input_layernorm.weight": [
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
    ],
    "post_attention_layernorm.weight": [
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
    ],
    # MLA (DeepSeek-V3)
    "self_attn.q_a_proj.weight": ["self_attention.linear_q_down_proj.weight"],
    "self_attn.q_b_proj.weight": ["self_attention.linear_q_up_proj.weight"],
    "self_attn.q_proj.weight": ["self_attention.linear_q_proj.weight"],
    "self_attn.kv_a_proj_with_mqa.weight": ["self_attention.linear_kv_down_proj.weight"],
    "self_attn.kv_b_proj.weight": ["self_attention.linear_kv_up_proj.weight"],
    "self_attn.q_a_layernorm.weight": [
        "self_attention.q_layernorm.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight",
    ],
    "self_attn.kv_a_layernorm.weight": [
        "self_attention.kv_layernorm.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight",
    ],
    "mlp.down_proj.weight": ["mlp.linear_fc2.weight"],
    "mlp.gate.weight": ["mlp.router.weight"],
    "mlp.gate.e_score_correction_bias": ["mlp.router.expert_bias"],
    "mlp.shared_experts.down_proj.weight": ["mlp.shared_experts.linear_fc2.weight"],
    "mlp.shared_expert.down_proj.weight": ["mlp.shared_experts.linear_fc2.weight"],
    "mlp.shared_expert_gate.weight": ["mlp.shared_experts.gate_weight"],
}


def _mcore_layer_target(st: _Stored, cfg: _Cfg, i: int, rest: str, shape: tuple) -> list | None:
    ndim = len(shape)
    m = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", rest)
    if m and not (cfg.get("q_lora_rank") is not None or cfg.get("kv_lora_rank")):
        return _mcore_qkv(st, cfg, i, f"{m[1]}_proj", m[2], shape)
    m = _EXPERT_RE.match(rest)
    if m:
        e, which = int(m[1]), m[2]
        if which == "down_proj":
            hit = _mcore_expert(st, i, e, "linear_fc2.weight", 2)
            return None if hit is None else [_piece(*hit, st.shapes[hit[0]], None, 0)]
        return _glu_half(st, lambda leaf, n: _mcore_expert(st, i, e, leaf, n), which, shape[0])
    m = re.match(r"^mlp\.(shared_experts?\.)?(gate_proj|up_proj)\.weight$", rest)
    if m:
        pre = "mlp.shared_experts." if m[1] else "mlp."
        return _glu_half(st, lambda leaf, n: _mcore_layer(st, i, pre + leaf, n), m[2], shape[0])
    for leaf in _MCORE_ATTN.get(rest, ()):
        hit = _mcore_layer(st, i, leaf, ndim)
        if hit is not None:
            return [_piece(*hit, st.shapes[hit[0]], None, 0)]
    return None


def _vocab_rows(st: _Stored, key: str, shape: tuple) -> list[Piece] | None:
    """The first ``shape[0]`` (the config's vocab) rows of a padded-vocab tensor."""
    stored = st.shapes.get(key)
    if stored is None or len(stored) != len(shape):
        return None
    return [_piece(key, (), stored, (0, shape[0]), 0)]


def _mcore_target(st: _Stored, cfg: _Cfg, name: str, shape: tuple) -> list | None:
    m = _LAYER_RE.match(name)
    if m:
        return _mcore_layer_target(st, cfg, int(m[1]), m[2], shape)
    if name == "model.embed_tokens.weight":
        return _vocab_rows(st, "embedding.word_embeddings.weight", shape)
    if name == "lm_head.weight":
        out = _vocab_rows(st, "output_layer.weight", shape)
        if out is None and cfg.get("tie_word_embeddings", False):
            out = _vocab_rows(st, "embedding.word_embeddings.weight", shape)
        return out
    if name == "model.norm.weight":
        key = "decoder.final_layernorm.weight"
        return [_piece(key, (), st.shapes[key], None, 0)] if key in st.shapes else None
    return None


# ---- torchtitan --------------------------------------------------------------------------------


_TITAN_LAYER = {
    "self_attn.q_proj.weight": ["attention.wq.weight", "attention.qkv_linear.wq.weight"],
    "self_attn.k_proj.weight": ["attention.wk.weight", "attention.qkv_linear.wk.weight"],
    "self_attn.v_proj.weight": ["attention.wv.weight", "attention.qkv_linear.wv.weight"],
    "self_attn.o_proj.weight": ["attention.wo.weight"],
    "self_attn.q_norm.weight": ["attention.q_norm.weight"],
    "self_attn.k_norm.weight": ["attention.k_norm.weight"],
    "input_layernorm.weight": ["attention_norm.weight"],
    "post_attention_layernorm.weight": ["ffn_norm.weight"],
    "mlp.gate_proj.weight": ["feed_forward.w1.weight"],
    "mlp.up_proj.weight": ["feed_forward.w3.weight"],
    "mlp.down_proj.weight": ["feed_forward.w2.weight"],
    "mlp.gate.weight": ["moe.router.gate.weight"],
    "mlp.gate.e_score_correction_bias": ["moe.expert_bias", "moe.expert_bias_E"],
    "mlp.shared_experts.gate_proj.weight": ["moe.shared_experts.w1.weight"],
    "mlp.shared_experts.up_proj.weight": ["moe.shared_experts.w3.weight"],
    "mlp.shared_experts.down_proj.weight": ["moe.shared_experts.w2.weight"],
    # MLA (torchtitan's DeepSeek-V3 adapter's names; mapped from the names alone, unchecked
    # against a torchtitan run)
    "self_attn.q_a_proj.weight": ["attention.wq_a.weight"],
    "self_attn.q_a_layernorm.weight": ["attention.q_norm.weight"],
    "self_attn.q_b_proj.weight": ["attention.wq_b.weight"],
    "self_attn.kv_a_proj_with_mqa.weight": ["attention.wkv_a.weight"],
    "self_attn.kv_a_layernorm.weight": ["attention.kv_norm.weight", "kv_norm.weight"],
    "self_attn.kv_b_proj.weight": ["attention.wkv_b.weight"],
}


# routed experts, [E, F, H] (w1, w3) and [E, H, F] (w2): named ``moe.experts.w1`` by torchtitan
# up to 0.2, ``moe.routed_experts.inner_experts.w1_EFD`` by 0.3
_TITAN_EXPERT = {
    "gate_proj": ("moe.experts.w1", "moe.routed_experts.inner_experts.w1_EFD"),
    "up_proj": ("moe.experts.w3", "moe.routed_experts.inner_experts.w3_EFD"),
    "down_proj": ("moe.experts.w2", "moe.routed_experts.inner_experts.w2_EDF"),
}


def _titan_target(st: _Stored, cfg: _Cfg, name: str, shape: tuple) -> list | None:
    m = _LAYER_RE.match(name)
    if m is None:
        keys = {
            "model.embed_tokens.weight": ["tok_embeddings.weight"],
            "model.norm.weight": ["norm.weight"],
            "lm_head.weight": ["output.weight", "lm_head.weight"],
        }.get(name, [])
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
            keys = [*keys, "tok_embeddings.weight"]
        for key in keys:
            if key in st.shapes:
                return _vocab_rows(st, key, shape)
        return None
    i, rest = int(m[1]), m[2]
    e = _EXPERT_RE.match(rest)
    if e:
        hit = st.find([(f"layers.{i}.{k}", (int(e[1]),)) for k in _TITAN_EXPERT[e[2]]], 2)
        return None if hit is None else [_piece(*hit, st.shapes[hit[0]], None, 0)]
    proj = re.match(r"^self_attn\.([qk])_proj\.weight$", rest)
    # torchtitan's Llama adapter permutes wq / wk on the way to HF; Qwen3's does not
    d = cfg.head_dim if proj and cfg.get("model_type") == "llama" else 0
    for leaf in _TITAN_LAYER.get(rest, ()):
        hit = st.find([(f"layers.{i}.{leaf}", ())], len(shape))
        if hit is None:
            continue
        key, lead = hit
        if not d:
            return [_piece(key, lead, st.shapes[key], None, 0)]
        return [
            _piece(key, lead, st.shapes[key], (h * d, d), h * d, d) for h in range(shape[0] // d)
        ]
    return None


# ---- the mapping -----------------------------------------------------------------------------


def map_checkpoint(
    framework: str,
    config: Any,
    targets: dict[str, tuple[int, ...]],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, Any],
) -> Mapping:
    """Every HF tensor of ``targets`` (HF checkpoint name -> shape) as pieces of the stored
    tensors (``shapes`` / ``dtypes``: stored name -> global shape / dtype).

    An HF tensor the checkpoint cannot fill is a CheckpointError naming it; a stored tensor
    nothing uses is listed in ``leftover``.
    """
    if framework not in FRAMEWORKS:
        raise CheckpointError(f"unknown training checkpoint framework {framework!r}")
    cfg = _Cfg(config)
    model_keys = {k: v for k, v in shapes.items() if not _SKIP_RE.search(k)}
    st = _Stored(model_keys, dtypes)
    rule = _mcore_target if framework == "megatron" else _titan_target
    out: dict[str, Target] = {}
    for name, shape in targets.items():
        pieces = rule(st, cfg, name, tuple(shape))
        if pieces is None:
            raise CheckpointError(
                f"{name}: the {framework} checkpoint has no tensor for it (model.source's "
                "config does not match the checkpoint, or a layout qckpt does not read)"
            )
        out[name] = _target(name, tuple(shape), pieces, st)
    leftover = sorted(k for k in model_keys if k not in st.used)
    skipped = sorted(k for k in shapes if k not in model_keys)
    return Mapping(framework, out, stacking(st.used), leftover, skipped)


def _target(name: str, shape: tuple[int, ...], pieces: list[Piece], st: _Stored) -> Target:
    filled = 0
    dts = set()
    for p in pieces:
        if len(p.dest_sizes) != len(shape) or any(
            o + n > s for o, n, s in zip(p.dest_offsets, p.dest_sizes, shape, strict=True)
        ):
            raise CheckpointError(
                f"{name}: {p.stored} gives a block of {list(p.dest_sizes)} at "
                f"{list(p.dest_offsets)}, outside the HF shape {list(shape)} (the HF config "
                "does not match the checkpoint)"
            )
        stored = st.shapes[p.stored]
        tail = [n for n in p.src_sizes if n != 1]
        if tail != [n for n in p.dest_sizes if n != 1] or any(
            o + n > s for o, n, s in zip(p.src_offsets, p.src_sizes, stored, strict=True)
        ):
            raise CheckpointError(
                f"{name}: {p.stored} of shape {list(stored)} does not hold the block "
                f"{list(p.dest_sizes)} the HF config implies"
            )
        filled += math.prod(p.dest_sizes)
        dts.add(st.dtypes.get(p.stored))
        st.used.add(p.stored)
    if filled != math.prod(shape):
        raise CheckpointError(
            f"{name}: the checkpoint fills {filled} of its {math.prod(shape)} elements (the HF "
            "config does not match the checkpoint)"
        )
    if len(dts) > 1:
        raise CheckpointError(
            f"{name}: made of stored tensors of mixed dtypes {sorted(map(str, dts))}"
        )
    return Target(name, shape, pieces, dts.pop() if dts else None)


def stacking(used: set[str]) -> str:
    stacked = any(re.match(r"^decoder\.layers\.[A-Za-z_]", k) for k in used)
    per_layer = any(re.match(r"^(decoder\.)?layers\.\d+\.", k) for k in used)
    if stacked and per_layer:
        return "mixed"
    return "stacked" if stacked else ("per-layer" if per_layer else "none")


def architecture(framework: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """What the stored names alone say of the model (for ``inspect`` without a config):
    layers, routed experts, MLA, q/k norms, and how the layers are stored."""
    keys = [k for k in shapes if not _SKIP_RE.search(k)]
    if framework == "megatron":
        idx = {int(m[1]) for k in keys if (m := re.match(r"^decoder\.layers\.(\d+)\.", k))}
        stacked = [k for k in keys if re.match(r"^decoder\.layers\.[A-Za-z_]", k)]
        layers = max([shapes[k][0] for k in stacked] + [i + 1 for i in idx] + [0])
        experts = [shapes[k] for k in keys if ".mlp.experts.experts.linear_fc1" in k]
        n_exp = 0
        if experts:
            k0 = next(k for k in keys if ".mlp.experts.experts.linear_fc1" in k)
            per_expert = re.search(r"experts\.experts\.(\d+)\.", k0) is not None
            if per_expert:
                found = (re.search(r"experts\.experts\.(\d+)\.", k) for k in keys)
                n_exp = len({m[1] for m in found if m})
            else:  # [L, E, 2F, H] stacked, [E, 2F, H] per layer
                stacked_e = re.match(r"^decoder\.layers\.[A-Za-z_]", k0) is not None
                n_exp = experts[0][1 if stacked_e else 0]
        mla = any("linear_kv_down_proj" in k for k in keys)
        qk_norm = any("q_layernorm" in k for k in keys) and not mla
    else:
        idx = {int(m[1]) for k in keys if (m := re.match(r"^(?:model\.)?layers\.(\d+)\.", k))}
        layers = max(idx) + 1 if idx else 0
        exp = [
            shapes[k]
            for k in keys
            if re.search(r"moe\.(routed_experts\.inner_experts|experts)\.w1", k)
        ]
        n_exp = exp[0][0] if exp else 0
        mla = any("wkv_a" in k for k in keys)
        qk_norm = any("attention.q_norm" in k for k in keys)
    kind = "MoE" if n_exp else "dense"
    parts = [kind, "MLA" if mla else "", "q/k norms" if qk_norm else ""]
    return {
        "architecture": ", ".join(p for p in parts if p),
        "layers": layers,
        "routed_experts": n_exp,
        "stored_tensors": len(keys),
    }
