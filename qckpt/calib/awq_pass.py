"""The ``awq`` algorithm's pass inside :func:`qckpt.calib.calibrate.calibrate_model`: it runs
first, with the quantizers paused, and folds its scales into the model's weights; the max
calibration that follows then calibrates the folded model (its amaxes are the folded
weights' and the scaled inputs'), and the export quantizes the folded weights
(``<output>.awq/``, read in place of the checkpoint's: qckpt/read/gptq_source.py).

Layer by layer (the model resident; each decoder layer's inputs are the outputs of the layers
before it, folded and with their weights quantized): one forward per batch records layer 0's
input and every layer's other arguments, then for each layer (:mod:`qckpt.calib.awq_layer`
lists its groups):

1. its batches once: the per-channel max ``|x|`` of every group's statistics site (and the
   layer's output on the first batch, for step 5's check); MAX over the data group, a failure
   flag in the same buffer;
2. its batches again: each site's rows on the fixed-point grid of that amax
   (:func:`qckpt.calib.gptq.fixed_point`): per statistics site the sums of ``|x|`` per
   channel and the row count (int64, SUM over the data group), per quantized consumer's
   input ``X^T X`` (float64 integers, exact in any order; dense ones summed over the data
   group, experts' over the DP group: the ranks that hold the same experts, as gptq's);
   every rank then holds each group's mean ``|x|`` per channel, hence its candidate scales;
   where a consumer's input is static per-tensor FP8 (:func:`qckpt.calib.awq.input_spec`),
   its batches once more:
   per candidate the squared quantization error of ``x / s`` per channel (int64, exact),
   summed like ``X^T X``;
3. for every candidate and every quantized consumer this rank holds, its output error
   ``sum((dW H) * dW)`` (:func:`qckpt.calib.awq.hessian_loss`: a function of the weight, the
   scales and ``H``, the same on every rank that holds it; plus the input's term,
   :func:`qckpt.calib.awq.input_loss`); MAX over the data group (the others
   send zero). Every rank then sums each group's losses in one order and picks the same
   ``alpha`` (ties: the smallest);
4. the scales fold into the weights here (norms, v/up rows, consumers' columns);
5. its first batch again, folded: the output must be the layer's own (relative error at most
   ``AwqOptions.tolerance``; exact with power-of-two scales), else the fold is wrong for this
   architecture and the run stops on every rank;
6. its batches with the folded weights quantized (by the export's rule, each with its own
   amax): the next layer's inputs; the weights then go back to the folded BF16 values.

Every rank runs the same forwards in the same order (EP's exchanges meet); a rank with no
rows for an expert joins every exchange with zeros; a failure anywhere is flagged in the next
exchange, or ends the forwards' own collectives within ``parallel.timeout_s``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qckpt.calib import awq, gptq
from qckpt.calib.awq_layer import LayerPlan, layer_plan
from qckpt.calib.gptq_pass import per_expert
from qckpt.calib.instrument import Instrumentation
from qckpt.calib.layerwise import capture_layer_inputs, decoder_layers
from qckpt.errors import CalibrationError, SyncError
from qckpt.parallel.deadline import Deadline, deadline_of
from qckpt.parallel.mesh import Mesh, group_device


@dataclass
class AwqOptions:
    grid: int = awq.GRID
    pow2: bool = False  # power-of-two scales: the fold is exact in BF16 (a coarser search)
    tolerance: float = 0.05  # step 5's bound on the folded layer's relative output change


@dataclass
class AwqResult:
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # the report's rows
    parts: dict[str, float] = field(default_factory=dict)
    collectives: int = 0
    changed: set[str] = field(default_factory=set)  # parameters the folds changed here
    stat_bytes: int = 0  # the largest layer's statistics (per channel), on the host
    # the largest layer's X^T X on this rank: held (sites some row reached) and at most
    hessian_bytes: int = 0
    hessian_bytes_bound: int = 0


def awq_batches(batches, mesh: Mesh) -> list[torch.Tensor]:
    """This rank's batches: batches dealt as the ranks come free (pure DP) are taken here as
    a fixed split instead (the dealing is the max pass's, which runs after this)."""
    if hasattr(batches, "taken") and hasattr(batches, "batches"):
        return list(batches.batches)[mesh.data_rank :: mesh.data_parallel_size]
    return list(batches)


def run_awq(
    model: nn.Module, instr: Instrumentation, batches, mesh: Mesh, opts: AwqOptions, on: set[int]
) -> AwqResult:
    """The pass of the module doc; raises on every rank if any rank failed. ``on``: the ids
    of the enabled quantizers (the caller pauses them while this runs)."""
    res = AwqResult()
    t0 = time.perf_counter()
    todo = awq_batches(batches, mesh)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tokens = _total_tokens(todo, mesh, res)
    bits = (gptq.grid_bits(tokens), 62 - math.ceil(math.log2(tokens + 1)))
    layers_name, layers = decoder_layers(model)
    hidden, calls = capture_layer_inputs(
        model, layers, todo, device, what="calibrate.algorithm awq"
    )
    res.parts["awq_capture"] = time.perf_counter() - t0
    failure: BaseException | None = None
    for i, layer in enumerate(layers):
        t1 = time.perf_counter()
        prefix = f"{layers_name}.{i}"
        plan = layer_plan(model, layer, prefix, instr, on)  # the same on every rank
        runner = LayerRunner(layer, hidden, calls, i)
        row, failure = _layer(plan, runner, bits, mesh, opts, res, failure)
        hidden = runner.hidden
        row["seconds"] = round(time.perf_counter() - t1, 4)
        res.layers[prefix] = row
    _reduce([], torch.int64, dist.ReduceOp.MAX, failure, mesh, res, "the awq pass's end")
    res.parts["awq_layers"] = time.perf_counter() - t0 - res.parts["awq_capture"]
    return res


class LayerRunner:
    """A layer's batches through it, with its recorded arguments."""

    def __init__(self, layer, hidden, calls, i):
        self.layer, self.hidden, self.calls, self.i = layer, hidden, calls, i

    def run(self, batches=None) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for b in range(len(self.hidden)) if batches is None else batches:
                args, kwargs = self.calls[b][self.i]
                y = self.layer(self.hidden[b], *args, **kwargs)
                out.append(y[0] if isinstance(y, tuple) else y)
        return out


def _layer(plan: LayerPlan, runner: LayerRunner, bits, mesh, opts, res: AwqResult, failure):
    """Steps 1-6 for one layer; (its report row, a failure to tell in the next exchange).
    ``bits``: (the grid of the statistics and X^T X, that of the input errors)."""
    bits, ebits = bits
    amax: dict[str, torch.Tensor] = {}
    ref0 = None
    if failure is None:
        try:
            ref0 = _pass_amax(plan, runner, amax)
        except Exception as exc:  # noqa: BLE001 - told to the others by the exchange's flag
            failure = exc
    amax = _exchange_amax(plan.stats, amax, failure, mesh, res)
    st = _Stats(plan, amax, bits)
    try:
        _run_hooked(plan, runner, st.add)
    except Exception as exc:  # noqa: BLE001
        failure = exc
    means, counts = _exchange_sums(plan.stats, st, amax, bits, failure, mesh, res)
    shapes = {s: (d, d) for s, (_, d, _) in plan.hessians.items()}
    hess = _exchange_sites(plan, st.hess, shapes, torch.float64, None, mesh, res, "the awq X^T X")
    _count_bytes(plan, hess, res)
    cands = _candidates(plan, means, counts, opts)
    ins = _InputErrors(plan, cands, amax, ebits)
    if ins.sites:
        try:
            _run_hooked(plan, runner, ins.add)
        except Exception as exc:  # noqa: BLE001
            failure = exc
        shapes = {s: (len(cands[id(plan.groups[gi])]), plan.hessians[s][1])
                  for s, (gi, _) in ins.sites.items()}  # fmt: skip
        ins.sums = _exchange_sites(plan, ins.sums, shapes, torch.int64, failure, mesh, res,
                                   "the awq input errors")  # fmt: skip
    mine: dict[tuple[int, int, int], float] = {}
    try:
        mine = _losses_here(plan, cands, hess, st, ins)
    except Exception as exc:  # noqa: BLE001
        failure = exc
    losses = _exchange_losses(plan, cands, mine, failure, mesh, res)
    chosen = _choose(plan, losses)
    row = _row(plan, chosen, losses, opts)
    try:
        for g, k in zip(plan.groups, chosen, strict=True):
            if g.fold is not None and k:
                res.changed.update(g.fold(cands[id(g)][k]))
        row["fold_error"] = _check(runner, ref0, plan, opts)
    except Exception as exc:  # noqa: BLE001
        failure = exc
    try:
        runner.hidden = _quantized_outputs(plan, runner)
    except Exception as exc:  # noqa: BLE001
        failure = failure or exc
    return row, failure


# -- the hooks: every site's rows to one callback -------------------------------------------------


@contextlib.contextmanager
def _hooked(plan: LayerPlan, on_site):
    """Pre-hooks on the dense sites, forward hooks on the norms, taps on the experts."""
    undo = []
    for site, mod in plan.dense.items():
        undo.append(mod.register_forward_pre_hook(lambda _m, a, s=site: on_site(s, a[0])))
    for site, mod in plan.norms.items():
        undo.append(mod.register_forward_hook(lambda _m, _a, y, s=site: on_site(s, y)))
    taps = []
    for info, obs in plan.experts:
        for side, seg in (("gate_up", obs.gate_up), ("down", obs.down)):

            def tap(x, ids, info=info, side=side):
                for r, rows in per_expert(x, ids):
                    on_site(f"{info.module_name}:{info.local_ids[r]}:{side}", rows)

            seg.tap = tap
            taps.append(seg)
    try:
        yield
    finally:
        for h in undo:
            h.remove()
        for seg in taps:
            seg.tap = None


def _run_hooked(plan: LayerPlan, runner: LayerRunner, on_site, batches=None) -> list[torch.Tensor]:
    with _hooked(plan, on_site):
        return runner.run(batches)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1])


