"""The ``mse`` algorithm's steps inside :func:`qckpt.calib.calibrate.calibrate_model`, after the
max calibration and its sync (so every rank holds every final amax):

1. weight clips (:mod:`qckpt.calib.mse`) of the weights this rank holds and calibrated (its DP
   share, its EP experts): a function of the weight alone (MX weights: only their losses; the
   export searches their exponents again);
2. a second pass over this rank's batches with histogram taps on the static per-tensor
   inputs (FP8, INT8): each dense linear's own histogram, one per experts module and side (gate/up's
   input, down's input) over the routed rows of all its experts, edges ``[0, amax]`` from the
   synced amax (for experts the layer's largest). The forwards are the first pass's; the
   amaxes they fold again are maxes of values already in (unchanged), the token counts are put
   back after;
3. one exchange over the data group: an int64 header (a local failure flag), the int64 counts
   (SUM: exact in any order) and the float64 weight losses (SUM of one value and zeros);
4. input clips from the summed counts, on the host, identically on every rank; expert inputs
   of a module side all take its one clip (cold experts included);
5. the clips travel as quantizers of their own (kinds ``weight_clip`` / ``input_clip``) through
   :func:`qckpt.calib.sync.sync_amax` (a rank that does not hold a weight joins with nothing).

With ``calibrate.mse_weighting: hessian`` the caller first gathers every linear's input
``H_jj`` (:func:`qckpt.calib.hdiag.input_weights`, exact over the data group) and step 1 weighs
each weight's errors with its own (a cold expert: none, the plain search); the NVFP4 and MX
weights' ``H_jj`` go into the file (``{module}.hessian_diag``) for the export's re-search.

Nothing here depends on which rank ran which batch or held which expert: histograms are
integer sums, clips of weights are computed by the one rank that holds and owns the weight.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qckpt.calib import mse
from qckpt.calib.hdiag import Weights, tapped_forward
from qckpt.calib.instrument import Instrumentation, WeightSource, settle
from qckpt.calib.quantizer import AmaxStore, TensorQuantizer
from qckpt.calib.sync import sync_amax
from qckpt.errors import CalibrationError, SyncError
from qckpt.formats.shapes import weight_block
from qckpt.parallel.deadline import Deadline, deadline_of
from qckpt.parallel.mesh import Mesh, group_device


@dataclass
class MseResult:
    """The clip quantizers (synced) and what the search found, for the file and the report."""

    quantizers: list[TensorQuantizer]
    losses: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (max, mse)
    # the weights searched without a clip (MX: exponents per block), by their clip key
    blocks: list[str] = field(default_factory=list)
    # hessian weighting: "{module}.hessian_diag" -> float32 [cols] of the NVFP4 / MX weights
    # whose export searches again (the same on every rank)
    hdiag: dict[str, torch.Tensor] = field(default_factory=dict)
    cold: list[str] = field(default_factory=list)  # hessian weighting: input keys left plain
    parts: dict[str, float] = field(default_factory=dict)
    collectives: int = 0


def _clip_of(q: TensorQuantizer, kind: str, store: AmaxStore, local: bool) -> TensorQuantizer:
    return TensorQuantizer(
        q.name, kind, shape=q.shape, granularity=q.granularity, scheme=q.scheme, axis=q.axis,
        block_size=q.block_size, calib_dtype=torch.float32, device="cpu", store=store,
        local=local, expert_layer=q.expert_layer, expert=q.expert,
    )  # fmt: skip


def static_input(q: TensorQuantizer) -> bool:
    """An input whose scale the export stores (static, per tensor: FP8, INT8): what the search
    sets."""
    return q.kind == "input" and q.enabled and q.scheme.static_tensor_scale


def run_mse(
    model: nn.Module,
    instr: Instrumentation,
    batches: Sequence[torch.Tensor],
    mesh: Mesh,
    mine: set[str] | None,
    scale_dtype: torch.dtype = torch.float32,
    weights: Weights | None = None,
) -> MseResult:
    """Steps 1-5 of the module doc; raises :class:`SyncError` on every rank if any failed.
    ``scale_dtype``: the dtype the export stores integer scales in (the errors are measured
    under those); ``weights``: the per-column ``H_jj`` the weight errors are weighted with
    (None: unweighted)."""
    store = AmaxStore(capacity=1024)
    res = MseResult(quantizers=[])
    if weights is not None:
        res.collectives += weights.collectives
        res.cold = list(weights.cold)
    t0 = time.perf_counter()
    failure: str | None = None
    # every enabled weight quantizer in the model's order (the same list on every rank: under
    # EP remote experts' quantizers are there too), local where this rank holds and owns it
    source = {id(s.quantizer): s for s in instr.weights}
    wclips: list[tuple[WeightSource | None, TensorQuantizer]] = []
    for q in instr.quantizers.values():
        if q.kind == "weight" and q.enabled:
            src = source.get(id(q))
            own = src is not None and q.local and (mine is None or q.name in mine)
            wclips.append((src if own else None, _clip_of(q, "weight_clip", store, own)))
            h = None if weights is None else weights.of(q)
            if h is not None and (q.scheme.mx or q.scheme.block_scaled):
                res.hdiag[f"{q.name}.hessian_diag"] = h
    wlosses: dict[str, tuple[float, float]] = {}
    hists: dict[str, torch.Tensor] = {}
    try:
        wlosses = _weight_clips(model, wclips, scale_dtype, weights)
        res.parts["mse_weights"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        edges = _edges(model, instr)
        if edges:  # no static FP8 input (NVFP4's global input scale stays max): no pass
            hists = _histograms(model, instr, batches, edges)
        res.parts["mse_inputs_pass"] = time.perf_counter() - t1
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the exchange
        failure = f"{type(exc).__name__}: {exc}"
        edges = _edges(model, instr)
    t2 = time.perf_counter()
    keys = sorted(edges)
    counts, wl = _exchange(keys, hists, [c.key for _, c in wclips], wlosses, mesh, failure, res)
    iclips = _input_clips(instr, keys, counts, edges, store, res, scale_dtype)
    for (_, c), (lo, hi) in zip(wclips, wl, strict=True):
        res.losses[c.key] = (lo, hi)  # the owner's values (the others sent zeros)
    # MX weights keep no clip (the export searches their exponents again): losses only
    res.blocks = [c.key for _, c in wclips if c.scheme.mx]
    res.quantizers = [c for _, c in wclips if not c.scheme.mx] + iclips
    sres = sync_amax(res.quantizers, mesh.data_group, what="mse clip")
    res.collectives += sres.collectives
    res.parts["mse_sync"] = time.perf_counter() - t2
    return res


def _weight_clips(model: nn.Module, wclips, scale_dtype, weights) -> dict[str, tuple[float, float]]:
    """Step 1: the clip of every weight this rank owns, into its clip quantizer (an MX weight:
    only its losses), its errors weighted by its input's ``H_jj`` when ``weights`` has one."""
    losses: dict[str, tuple[float, float]] = {}
    with torch.no_grad():
        for src, c in wclips:
            if src is None:
                continue
            q = src.quantizer
            amax = q.amax
            if amax is None:
                raise CalibrationError(f"{q.key}: no weight amax to search from")
            w = src.take(model.get_parameter(src.param))
            h = None if weights is None else weights.of(q)
            if q.scheme.mx:  # exponents searched per block, again by the export: no clip
                losses[c.key] = mse.mx_weight_error(w, q.scheme.code_bits, h)
                continue
            if q.scheme.block_scaled:
                clip, lo, hi = mse.nvfp4_weight_clip(w, amax, h)
            elif q.scheme.integer:
                clip, lo, hi = mse.int_weight_clip(w, amax, q.scheme, scale_dtype, h)
            else:
                block = weight_block(q.block_size)
                clip, lo, hi = mse.fp8_weight_clip(w, amax, q.granularity, block, h)
            c.amax = clip.reshape(c.amax_shape).to(torch.float32)
            losses[c.key] = (lo, hi)
    return losses


