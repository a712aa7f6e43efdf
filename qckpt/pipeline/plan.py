"""``qckpt plan``'s body: every rank's memory and reads for a world, from metadata alone.

The model is built once on the meta device (``models.build.build_model``), and for each layout
a copy of it is sharded by :func:`qckpt.pipeline.model.shard`, the commands' own EP-then-TP
order, on a mesh that names rank 0's place and has no process groups (nothing runs a forward).
Then ``qckpt.plan`` sizes what each rank holds, transient and kept, and what it reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qckpt.errors import UsageError
from qckpt.models.quantize_params import PLAIN_PARAMS
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.model import shard
from qckpt.plan.layouts import (
    ACTIVATIONS,
    OFFLOADS,
    RESIDENT_FORMATS,
    Layout,
    check_world,
    preference,
    recipe_layout,
    splits,
)
from qckpt.plan.predict import (
    CalibShape,
    Offload,
    RankFigures,
    calibrate_figures,
    export_figures,
    load_figures,
    rank_samples,
    split_evenly,
)
from qckpt.plan.reads import Reads
from qckpt.plan.schemes import SchemePlan, checkpoint_linears, plan_schemes
from qckpt.plan.tensors import Held, for_rank, rank_tensors
from qckpt.recipe import Recipe

COMMANDS = ("load", "calibrate", "export")
_PLANNED = object()  # stands in for a process group: sharding records it, no forward runs


@dataclass(kw_only=True)
class PlanResult:
    recipe: str
    world_size: int
    nproc_per_node: int
    nnodes: int
    device_bytes: int | None
    layout: Layout
    host_bytes: int | None = None
    checkpoint: str
    model: dict[str, Any]
    rows: dict[str, list[RankFigures]]
    suggestions: dict[str, Layout | None] = field(default_factory=dict)
    extra: dict[str, dict[str, list[RankFigures]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    schemes: SchemePlan | None = None

    def fits(self, command: str) -> bool | None:
        rows = self.rows[command]
        if any(r.refused for r in rows):
            return False
        if any(r.fits is None for r in rows):
            return None
        return all(r.fits for r in rows)

    def to_dict(self) -> dict[str, Any]:
        def lay(x: Layout | None) -> dict | None:
            if x is None:
                return None
            return {**x.__dict__, "label": x.label(), "set": x.overrides(self.layout)}

        return {
            "recipe": self.recipe,
            "world_size": self.world_size,
            "nproc_per_node": self.nproc_per_node,
            "nnodes": self.nnodes,
            "gpu_memory_bytes": self.device_bytes,
            "host_memory_bytes": self.host_bytes,
            "layout": lay(self.layout),
            "checkpoint": self.checkpoint,
            "model": self.model,
            "commands": {c: [r.to_dict() for r in rows] for c, rows in self.rows.items()},
            "fits": {c: self.fits(c) for c in self.rows},
            "suggestion": {c: lay(s) for c, s in self.suggestions.items()},
            "layouts": {
                label: {c: [r.to_dict() for r in rows] for c, rows in cmds.items()}
                for label, cmds in self.extra.items()
            },
            "notes": self.notes,
            # per scheme for a mixed recipe; a one-scheme plan keeps its keys
            **(self.schemes.to_dict() if self.schemes is not None and self.schemes.mixed else {}),
        }


def _mesh(world: int, layout: Layout) -> Mesh:
    return Mesh(
        world_size=world,
        dp=layout.dp(world),
        ep=layout.ep,
        tp=layout.tp,
        device=torch.device("meta"),
        ep_group=_PLANNED if layout.ep > 1 else None,  # type: ignore[arg-type]
        tp_group=_PLANNED if layout.tp > 1 else None,  # type: ignore[arg-type]
    )


_BUILT: dict[tuple, nn.Module] = {}


def _whole(source: str, dtype: str) -> nn.Module:
    """The whole model on meta. Kept for the next plan of the same config in this process (a
    large model takes seconds to build); nothing here changes it: layouts shard copies."""
    from qckpt.models.build import build_model

    cfg = Path(source) / "config.json"
    key = (source, dtype, cfg.stat().st_mtime_ns if cfg.is_file() else None)
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = build_model(source, dtype=dtype, device="meta")
    return _BUILT[key]


class _Planner:
    """The whole model on meta, its checkpoint's metadata, and the recipe; plans layouts."""

    def __init__(
        self,
        recipe: Recipe,
        world: int,
        nproc: int,
        device_bytes: int | None,
        host_bytes: int | None = None,
    ):
        from qckpt.models.build import model_type

        self.recipe, self.world, self.nproc, self.device_bytes = recipe, world, nproc, device_bytes
        # a node's host memory, shared by its ranks
        self.host_share = None if host_bytes is None else host_bytes // nproc
        self.whole = _whole(recipe.model.source, recipe.model.dtype)
        # the recipe's schemes on this model's linears: a split fused group, a target that
        # matches nothing or a scheme that cannot be is refused before anything is read
        self.schemes = _scheme_plan(recipe, self.whole)
        expected = {k: v.shape for k, v in self.whole.state_dict(keep_vars=True).items()}
        self.reads = Reads.open(
            recipe.checkpoint.path,
            recipe.checkpoint.format,
            model_type=model_type(self.whole) or None,
            expected=expected,
            config=getattr(self.whole, "config", None),
        )
        self._sharded: dict[tuple[int, int], nn.Module | str] = {}
        self._refusals: dict[tuple, str | None] = {}
        from qckpt.parallel.tensor import tp_plan

        self._tp_linears = len(tp_plan(self.whole))

    def sharded(self, layout: Layout) -> nn.Module:
        """Rank 0's model under ``layout`` (a UsageError naming why it cannot be split)."""
        key = (layout.ep, layout.tp)
        if key not in self._sharded and layout.tp > 1 and not self._tp_linears:
            # the TP sharder refuses a model it finds nothing to split in (MLA attention):
            # asked of its own plan, before a copy of the model is made for nothing
            self._sharded[key] = "parallel.tp: > 1 but the model has no attention layers to split"
        if key not in self._sharded:
            model = copy.deepcopy(self.whole)
            try:
                shard(model, _mesh(self.world, layout))
                self._sharded[key] = model
            except UsageError as exc:
                self._sharded[key] = str(exc)
        got = self._sharded[key]
        if isinstance(got, str):
            raise UsageError(got)
        return got

    def calib_shape(self, layout: Layout) -> CalibShape:
        cfg = self.whole.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        hidden = int(cfg.hidden_size)
        heads = int(getattr(cfg, "num_attention_heads", 1))
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        moe = int(getattr(cfg, "moe_intermediate_size", 0) or 0) * max(top_k, 1)
        dense = int(getattr(cfg, "intermediate_size", 0) or 0)
        data = self.recipe.calibrate.data
        return CalibShape(
            hidden=hidden,
            vocab=int(cfg.vocab_size),
            intermediate=max(dense, moe) // layout.tp,
            attn_width=(2 * heads + 2 * kv) * head_dim // layout.tp,
            itemsize=self.whole.dtype.itemsize,
            seq_len=data.seq_len,
            batch_size=data.batch_size,
            ep=layout.ep,
            top_k=top_k,
            head_dim=head_dim,
        )

    def offload(self, layout: Layout) -> Offload:
        """``calibrate.offload``'s setting; the output embedding stays off the device unless a
        quantizer lives there (not in ``quant.ignore``), as ``calib.layerwise`` decides."""
        head = emb = None
        out_emb = self.whole.get_output_embeddings()
        for name, mod in self.whole.named_modules():
            if mod is out_emb:
                emb = name
                head = name if self.unquantized(name) else None
        return Offload(
            mode=layout.offload, activations=layout.activations, head=head, out_emb=emb,
            second_pass=self.recipe.calibrate.algorithm == "gptq",
        )  # fmt: skip

    def unquantized(self, module: str) -> bool:
        """Whether the model's ``module`` is left in the model dtype: ``quant.ignore`` matches
        it, or no scheme of the recipe quantizes it."""
        from qckpt.models.naming import ignored

        return ignored(module, self.recipe.quant.ignore) or not self.schemes.quantizes(module)

    def tensors(self, layout: Layout, params: str) -> list[Held]:
        return rank_tensors(self.sharded(layout), params=params, ignore=self.recipe.quant.ignore)

    def ranks(self, layout: Layout) -> list[tuple[int, int, int, int]]:
        """(rank, dp_rank, ep_rank, tp_rank) by the mesh's rule (tp fastest, then ep)."""
        ep, tp = layout.ep, layout.tp
        return [(r, (r // tp) // ep, (r // tp) % ep, r % tp) for r in range(self.world)]

    def figures(
        self, layout: Layout, command: str, ranks: list[tuple[int, int, int, int]], reads: bool
    ) -> list[RankFigures]:
        """``command``'s figures on ``ranks`` under ``layout`` (``reads=False``: bytes read
        left at 0, for the layout search, where only memory decides)."""
        from dataclasses import replace

        if command == "export":
            return self._export(ranks)
        if command == "load":
            params = self.recipe.load.params
        else:  # resident in the model dtype: plain parameters
            params = layout.resident if layout.quantized_resident else PLAIN_PARAMS
        base = self.tensors(layout, params)
        refused = self.refusal(layout, params, base)
        one = self._load_one if command == "load" else self._calibrate_one
        done: dict[tuple, RankFigures] = {}
        out = []
        for rank, dp_rank, ep_rank, tp_rank in ranks:
            samples = self._samples(layout, dp_rank, ep_rank) if command == "calibrate" else 0
            key = (ep_rank, tp_rank, samples)
            if key not in done:
                held = for_rank(base, ep_rank, tp_rank)
                done[key] = one(layout, held, rank=rank, samples=samples, reads=reads)
            row = replace(done[key], rank=rank, refused=refused)
            out.append(row.judge(self.device_bytes, self.host_share))
        return out

    def _samples(self, layout: Layout, dp_rank: int, ep_rank: int) -> int:
        data = self.recipe.calibrate.data
        dw = layout.dp(self.world) * layout.ep
        return rank_samples(data.num_samples, data.batch_size, dp_rank * layout.ep + ep_rank, dw)

    def _inflight(self) -> int:
        lo = self.recipe.load
        return lo.max_inflight if lo.reader == "fast" and lo.stream else 1

    def _load_one(self, layout: Layout, held: list[Held], *, rank, samples, reads) -> RankFigures:
        lo = self.recipe.load
        return load_figures(
            held,
            self.reads.using(lo.reader) if reads else None,
            rank=rank,
            stream=lo.stream,
            main_params=lo.main_params == "fp32",
            max_inflight=self._inflight(),
        )

    def _calibrate_one(
        self, layout: Layout, held: list[Held], *, rank, samples, reads
    ) -> RankFigures:
        off = self.offload(layout)
        # the resident load reads with the recipe's reader; calibrate.offload's layer reads
        # with load_checkpoint's default one (fast)
        reader = "fast" if off.active else self.recipe.load.reader
        shape = self.calib_shape(layout)
        out = calibrate_figures(
            held,
            self.reads.using(reader) if reads else None,
            shape,
            rank=rank,
            samples=samples,
            offload=off,
            max_inflight=self._inflight(),
        )
        if self.recipe.calibrate.algorithm == "gptq":
            from qckpt.plan.predict import gptq_bytes

            cross = self.recipe.calibrate.gptq_inputs == "quantized"  # C beside each Hessian
            out.gptq_bytes = gptq_bytes(held, shape, samples, self.unquantized, cross)
        if self.recipe.calibrate.algorithm == "awq":
            from qckpt.plan.predict import awq_bytes

            grid = self.recipe.calibrate.awq_grid
            out.awq_bytes = awq_bytes(held, shape, samples, self.unquantized, grid)
        return out

    def refusal(self, layout: Layout, params: str, held: list[Held]) -> str | None:
        """The sharded load's refusal of a split inside a scale block of ``params``
        (``qckpt.load.shard_scales.check_blocks``, asked with meta tensors), or None."""
        key = (layout.ep, layout.tp, params)
        if key not in self._refusals:
            self._refusals[key] = _block_refusal(held)
        return self._refusals[key]

    def _export(self, ranks: list[tuple[int, int, int, int]]) -> list[RankFigures]:
        largest, total, count = self.reads.source_stats(self.whole)
        # quantized on a GPU when the plan is for GPUs (--gpu-memory) and the recipe lets it
        dev = self.recipe.export.device
        cuda = dev == "cuda" or (dev == "auto" and self.device_bytes is not None)
        dcp = self.reads.path is not None and self.reads.format == "dcp"
        return [
            export_figures(
                rank=rank,
                largest=largest,
                bytes_read=split_evenly(total, self.world, rank),
                tensors=count,
                dcp=dcp,
                cuda=cuda,
            ).judge(self.device_bytes, self.host_share)
            for rank, *_ in ranks
        ]

    def suggest(self, command: str, nnodes: int) -> Layout | None:
        """The first layout in :func:`preference` order whose every rank fits."""
        if command == "export":
            return None
        if command == "load":
            cands = [Layout(ep=ep, tp=tp) for ep, tp in splits(self.world, self.nproc)]
        else:
            every = [
                Layout(ep=ep, tp=tp, resident=res, offload=off, activations=act)
                for ep, tp in splits(self.world, self.nproc)
                for res in RESIDENT_FORMATS
                for off in OFFLOADS
                for act in ACTIVATIONS
            ]
            # a layout that holds weights or activations in host memory is suggested only
            # when the host memory is known (--host-memory)
            cands = [
                c
                for c in every
                if c.problem() is None and (self.host_share is not None or not c.uses_host)
            ]
        first = [self.ranks(Layout())[0]]  # rank 0 holds the most (equal blocks; data rank 0)
        for cand in sorted(cands, key=preference):
            try:
                rows = self.figures(cand, command, first, reads=False)
            except UsageError:
                continue  # the sharders refuse this split for this model
            if all(x.fits for x in rows):
                return cand
        return None


def plan(
    recipe: Recipe,
    *,
    recipe_path: str = "",
    nproc_per_node: int,
    nnodes: int = 1,
    device_bytes: int | None = None,
    host_bytes: int | None = None,
    layouts: list[Layout] | tuple[Layout, ...] = (),
    suggest: bool = True,
) -> PlanResult:
    """Every rank's figures for ``load``, ``calibrate`` and ``export`` under the recipe's
    layout (and each of ``layouts``), and the smallest layout that fits ``device_bytes``."""
    if nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node: must be >= 1, got {nproc_per_node}")
    if nnodes < 1:
        raise UsageError(f"--nnodes: must be >= 1, got {nnodes}")
    world = nproc_per_node * nnodes
    recipe.parallel.check_world(world)
    base = recipe_layout(recipe)
    for lay in layouts:
        why = check_world(lay, world, nproc_per_node)
        if why:
            raise UsageError(f"--layout {lay.label()}: {why}")
    p = _Planner(recipe, world, nproc_per_node, device_bytes, host_bytes)
    p.sharded(base)  # a split the model refuses is refused here, as the command would
    ranks = p.ranks(base)
    rows = {c: p.figures(base, c, ranks, reads=True) for c in COMMANDS}
    extra = {}
    for lay in layouts:
        p.sharded(lay)
        extra[lay.label()] = {c: p.figures(lay, c, p.ranks(lay), reads=True) for c in COMMANDS}
    notes = [p.reads.describe]
    if recipe.load.backend == "te":
        notes.append("load.backend te: planned as qckpt's native formats of the same name")
    why = check_world(base, world, nproc_per_node)
    if why:
        notes.append(f"the recipe's layout: {why} (TP across nodes is slow)")
    suggestions = {}
    if device_bytes is not None and suggest:
        suggestions = {c: p.suggest(c, nnodes) for c in COMMANDS}
    return PlanResult(
        recipe=recipe_path,
        world_size=world,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        layout=base,
        checkpoint=p.reads.describe,
        model=_model_summary(p),
        rows=rows,
        suggestions=suggestions,
        extra=extra,
        notes=notes,
        schemes=p.schemes,
    )


def _block_refusal(held: list[Held]) -> str | None:
    from qckpt import formats
    from qckpt.load.shard_scales import check_blocks

    split = [t for t in held if t.fmt is not None and t.shard is not None]
    state = {
        t.name: formats.empty(t.shape, t.fmt, nominal_dtype=t.dtype, device="meta", **dict(t.opts))
        for t in split
    }
    try:
        check_blocks(state, {t.name: t.shard for t in split})
    except UsageError as exc:
        return str(exc)
    return None


def _scheme_plan(recipe: Recipe, whole: nn.Module) -> SchemePlan:
    from qckpt.models.build import model_type

    sd = whole.state_dict()
    total = sum(v.numel() * v.element_size() for v in sd.values())
    linears = checkpoint_linears(whole, model_type(whole))
    return plan_schemes(recipe.quant, linears, total, whole.dtype.itemsize)


def _model_summary(p: _Planner) -> dict[str, Any]:
    sd = p.whole.state_dict()
    cfg = p.whole.config
    return {
        "source": p.recipe.model.source,
        "model_type": getattr(cfg, "model_type", ""),
        "dtype": p.recipe.model.dtype,
        "parameters": sum(v.numel() for v in sd.values()),
        "bytes": sum(v.numel() * v.element_size() for v in sd.values()),
        "largest_tensor_numel": max((v.numel() for v in sd.values()), default=0),
    }