def _pass_amax(plan: LayerPlan, runner: LayerRunner, amax: dict) -> torch.Tensor | None:
    """Step 1: per-channel max |x| of each statistics site; the first batch's output."""
    stats = plan.stats

    def add(site: str, x: torch.Tensor) -> None:
        if site not in stats or x.numel() == 0:
            return
        a = _rows(x).abs().amax(dim=0).to(torch.float32)
        amax[site] = a if site not in amax else torch.maximum(amax[site], a)

    out = _run_hooked(plan, runner, add)
    return out[0].detach().clone() if out else None


class _Stats:
    """Step 2 on this rank: per statistics site the sums of ``|x|`` on the grid (float64
    integers) and the row count; per consumer input site ``X^T X`` on the same grid."""

    def __init__(self, plan: LayerPlan, amax, bits: int):
        self.stats, self.hsites, self.bits = plan.stats, plan.hessians, bits
        self.top = {s: float(a.max()) if a.numel() else 0.0 for s, a in amax.items()}
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.hess: dict[str, torch.Tensor] = {}

    def grid_top(self, site: str) -> float:
        """The amax of a site's grid: its own (a statistics site) or its group's."""
        return self.top.get(site, self.top.get(self.hsites.get(site, ("",))[0], 0.0))

    def add(self, site: str, x: torch.Tensor) -> None:
        stat, hsite = site in self.stats, site in self.hsites
        top = self.grid_top(site)
        if not (stat or hsite) or x.numel() == 0 or top <= 0:
            return
        xi = gptq.fixed_point(_rows(x), top, self.bits)
        if stat:
            part = xi.abs().sum(dim=0)  # integers below 2**53: exact
            self.sums[site] = part if site not in self.sums else self.sums[site] + part
            self.counts[site] = self.counts.get(site, 0) + xi.shape[0]
        if hsite:
            part = xi.t() @ xi
            self.hess[site] = part if site not in self.hess else self.hess[site].add_(part)

    def unit(self, site: str) -> float:
        """The squared value of one grid step of ``site``'s ``X^T X``."""
        return (self.grid_top(site) / 2.0**self.bits) ** 2