def _edges(model: nn.Module, instr: Instrumentation) -> dict[str, float]:
    """The histograms this model takes, by name, and their upper edge (a synced amax): every
    dense static FP8 input; per experts module ``{module}:gate_up`` / ``{module}:down``."""
    out: dict[str, float] = {}
    for q in instr.quantizers.values():
        if static_input(q) and q.expert_layer is None:
            a = q.amax
            if a is not None and float(a) > 0:
                out[q.key] = float(a)
    for info in instr.experts:
        for side, roles in (("gate_up", ("gate", "up")), ("down", ("down",))):
            qs = [info.input_q[e][r] for e in info.input_q for r in roles]
            if not qs or not static_input(qs[0]):
                continue
            vals = [float(q.amax) for q in qs if q.amax is not None]
            if vals and max(vals) > 0:
                out[f"{info.module_name}:{side}"] = max(vals)
    return out


def _histograms(model: nn.Module, instr: Instrumentation, batches, edges) -> dict:
    """Step 2: this rank's histograms over its batches (the first pass's own)."""
    hists: dict[str, torch.Tensor] = {}

    def add(key: str, x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        h = mse.histogram(x, edges[key])
        hists[key] = h if key not in hists else hists[key] + h

    dense = {}
    for name, _ in model.named_modules():
        key = f"{name}.input_amax"
        if key in edges:
            dense[name] = _adder(add, key)

    def experts(info, side: str):  # noqa: ANN001, ANN202
        key = f"{info.module_name}:{side}"
        return _tap(add, key) if key in edges else None

    taken = getattr(batches, "taken", None)
    todo = [batches.batches[i] for i in taken] if taken is not None else list(batches)
    tapped_forward(model, instr, todo, dense, experts)
    with torch.no_grad():
        settle(model)  # fold what the pass deferred (maxes of values already in: unchanged)
    return {k: v.cpu() for k, v in hists.items()}


def _adder(add, key: str):
    return lambda x: add(key, x)


def _tap(add, key: str):
    return lambda x, _ids: add(key, x)


def _exchange(keys, hists, wkeys, wlosses, mesh: Mesh, failure, res: MseResult):
    """Step 3: header (MAX), counts (SUM) and weight losses (SUM) over the data group."""
    bins = mse.HIST_BINS
    counts = torch.zeros(len(keys) * bins, dtype=torch.int64)
    for i, k in enumerate(keys):
        if k in hists:
            counts[i * bins : (i + 1) * bins] = hists[k]
    losses = torch.zeros(2 * len(wkeys), dtype=torch.float64)
    for i, k in enumerate(wkeys):
        if k in wlosses:
            losses[2 * i : 2 * i + 2] = torch.tensor(wlosses[k], dtype=torch.float64)
    group = mesh.data_group
    if group is None:
        if failure is not None:
            raise SyncError(f"calibrate.algorithm mse failed: {failure}")
        return counts, losses.view(-1, 2).tolist()
    rank = dist.get_rank(group)
    dev = group_device(group)
    header = torch.tensor([rank + 1 if failure else 0, len(keys), -len(keys)], dtype=torch.int64)
    dl = deadline_of(group) or Deadline(None)
    what = "the mse statistics over the data-parallel group"
    header = header.to(dev)
    dl.run(what, dist.all_reduce, header, op=dist.ReduceOp.MAX, group=group, error=SyncError)
    err, n_max, n_min_neg = header.cpu().tolist()
    res.collectives += 1
    if err:
        mine = f": {failure}" if failure else f" (rank {err - 1} of the group; see its log)"
        raise SyncError(f"{what}: a rank failed before the exchange{mine}; giving up on every rank")
    if n_max != -n_min_neg:
        raise SyncError(f"{what}: ranks disagree on the histograms (different models?)")
    counts, losses = counts.to(dev), losses.to(dev)

    def both() -> None:
        works = [
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
            for t in (counts, losses)
        ]
        for w in works:
            w.wait()

    dl.run(what, both, error=SyncError)
    res.collectives += 2
    return counts.cpu(), losses.cpu().view(-1, 2).tolist()


def _input_clips(
    instr, keys, counts, edges, store, res: MseResult, scale_dtype
) -> list[TensorQuantizer]:
    """Step 4: every static input's clip from its summed histogram (or its module side's)."""
    bins = mse.HIST_BINS
    schemes = {}
    for info in instr.experts:
        for e in info.input_q:
            for role, q in info.input_q[e].items():
                schemes[f"{info.module_name}:{'down' if role == 'down' else 'gate_up'}"] = q.scheme
    found: dict[str, tuple[float, float, float]] = {}
    for i, k in enumerate(keys):
        sch = schemes[k] if k in schemes else instr.quantizers[k].scheme
        found[k] = mse.input_clip(counts[i * bins : (i + 1) * bins], edges[k], sch, scale_dtype)
        if ":" in k:  # an experts module side: its loss once, under the side's name
            res.losses[k] = found[k][1:]
    out: list[TensorQuantizer] = []
    side_of: dict[int, str] = {}
    for info in instr.experts:
        for e in info.input_q:
            for role, q in info.input_q[e].items():
                side_of[id(q)] = f"{info.module_name}:{'down' if role == 'down' else 'gate_up'}"
    for q in instr.quantizers.values():
        if not static_input(q):
            continue
        k = side_of.get(id(q), q.key)
        c = _clip_of(q, "input_clip", store, True)
        if k in found:
            clip, lo, hi = found[k]
            own = q.amax
            # an expert's own amax may be under its layer side's clip: never above max |x|
            if own is not None and k != q.key:
                clip = min(clip, float(own))
            c.amax = torch.tensor(clip, dtype=torch.float32)
            res.losses[c.key] = (lo, hi) if k == q.key else (0.0, 0.0)
        elif q.amax is not None:  # an amax of zero: nothing to search
            c.amax = q.amax.to(torch.float32)
        out.append(c)
    return out


def clip_state(res: MseResult) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The clips for the calibration file: key -> float32 host tensor, key -> description."""
    amax: dict[str, torch.Tensor] = {}
    desc: dict[str, dict[str, Any]] = {}
    for c in res.quantizers:
        a = c.amax
        desc[c.key] = c.describe(a)
        if a is not None:
            amax[c.key] = a.detach().to(torch.float32).cpu()
    for k, h in res.hdiag.items():
        amax[k] = h.detach().to(torch.float32).cpu()
    return amax, desc
