"""The whole model a plan sizes, from its config alone (:class:`SpecWhole`, torch-free).

What ``qckpt.pipeline.plan`` asks of a model: its summary, its linears as the checkpoint names
them, and, per EP x TP layout, the tensors rank 0 holds. :class:`SpecWhole` answers from a
:class:`qckpt.plan.spec.ModelSpec` by the sharders' own rules, restated on names and shapes:
EP keeps each fused experts module's block of experts (``parallel.expert.shard_experts``), TP
splits the attention and dense-MLP linears of each decoder layer (``parallel.tensor.tp_plan``),
both recording the ``ShardSpec.block`` the sharders record, refusing what they refuse in the
same words. The meta-model twin (``qckpt.pipeline.plan_meta.MetaWhole``) answers the same
questions off a model built on meta; ``tests/unit/test_plan_spec.py`` holds their plans equal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qckpt.errors import UsageError
from qckpt.formats.sizes import scale_block
from qckpt.models.naming import expert_slices, ignored, is_fused_experts_param
from qckpt.models.quantize_params import plain_params
from qckpt.parallel.shard import ShardSpec
from qckpt.plan.schemes import Linear
from qckpt.plan.spec import ModelSpec
from qckpt.plan.tensors import Held, layer_of

_PARALLEL_KEY = {"expert": "parallel.ep", "tp": "parallel.tp"}
_ATTN = ((("q_proj", "k_proj", "v_proj"), 0), (("o_proj",), 1))
_MLP = ((("gate_proj", "up_proj"), 0), (("down_proj",), 1))


class SpecWhole:
    """A model's plan questions answered from its config (see the module doc)."""

    sized_by = "config.json"

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.model_type = spec.model_type
        self.itemsize = spec.dtype.itemsize
        self.output_embedding: str | None = spec.output_embedding

    def attr(self, key: str, default: Any = None) -> Any:
        return self.spec.attrs.get(key, default)

    def _state(self) -> list[tuple[str, Any]]:
        """(name, TensorSpec) of the state dict: tied tensors under each name."""
        return [
            (n, t) for t in self.spec.tensors if t.persistent for n in (t.name, *t.aliases)
        ]  # fmt: skip

    def summary(self) -> dict[str, int]:
        numels = [(_numel(t.shape), t.dtype.itemsize) for _, t in self._state()]
        return {
            "parameters": sum(n for n, _ in numels),
            "bytes": sum(n * s for n, s in numels),
            "largest_tensor_numel": max((n for n, _ in numels), default=0),
        }

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {n: t.shape for n, t in self._state()}

    def hf_value_sizes(self) -> list[int]:
        """Each tensor of the HF checkpoint it would be, at its dtype: experts per expert."""
        out = []
        for name, t in self._state():
            if not is_fused_experts_param(name):
                out.append(_numel(t.shape) * t.dtype.itemsize)
                continue
            n, rows, cols = t.shape
            if name.endswith("gate_up_proj"):
                out += [rows // 2 * cols * t.dtype.itemsize] * (2 * n)
            else:
                out += [rows * cols * t.dtype.itemsize] * n
        return out

    def linears(self) -> dict[str, Linear]:
        """Every linear as the checkpoint names it (``plan.schemes.checkpoint_linears``)."""
        out: dict[str, Linear] = {}
        lin = self.spec.linears
        for t in self.spec.tensors:
            mod, _, leaf = t.name.rpartition(".")
            if leaf == "weight" and mod in lin:
                out[mod] = Linear(lin[mod], mod)
            elif leaf == "gate_up_proj" and mod in self.spec.experts:
                dn = next(x.shape for x in self.spec.tensors if x.name == f"{mod}.down_proj")
                for sl in expert_slices(mod, self.model_type, t.shape, dn):
                    cols = t.shape[-1] if sl.role != "down" else dn[-1]
                    out[sl.hf_module] = Linear((sl.rows, cols), mod)
        for mod, shape in lin.items():  # a tied head: its weight is the embedding's
            out.setdefault(mod, Linear(shape, mod))
        return out

    def tp_plan(self) -> list[tuple[str, int]]:
        """(linear, 0 column / 1 row) of every linear TP splits, as ``tp_plan`` lists them."""
        lin, out = self.spec.linears, []
        for i in range(int(self.spec.attrs["num_hidden_layers"])):
            pre = f"model.layers.{i}"
            if f"{pre}.self_attn.q_proj" not in lin:
                continue
            for names, dim in _ATTN:
                out += [
                    (f"{pre}.self_attn.{a}", dim) for a in names if f"{pre}.self_attn.{a}" in lin
                ]
            if all(f"{pre}.mlp.{a}" in lin for names, _ in _MLP for a in names):
                out += [(f"{pre}.mlp.{a}", dim) for names, dim in _MLP for a in names]
        return out

    def tp_linears(self) -> int:
        return len(self.tp_plan())

    def _ep(self, ep: int) -> dict[str, ShardSpec]:
        if ep <= 1:
            return {}
        if not self.spec.experts:
            raise UsageError("parallel.ep: > 1 but the model has no fused MoE experts to shard")
        shapes = {t.name: t.shape for t in self.spec.tensors}
        out = {}
        for mod in self.spec.experts:
            n = shapes[f"{mod}.gate_up_proj"][0]
            if n % ep:
                raise UsageError(f"parallel.ep: {ep} does not divide the {n} experts of {mod}")
            for attr in ("gate_up_proj", "down_proj"):
                full = shapes[f"{mod}.{attr}"]
                out[f"{mod}.{attr}"] = ShardSpec.block("expert", full, 0, 0, ep, 0)
        return out

    def _tp(self, tp: int) -> dict[str, ShardSpec]:
        if tp <= 1:
            return {}
        plan = self.tp_plan()
        if not plan:
            raise UsageError("parallel.tp: > 1 but the model has no attention layers to split")
        heads = self.attr("num_attention_heads")
        kv = self.attr("num_key_value_heads") or heads
        if heads is not None and (heads % tp or kv % tp):
            raise UsageError(
                f"parallel.tp: {tp} does not divide the {heads} attention heads and "
                f"{kv} key/value heads"
            )
        lin = self.spec.linears
        for name, dim in plan:
            if lin[name][dim] % tp:
                raise UsageError(
                    f"parallel.tp: {tp} does not divide the {lin[name][dim]} features of {name}"
                )
        out = {}
        for name, dim in plan:
            out[f"{name}.weight"] = ShardSpec.block("tp", lin[name], dim, 0, tp)
            if dim == 0 and name in self.spec.biased:
                out[f"{name}.bias"] = ShardSpec.block("tp", lin[name][:1], 0, 0, tp)
        return out

    def sharded(self, ep: int, tp: int) -> dict[str, ShardSpec]:
        """Rank 0's shard of each split tensor under EP ``ep`` then TP ``tp`` (a UsageError
        naming why the sharders refuse it)."""
        return {**self._ep(ep), **self._tp(tp)}

    def held(self, shards: dict[str, ShardSpec], params: str, ignore: Iterable[str]) -> list[Held]:
        """Every tensor rank 0 holds (``plan.tensors.rank_tensors``' rule) under ``shards``."""
        quantized = set() if plain_params(params) else self._quantizable(list(ignore))
        out = []
        for t in self.spec.tensors:
            shard = shards.get(t.name)
            shape = t.shape
            if shard is not None:
                shape = tuple(shard.local if i == shard.dim else s for i, s in enumerate(shape))
            names = (t.name, *t.aliases)
            fmt = params if t.persistent and any(n in quantized for n in names) else None
            held = Held(
                name=t.name, shape=shape, dtype=t.dtype, fmt=fmt, shard=shard,
                persistent=t.persistent, aliases=t.aliases, layer=layer_of(t.name),
            )  # fmt: skip
            out.append(held)
        return out

    def _quantizable(self, ignore: list[str]) -> set[str]:
        out = {f"{m}.weight" for m in self.spec.linears if not ignored(m, ignore)}
        for mod in self.spec.experts:
            if not ignored(mod, ignore):
                out |= {f"{mod}.gate_up_proj", f"{mod}.down_proj"}
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def block_refusal(held: list[Held]) -> str | None:
    """The sharded load's refusal of a split inside a scale block (``load.shard_scales.
    check_blocks``' rule and words, on sizes alone), or None."""
    for t in held:
        s = t.shard
        if t.fmt is None or s is None:
            continue
        b = scale_block(t.fmt, dict(t.opts), s.dim, len(t.shape))
        if b > 1 and (s.start % b or (s.stop % b and s.stop != s.total)):
            return (
                f"{t.name}: {_PARALLEL_KEY[s.kind]}={s.world} splits dim {s.dim} "
                f"(size {s.total}) at [{s.start}, {s.stop}), inside a {b}-element "
                f"{t.fmt} scale block; pick a split whose blocks are multiples of {b}, "
                "or another format"
            )
    return None