# -- the exchanges ------------------------------------------------------------------------------


def _reduce(
    parts, dtype, op, failure, mesh: Mesh, res: AwqResult, what: str, group: Any = "data"
) -> torch.Tensor:
    """``parts`` (flattened) and a failure flag, reduced over ``group`` (the data group by
    default) with ``op``; raises on every rank if any rank flagged a failure (its own error
    where it was local)."""
    flat = [p.reshape(-1).to("cpu", dtype) for p in parts]
    flag = torch.tensor([1 if failure is not None else 0], dtype=dtype)
    buf = torch.cat([*flat, flag])
    group = mesh.data_group if group == "data" else group
    if group is not None and dist.get_world_size(group) > 1:
        buf = buf.to(group_device(group))
        dl = deadline_of(group) or Deadline(None)
        dl.run(f"{what} over the ranks", dist.all_reduce, buf, op=op, group=group,
               error=SyncError)  # fmt: skip
        res.collectives += 1
        buf = buf.cpu()
    if failure is not None:
        raise failure
    if buf[-1].item() != 0:
        raise SyncError("calibrate.algorithm awq: another rank failed (see its log); giving up")
    return buf[:-1]


def _exchange_amax(stats: dict[str, int], amax, failure, mesh, res) -> dict[str, torch.Tensor]:
    parts = [amax.get(s, torch.zeros(d)) for s, d in stats.items()]
    buf = _reduce(parts, torch.float32, dist.ReduceOp.MAX, failure, mesh, res, "the awq amaxes")
    out, at = {}, 0
    for s, d in stats.items():
        out[s] = buf[at : at + d].clone()
        at += d
    return out


