"""Training checkpoints written here from an HF model's weights: Megatron-Core and torchtitan.

The generators follow the frameworks' keys, shapes and chunking (see
``qckpt/layouts/training.py`` for the files they were checked against) and are
written from the layout rules alone, in the HF -> framework direction, independently of qckpt's
reading code: the fused QKV built group by group, fc1 as cat(gate, up) saved as 2·TP row
fragments, experts stacked on an expert axis, the vocabulary padded, norms under TE's fused
names or the local ones, ``_extra_state`` byte entries. Each stored tensor is saved as a
``ShardedTensor`` with one local shard per layer and TP / EP shard (what Megatron's
``sharded_tensor_to_torch_sharded_tensor`` hands DCP), from one gloo process.

Booby traps: ``common.pt`` and the ``_extra_state`` / ``common_state`` byte entries hold pickles
that would create a file ``PWNED`` next to the checkpoint if anything unpickled them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class _Trap:
    """Unpickling this creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def trap_bytes(path: Path) -> bytes:
    return pickle.dumps(_Trap(str(path)))


def _group(cfg: Any) -> tuple[int, int, int]:
    heads = cfg.num_attention_heads
    groups = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, groups, d


def _qkv(hf: dict, p: str, cfg: Any) -> torch.Tensor:
    heads, groups, d = _group(cfg)
    qpg = heads // groups
    q, k, v = (hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
    rows = []
    for g in range(groups):
        rows += [q[g * qpg * d : (g + 1) * qpg * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    return torch.cat(rows)


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    extra = torch.full((rows - t.shape[0], *t.shape[1:]), 7.0, dtype=t.dtype)  # never read
    return torch.cat([t, extra])


def _mla(hf: dict, p: str, te: bool) -> dict:
    """DeepSeek-V3's MLA projections under Megatron's names (one to one; the up projections
    split in TP rows, the norms fused into them under TE's names)."""
    a = f"{p}.self_attn"
    out = {
        "self_attention.linear_kv_down_proj.weight": (hf[f"{a}.kv_a_proj_with_mqa.weight"], None),
        "self_attention.linear_kv_up_proj.weight": (hf[f"{a}.kv_b_proj.weight"], 0),
        "self_attention.linear_proj.weight": (hf[f"{a}.o_proj.weight"], 1),
    }
    kv_norm = (
        "self_attention.linear_kv_up_proj.layer_norm_weight"
        if te
        else "self_attention.kv_layernorm.weight"
    )
    out[kv_norm] = (hf[f"{a}.kv_a_layernorm.weight"], None)
    if f"{a}.q_a_proj.weight" in hf:
        out["self_attention.linear_q_down_proj.weight"] = (hf[f"{a}.q_a_proj.weight"], None)
        out["self_attention.linear_q_up_proj.weight"] = (hf[f"{a}.q_b_proj.weight"], 0)
        q_norm = (
            "self_attention.linear_q_up_proj.layer_norm_weight"
            if te
            else "self_attention.q_layernorm.weight"
        )
        out[q_norm] = (hf[f"{a}.q_a_layernorm.weight"], None)
    else:
        out["self_attention.linear_q_proj.weight"] = (hf[f"{a}.q_proj.weight"], 0)
    return out


def megatron_layer(hf: dict, cfg: Any, i: int, *, te: bool, glu_split: bool) -> dict:
    """One layer's Megatron tensors (local names -> (tensor, TP axis or None))."""
    p = f"model.layers.{i}"
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    moe = f"{p}.mlp.gate.weight" in hf
    mla = f"{p}.self_attn.kv_a_proj_with_mqa.weight" in hf
    if mla:
        out.update(_mla(hf, p, te))
    else:
        out["self_attention.linear_qkv.weight"] = (_qkv(hf, p, cfg), 0)
        out["self_attention.linear_proj.weight"] = (hf[f"{p}.self_attn.o_proj.weight"], 1)
    if f"{p}.self_attn.q_norm.weight" in hf:
        out["self_attention.q_layernorm.weight"] = (hf[f"{p}.self_attn.q_norm.weight"], None)
        out["self_attention.k_layernorm.weight"] = (hf[f"{p}.self_attn.k_norm.weight"], None)
    ln1, ln2 = hf[f"{p}.input_layernorm.weight"], hf[f"{p}.post_attention_layernorm.weight"]
    # MLA keeps its input norm apart (no fused QKV linear carries it)
    ln1_name = (
        "self_attention.linear_qkv.layer_norm_weight"
        if te and not mla
        else "input_layernorm.weight"
    )
    out[ln1_name] = (ln1, None)
    te_mlp = te and not moe  # TE fuses the pre-MLP norm into a dense fc1 only
    out["mlp.linear_fc1.layer_norm_weight" if te_mlp else "pre_mlp_layernorm.weight"] = (ln2, None)
    if not moe:
        gate, up = hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]
        if glu_split:
            out["mlp.linear_fc1.weight_w"], out["mlp.linear_fc1.weight_v"] = (gate, 0), (up, 0)
        else:
            out["mlp.linear_fc1.weight"] = (torch.cat([gate, up]), "glu")
        out["mlp.linear_fc2.weight"] = (hf[f"{p}.mlp.down_proj.weight"], 1)
        return out
    out["mlp.router.weight"] = (hf[f"{p}.mlp.gate.weight"], None)
    if f"{p}.mlp.gate.e_score_correction_bias" in hf:
        out["mlp.router.expert_bias"] = (hf[f"{p}.mlp.gate.e_score_correction_bias"], None)
    if f"{p}.mlp.shared_experts.gate_proj.weight" in hf:
        sh = f"{p}.mlp.shared_experts"
        fc1 = torch.cat([hf[f"{sh}.gate_proj.weight"], hf[f"{sh}.up_proj.weight"]])
        out["mlp.shared_experts.linear_fc1.weight"] = (fc1, "glu")
        out["mlp.shared_experts.linear_fc2.weight"] = (hf[f"{sh}.down_proj.weight"], 1)
    n = sum(1 for k in hf if k.startswith(f"{p}.mlp.experts.") and k.endswith(".down_proj.weight"))
    if glu_split:  # singleton_local_shards: one key per expert, fc1 as weight_w / weight_v
        for e in range(n):
            x = f"{p}.mlp.experts.{e}"
            out[f"mlp.experts.experts.{e}.linear_fc1.weight_w"] = (hf[f"{x}.gate_proj.weight"], 0)
            out[f"mlp.experts.experts.{e}.linear_fc1.weight_v"] = (hf[f"{x}.up_proj.weight"], 0)
            out[f"mlp.experts.experts.{e}.linear_fc2.weight"] = (hf[f"{x}.down_proj.weight"], 1)
        return out
    fc1 = [
        torch.cat(
            [hf[f"{p}.mlp.experts.{e}.gate_proj.weight"], hf[f"{p}.mlp.experts.{e}.up_proj.weight"]]
        )
        for e in range(n)
    ]
    fc2 = [hf[f"{p}.mlp.experts.{e}.down_proj.weight"] for e in range(n)]
    out["mlp.experts.experts.linear_fc1.weight"] = (torch.stack(fc1), "experts")
    out["mlp.experts.experts.linear_fc2.weight"] = (torch.stack(fc2), "experts")
    return out


def _chunks(
    t: torch.Tensor, lead: int, axis: Any, tp: int, ep: int
) -> list[tuple[list, torch.Tensor]]:
    """(global offsets, chunk) of a tensor whose first ``lead`` axes are per layer: one chunk per
    index of those axes, split in ``tp`` along ``axis`` (``glu``: rows in 2·tp fragments, as the
    swiglu factory saves) or in ``ep`` along the expert axis."""
    out = []
    idx = [()]
    for n in t.shape[:lead]:
        idx = [(*a, j) for a in idx for j in range(n)]
    for ix in idx:
        local = t[ix] if ix else t
        if axis == "experts":
            ax, parts = 0, ep
        elif axis == "glu":
            ax, parts = 0, 2 * tp
        else:
            ax, parts = (axis, tp) if axis is not None else (0, 1)
        size = local.shape[ax] // parts if local.dim() else 1
        for j in range(parts if local.dim() else 1):
            offs = [0] * local.dim()
            if local.dim():
                offs[ax] = j * size
                piece = local.narrow(ax, j * size, size)
            else:
                piece = local
            out.append(([*ix, *offs], piece.reshape((1,) * len(ix) + tuple(piece.shape)).clone()))
    return out


def megatron_state(
    hf: dict, cfg: Any, *, stacked: bool = True, te: bool = True, glu_split: bool = False,
    pad_vocab: int = 32, tp: int = 2, ep: int = 2,
) -> dict[str, list[tuple[list, torch.Tensor, list]]]:  # fmt: skip
    """Stored name -> [(global offsets, chunk, global shape)] of a GPTModel checkpoint."""
    layers = [
        megatron_layer(hf, cfg, i, te=te, glu_split=glu_split) for i in range(cfg.num_hidden_layers)
    ]
    out: dict[str, list] = {}

    def put(name: str, t: torch.Tensor, lead: int, axis: Any) -> None:
        out[name] = [(o, c, list(t.shape)) for o, c in _chunks(t, lead, axis, tp, ep)]

    vp = cfg.vocab_size + pad_vocab  # Megatron pads to a multiple of 128·TP; any pad will do
    put("embedding.word_embeddings.weight", _pad(hf["model.embed_tokens.weight"], vp), 0, 0)
    if "lm_head.weight" in hf:
        put("output_layer.weight", _pad(hf["lm_head.weight"], vp), 0, 0)
    put("decoder.final_layernorm.weight", hf["model.norm.weight"], 0, None)
    for i, layer in enumerate(layers):
        for leaf, (t, axis) in layer.items():
            if stacked:
                if all(leaf in other for other in layers):
                    if i == 0:
                        put(
                            f"decoder.layers.{leaf}",
                            torch.stack([lay[leaf][0] for lay in layers]),
                            1,
                            axis,
                        )
                    continue
            put(f"decoder.layers.{i}.{leaf}", t, 0, axis)
    return out


def _sharded(chunks: list[tuple[list, torch.Tensor, list]]) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    shards = [Shard.from_tensor_and_offsets(c, o, rank=0) for o, c, _ in chunks]
    metas = [ShardMetadata(o, list(c.shape), "rank:0/cpu") for o, c, _ in chunks]
    md = ShardedTensorMetadata(
        shards_metadata=metas,
        size=torch.Size(chunks[0][2]),
        tensor_properties=TensorProperties(dtype=chunks[0][1].dtype),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, sharded_tensor_metadata=md, process_group=None
    )


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A gloo group of this process alone (a ShardedTensor needs one), unless one runs."""
    own = not dist.is_initialized()
    if own:
        fd, pg = tempfile.mkstemp(prefix="qckpt-pg-")
        os.close(fd)
        os.unlink(pg)
        dist.init_process_group("gloo", init_method=f"file://{pg}", rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


def write_megatron(hf: dict, cfg: Any, out: Path, *, trap: Path | None = None, **kw: Any) -> Path:
    """A Megatron-Core ``torch_dist`` dir at ``out`` (metadata.json, .metadata, .distcp,
    common.pt) of the HF weights ``hf`` (HF checkpoint names)."""
    import torch.distributed.checkpoint as dcp

    payload = trap_bytes(trap) if trap is not None else pickle.dumps({"args": None})
    out.mkdir(parents=True, exist_ok=True)
    with _one_process_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state: dict[str, Any] = {k: _sharded(v) for k, v in megatron_state(hf, cfg, **kw).items()}
        state["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1"] = io.BytesIO(
            payload
        )
        state["common_state"] = io.BytesIO(payload)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)))
    (out / "common.pt").write_bytes(payload)
    (out / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1,
    }))  # fmt: skip
    return out


def _titan_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF q/k rows -> torchtitan's (the inverse of its adapter's ``to_hf`` permutation)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def titan_state(hf: dict, cfg: Any) -> dict[str, torch.Tensor]:
    heads, groups, _ = _group(cfg)
    llama = cfg.model_type == "llama"
    sd = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if "lm_head.weight" in hf:
        sd["output.weight"] = hf["lm_head.weight"]
    names = {
        "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
        "self_attn.q_norm.weight": "attention.q_norm.weight", "self_attn.k_norm.weight": "attention.k_norm.weight",
        "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
        "mlp.down_proj.weight": "feed_forward.w2.weight", "mlp.gate.weight": "moe.router.gate.weight",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        for x, n in (("q", heads), ("k", groups)):
            w = hf[f"{p}.self_attn.{x}_proj.weight"]
            sd[f"layers.{i}.attention.w{x}.weight"] = _titan_permute(w, n) if llama else w
        for hf_leaf, leaf in names.items():
            if f"{p}.{hf_leaf}" in hf:
                sd[f"layers.{i}.{leaf}"] = hf[f"{p}.{hf_leaf}"]
        n = sum(
            1 for k in hf if k.startswith(f"{p}.mlp.experts.") and k.endswith(".down_proj.weight")
        )
        for w, role in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            if n:
                sd[f"layers.{i}.moe.experts.{w}"] = torch.stack(
                    [hf[f"{p}.mlp.experts.{e}.{role}.weight"] for e in range(n)]
                )
    return {k: v.contiguous().clone() for k, v in sd.items()}


def write_torchtitan(hf: dict, cfg: Any, out: Path) -> Path:
    """A torchtitan DCP dir (model state, plus a training-state byte entry) at ``out``."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = dict(titan_state(hf, cfg))
    state["train_state"] = io.BytesIO(pickle.dumps({"step": 10}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    return out
