"""``qckpt plan``'s body: every rank's memory and reads for a world, from metadata alone.

The model is sized from its config alone (``plan.spec.model_spec``, ``plan.whole.SpecWhole``:
no torch, no transformers) wherever that is known; else it is built once on the meta device and
each layout's copy sharded by the commands' own sharders (``pipeline.plan_meta.MetaWhole``,
the reference the tests hold the first to), and the report says which (``model.sized_by``).
Then ``qckpt.plan`` sizes what each rank holds, transient and kept, and what it reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from qckpt.errors import UsageError
from qckpt.models.quantize_params import PLAIN_PARAMS
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
from qckpt.plan.schemes import SchemePlan, plan_schemes
from qckpt.plan.tensors import Held, for_rank
from qckpt.recipe import Recipe

COMMANDS = ("load", "calibrate", "export")


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


def _whole(recipe: Recipe, world: int) -> tuple[Any, str | None]:
    """The model's plan questions' answerer, and why it is the meta model (None: it is not).
    A training checkpoint's reader names its tensors by the transformers config: meta."""
    from qckpt.plan.spec import model_spec
    from qckpt.plan.whole import SpecWhole

    spec, why = model_spec(recipe.model.source, recipe.model.dtype)
    path = recipe.checkpoint.path
    if spec is not None and path is not None and os.path.exists(path):
        from qckpt.read.detect import TRAINING_FORMATS, resolve_format

        if resolve_format(path, recipe.checkpoint.format) in TRAINING_FORMATS:
            spec, why = None, "a training checkpoint is read in the names of its model code"
    if spec is not None:
        return SpecWhole(spec), None
    from qckpt.pipeline.plan_meta import MetaWhole

    return MetaWhole(recipe.model.source, recipe.model.dtype, world), why


class _Planner:
    """The whole model (sized from its config, or on meta), its checkpoint's metadata, and
    the recipe; plans layouts."""

    def __init__(
        self,
        recipe: Recipe,
        world: int,
        nproc: int,
        device_bytes: int | None,
        host_bytes: int | None = None,
    ):
        self.recipe, self.world, self.nproc, self.device_bytes = recipe, world, nproc, device_bytes
        # a node's host memory, shared by its ranks
        self.host_share = None if host_bytes is None else host_bytes // nproc
        self.whole, self.meta_reason = _whole(recipe, world)
        # the recipe's schemes on this model's linears: a split fused group, a target that
        # matches nothing or a scheme that cannot be is refused before anything is read
        self.schemes = _scheme_plan(recipe, self.whole)
        self.reads = Reads.open(
            recipe.checkpoint.path,
            recipe.checkpoint.format,
            model_type=self.whole.model_type or None,
            expected=self.whole.expected(),
            config=getattr(self.whole, "config", None),
        )
        self._sharded: dict[tuple[int, int], Any] = {}
        self._refusals: dict[tuple, str | None] = {}
        self._tp_linears = self.whole.tp_linears()

    def sharded(self, layout: Layout) -> Any:
        """Rank 0's model under ``layout`` (a UsageError naming why it cannot be split)."""
        key = (layout.ep, layout.tp)
        if key not in self._sharded and layout.tp > 1 and not self._tp_linears:
            # the TP sharder refuses a model it finds nothing to split in (MLA attention):
            # asked of its own plan, before a copy of the model is made for nothing
            self._sharded[key] = "parallel.tp: > 1 but the model has no attention layers to split"
        if key not in self._sharded:
            try:
                self._sharded[key] = self.whole.sharded(layout.ep, layout.tp)
            except UsageError as exc:
                self._sharded[key] = str(exc)
        got = self._sharded[key]
        if isinstance(got, str):
            raise UsageError(got)
        return got

    def calib_shape(self, layout: Layout) -> CalibShape:
        cfg = self.whole.attr
        hidden = int(cfg("hidden_size"))
        heads = int(cfg("num_attention_heads", 1))
        kv = int(cfg("num_key_value_heads", None) or heads)
        head_dim = int(cfg("head_dim", None) or hidden // heads)
        top_k = int(cfg("num_experts_per_tok", 0) or 0)
        moe = int(cfg("moe_intermediate_size", 0) or 0) * max(top_k, 1)
        dense = int(cfg("intermediate_size", 0) or 0)
        data = self.recipe.calibrate.data
        return CalibShape(
            hidden=hidden,
            vocab=int(cfg("vocab_size")),
            intermediate=max(dense, moe) // layout.tp,
            attn_width=(2 * heads + 2 * kv) * head_dim // layout.tp,
            itemsize=self.whole.itemsize,
            seq_len=data.seq_len,
            batch_size=data.batch_size,
            ep=layout.ep,
            top_k=top_k,
            head_dim=head_dim,
        )

    def offload(self, layout: Layout) -> Offload:
        """``calibrate.offload``'s setting; the output embedding stays off the device unless a
        quantizer lives there (not in ``quant.ignore``), as ``calib.layerwise`` decides."""
        emb = self.whole.output_embedding
        head = emb if emb is not None and self.unquantized(emb) else None
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
        return self.whole.held(self.sharded(layout), params, self.recipe.quant.ignore)

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
            self._refusals[key] = self._block_refusal(held)
        return self._refusals[key]

    def _block_refusal(self, held: list[Held]) -> str | None:
        if self.meta_reason is None:
            from qckpt.plan.whole import block_refusal
        else:  # the reference: the load's own check, asked with meta tensors
            from qckpt.pipeline.plan_meta import block_refusal
        return block_refusal(held)

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
    if p.meta_reason is not None:
        notes.append(f"sized on the meta model: {p.meta_reason}")
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


def _scheme_plan(recipe: Recipe, whole: Any) -> SchemePlan:
    total = whole.summary()["bytes"]
    return plan_schemes(recipe.quant, whole.linears(), total, whole.itemsize)


def _model_summary(p: _Planner) -> dict[str, Any]:
    return {
        "source": p.recipe.model.source,
        "model_type": p.whole.model_type,
        "dtype": p.recipe.model.dtype,
        **p.whole.summary(),
        # config.json (torch-free), or the meta model and why (the reference path)
        "sized_by": p.whole.sized_by,
        "meta_reason": p.meta_reason,
    }