def _exchange_sums(stats, st: _Stats, amax, bits, failure, mesh, res):
    """Step 2's SUM of the statistics; (per site: mean |x| per channel, float64 host; rows)."""
    parts = [st.sums.get(s, torch.zeros(d)).to(torch.int64) for s, d in stats.items()]
    parts.append(torch.tensor([st.counts.get(s, 0) for s in stats], dtype=torch.int64))
    buf = _reduce(parts, torch.int64, dist.ReduceOp.SUM, failure, mesh, res, "the awq sums")
    means, rows, at = {}, {}, 0
    n = buf[-len(stats) :].tolist() if stats else []
    for (s, d), c in zip(stats.items(), n, strict=True):
        top = float(amax[s].max()) if d else 0.0
        means[s] = awq.mean_abs(buf[at : at + d], int(c), top, bits)
        rows[s] = int(c)
        at += d
    return means, rows


def _exchange_sites(plan: LayerPlan, got, shapes, dtype, failure, mesh: Mesh, res, what: str):
    """A SUM of per-site tensors (``shapes``: site -> shape): dense sites over the data group,
    a fused expert's (a ``:`` in the site) over the DP group under EP (the ranks that hold it);
    an absent one counts as zeros; all-zero results are dropped."""
    here = {s: h for s, (_, _, h) in plan.hessians.items()}
    dense = [s for s in shapes if ":" not in s]
    experts = [s for s in shapes if ":" in s and here.get(s, False)]
    groups = (
        [(dense, "data"), (experts, mesh.dp_group)] if mesh.ep > 1 else [(dense + experts, "data")]
    )
    out: dict[str, torch.Tensor] = {}
    for keys, group in groups:
        if not keys:
            continue
        parts = [got.get(k, torch.zeros(shapes[k], dtype=dtype)) for k in keys]
        buf = _reduce(parts, dtype, dist.ReduceOp.SUM, failure, mesh, res, what, group)
        at = 0
        for k in keys:
            n = math.prod(shapes[k])
            part = buf[at : at + n]
            if bool(part.any()):
                out[k] = part.view(shapes[k])
            at += n
    return out


def _count_bytes(plan: LayerPlan, hess, res: AwqResult) -> None:
    held = sum(h.numel() * h.element_size() for h in hess.values())
    bound = sum(8 * d * d for _, d, here in plan.hessians.values() if here)
    res.hessian_bytes = max(res.hessian_bytes, held)
    res.hessian_bytes_bound = max(res.hessian_bytes_bound, bound)
    res.stat_bytes = max(res.stat_bytes, sum(16 * d for d in plan.stats.values()))


def _candidates(plan: LayerPlan, means, counts, opts: AwqOptions) -> dict[int, list]:
    """Per searched group (by id): its scales (float64) per alpha."""
    out: dict[int, list] = {}
    for g in plan.groups:
        if counts.get(g.stat, 0) == 0 or not g.quantized:
            continue  # no row reached it anywhere (a cold expert), or nothing to quantize
        a = means[g.stat]
        cands = []
        for alpha in awq.alphas(opts.grid):
            if g.tie is not None:
                t = awq.scales(awq.pooled(a, *g.tie), alpha, opts.pow2)
                cands.append(awq.expand_heads(t, *g.tie))
            else:
                cands.append(awq.scales(a, alpha, opts.pow2))
        out[id(g)] = cands
    return out


class _InputErrors:
    """Step 2b on this rank: per input site whose consumers quantize their input too, per
    candidate, the squared error of quantizing ``x / s`` per channel (exact integers)."""

    def __init__(self, plan: LayerPlan, cands, amax, bits: int):
        self.plan, self.cands, self.bits = plan, cands, bits
        self.sites = {s: v for s, v in plan.inputs.items() if id(plan.groups[v[0]]) in cands}
        self.sums: dict[str, torch.Tensor] = {}
        self.xs_amax: dict[int, list[float]] = {}
        for gi, g in enumerate(plan.groups):
            if id(g) in cands:
                top = amax[g.stat].to(torch.float64)
                self.xs_amax[gi] = [float((top / s).max()) for s in cands[id(g)]]

    def add(self, site: str, x: torch.Tensor) -> None:
        got = self.sites.get(site)
        if got is None or x.numel() == 0:
            return
        gi, ispec = got
        rows = _rows(x)
        part = torch.stack([
            awq.input_error_sums(rows, s, ispec, a, self.bits)
            for s, a in zip(self.cands[id(self.plan.groups[gi])], self.xs_amax[gi], strict=True)
        ])  # fmt: skip
        self.sums[site] = part if site not in self.sums else self.sums[site] + part

    def loss(self, gi: int, site: str, k: int, q: torch.Tensor) -> float:
        e = self.sums.get(site)
        if e is None or site not in self.sites:
            return 0.0
        return awq.input_loss(q, e[k], self.xs_amax[gi][k], self.bits)


def _losses_here(plan: LayerPlan, cands, hess, st: _Stats, ins: _InputErrors):
    """Step 3 on this rank: the loss of every (group, consumer, candidate) it holds: the
    weights' output error, plus the input quantization's where the input is quantized."""
    out: dict[tuple[int, int, int], float] = {}
    for gi, g in enumerate(plan.groups):
        if id(g) not in cands:
            continue
        for ci, c in enumerate(g.quantized):
            h = hess.get(c.site)
            if c.weight is None or h is None:
                continue  # another rank's, or no row reached it: no error either way
            w = c.weight()
            unit = st.unit(c.site)
            for k, s in enumerate(cands[id(g)]):
                q = awq.candidate(w, s, c.wspec)
                extra = ins.loss(gi, c.site, k, q) if c.ispec is not None else 0.0
                out[(gi, ci, k)] = unit * awq.hessian_loss(w, q, s, h) + extra
    return out


def _loss_keys(plan: LayerPlan, cands) -> list[tuple[int, int, int]]:
    """Every (group, consumer, candidate) searched, in one order on every rank."""
    keys = []
    for gi, g in enumerate(plan.groups):
        if id(g) in cands:
            for ci in range(len(g.quantized)):
                keys += [(gi, ci, k) for k in range(len(cands[id(g)]))]
    return keys


def _exchange_losses(plan, cands, mine, failure, mesh, res) -> dict[int, list[float]]:
    """Step 3's exchange: per searched group (by index), its loss per candidate."""
    keys = _loss_keys(plan, cands)
    vals = torch.tensor([mine.get(k, 0.0) for k in keys], dtype=torch.float64)
    vals = _reduce([vals], torch.float64, dist.ReduceOp.MAX, failure, mesh, res, "the awq losses")
    losses: dict[int, list[float]] = {}
    for (gi, _ci, k), v in zip(keys, vals.tolist(), strict=True):
        row = losses.setdefault(gi, [0.0] * len(cands[id(plan.groups[gi])]))
        row[k] += v  # consumers in one order on every rank
    return losses


def _choose(plan: LayerPlan, losses) -> list[int]:
    """Each group's candidate of least loss (ties: the smallest alpha; 0 where not searched)."""
    out = []
    for gi in range(len(plan.groups)):
        row = losses.get(gi)
        out.append(0 if row is None else awq.best(row))
    return out


def _row(plan: LayerPlan, chosen, losses, opts: AwqOptions) -> dict[str, Any]:
    """The report's row: per group its alpha (None: not searched), the loss at alpha 0 (max
    calibration) and at the choice, summed over the searched groups."""
    grid = awq.alphas(opts.grid)
    row: dict[str, Any] = {"groups": len(plan.groups), "searched": len(losses), "alpha": {},
                           "loss_max": 0.0, "loss_awq": 0.0}  # fmt: skip
    for gi, g in enumerate(plan.groups):
        if gi not in losses:
            row["alpha"][g.key] = None
            continue
        row["alpha"][g.key] = grid[chosen[gi]]
        row["loss_max"] += losses[gi][0]
        row["loss_awq"] += losses[gi][chosen[gi]]
    if plan.skipped:
        row["skipped"] = list(plan.skipped)
    return row


def _check(runner: LayerRunner, ref0, plan: LayerPlan, opts: AwqOptions) -> float | None:
    """Step 5: the folded layer's first-batch output against the original's."""
    if ref0 is None:
        return None
    y = runner.run([0])[0].to(torch.float64)
    ref = ref0.to(torch.float64)
    err = float(torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
    if not err <= opts.tolerance:
        layer = next(iter(plan.norms)).rsplit(".", 1)[0]
        raise CalibrationError(
            f"calibrate.algorithm awq: folding the scales into {layer} changed its output by "
            f"{err:.2%} (more than {opts.tolerance:.0%}): this architecture's norms or MLP are "
            "not the ones AWQ folds into"
        )
    return err


def _quantized_outputs(plan: LayerPlan, runner: LayerRunner) -> list[torch.Tensor]:
    """Step 6: the layer's outputs with its quantized weights quantized; weights put back."""
    saved = []
    with torch.no_grad():
        try:
            for get, spec in plan.quantized:
                w = get()
                saved.append((w, w.clone()))
                w.copy_(awq.fake_quant(w, spec).to(w.dtype))
            return runner.run()
        finally:
            for w, orig in saved:
                w.copy_(orig)


def _total_tokens(todo: Sequence[torch.Tensor], mesh: Mesh, res: AwqResult) -> int:
    n = torch.tensor([sum(int(b.numel()) for b in todo)], dtype=torch.int64)
    total = _reduce([n], torch.int64, dist.ReduceOp.SUM, None, mesh, res, "the awq token count")
    return int(total[0].item())


# -- the folded weights, for the export ----------------------------------------------------------


def tensors_to_write(model: nn.Module, res: AwqResult, mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's share of the folded weights in checkpoint naming (the first DP rank of each
    EP rank writes its experts, the first of all the rest); name -> host tensor."""
    from qckpt.models.naming import expert_slices, hf_tensors, is_fused_experts_param
    from qckpt.parallel.shard import shard_of

    out: dict[str, torch.Tensor] = {}
    if mesh.dp_rank != 0:
        return out
    mtype = getattr(getattr(model, "config", None), "model_type", "") or ""
    for name in sorted(res.changed):
        p = model.get_parameter(name).detach()
        if not is_fused_experts_param(name):
            if mesh.ep_rank == 0:
                for hname, t in hf_tensors(name, p, mtype):
                    out[hname] = t.cpu().contiguous().clone()
            continue
        prefix = name.rpartition(".")[0]
        mod = model.get_submodule(prefix)
        spec = shard_of(mod, "gate_up_proj")
        ids = list(spec.indices) if spec is not None else list(range(p.shape[0]))
        n = spec.total if spec is not None else p.shape[0]
        gshape = torch.Size((n, *mod.gate_up_proj.shape[1:]))
        dshape = torch.Size((n, *mod.down_proj.shape[1:]))
        row_of = {e: r for r, e in enumerate(ids)}
        for s in expert_slices(prefix, mtype, gshape, dshape):
            if s.param_name == name and s.expert in row_of:
                t = p[row_of[s.expert]].narrow(0, s.row_start, s.rows)
                out[f"{s.hf_module}.weight"] = t.cpu().contiguous().clone()
    return out
