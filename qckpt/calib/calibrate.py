"""Max calibration of a model over this rank's batches, then the amax sync over the mesh.

Order (the same on every rank, so every rank reaches every collective):
1. quantizers in (:func:`qckpt.calib.instrument.insert_quantizers`);
2. weight amax from the weights, every local quantizer, cold experts included (weights held
   quantized: the amaxes a load took from the checkpoint's values, ``weight_amax``); under DP
   each DP rank takes only its share (:func:`qckpt.calib.weight_amax.split_weights`) and the
   sync in step 4 completes the rest, exactly (a MAX of one value and zeros);
3. forwards over this rank's batches (pure DP: a :class:`qckpt.calib.deal.DealtBatches`, each
   batch taken when this rank comes free) under ``no_grad`` (a quantized weight is dequantized for
   its matmul, one linear or one expert at a time, never an FP8 copy of the input: the
   activations are those of the dequantized model); a failure here is remembered, not raised,
   so that this rank still reaches the sync and tells the others (who would otherwise wait);
4. :func:`qckpt.calib.sync.sync_amax` over ``mesh.data_group`` (DP x EP: the ranks that saw
   different data), then over ``mesh.tp_group`` for the per-tensor amaxes (MAX over the shards of
   TP-sharded linears; gated on ``enabled`` only), then one all-gather over ``mesh.tp_group``
   that turns the per-channel / per-block amaxes of TP-sharded linears into the whole tensor's
   (:func:`qckpt.calib.tp_gather.gather_sharded_amax`), so the file is the one TP=1 writes;
5. one more collective for the report: which experts got tokens on which rank;
6. quantizers out; the result is a :class:`CalibrationState` in HF module naming + the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qckpt import phases
from qckpt.calib.algorithms import Algorithm, algorithm_named, layer_of
from qckpt.calib.instrument import (
    calibrate_weights,
    insert_quantizers,
    instrumentation,
    remove_quantizers,
    settle,
)
from qckpt.calib.quantizer import TensorQuantizer, host_amaxes
from qckpt.calib.state_file import CalibrationState, model_fingerprint, model_names_shapes
from qckpt.calib.sync import sync_amax
from qckpt.calib.tp_gather import check_sharded_quantizers, gather_sharded_amax, linear_shards
from qckpt.calib.weight_amax import split_weights
from qckpt.errors import SyncError
from qckpt.formats.tensor import dequantized_compute
from qckpt.parallel.deadline import Deadline, deadline_of
from qckpt.parallel.mesh import Mesh, group_device
from qckpt.phases import gc_paused
from qckpt.recipe import QuantConfig


def calibrate_model(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    quant_cfg: QuantConfig,
    mesh: Mesh,
    *,
    share_expert_inputs: bool = True,
    progress: Callable[[int], Any] | None = None,
    calib_dtype: torch.dtype = torch.float32,
    weight_amax: Mapping[str, torch.Tensor] | None = None,
    runner: Any = None,
    moe_forward: str = "auto",
    algorithm: str | Algorithm = "max",
) -> tuple[CalibrationState, dict[str, Any]]:
    """Calibrate ``model`` on this rank's ``batches`` and sync over ``mesh``; see the module doc.

    ``weight_amax``: weight amaxes already taken from the checkpoint's values (quantized-resident
    weights, :mod:`qckpt.calib.weight_amax`); the forwards then run on dequantized weights.
    ``runner`` (:class:`qckpt.calib.layerwise.LayerwiseRunner`) replaces steps 2-3 on a meta
    model, one layer at a time on ``runner.device``; its ``report()`` becomes ``offload``.
    ``moe_forward``: the fused experts' instrumented forward (``auto`` | ``eager`` |
    ``grouped``); the report's ``moe_forward`` says which ran, and why eager under auto.
    ``algorithm``: an :class:`qckpt.calib.algorithms.Algorithm` (or its name, with its default
    options): its pass after step 4 (``after``); awq's before step 2 (``before``), folding its
    scales into the weights that steps 2-4 then calibrate. gptq's and awq's weights:
    ``state.weights``, for the caller to write.
    """
    algorithm = check_algorithm(algorithm, mesh, runner)
    t0 = time.perf_counter()
    dev = None if runner is None else runner.device
    kw = dict(share_expert_inputs=share_expert_inputs, calib_dtype=calib_dtype, device=dev)
    # the GC paused where 10,000s of objects are made (quantizers, the report's rows): each
    # full collection walks the model's heap. Never over forwards (cycles hold device memory)
    with gc_paused():
        quantizers = insert_quantizers(model, quant_cfg, moe_forward=moe_forward, **kw)
    parts = {"insert": time.perf_counter() - t0}
    try:
        instr = instrumentation(model)
        tp_mods = linear_shards(model)
        # a block size that straddles TP shards: a config error, the same on every rank
        check_sharded_quantizers(quantizers.values(), tp_mods)
        # awq first: the folded weights are what the max calibration then sees
        awq_res, awq_s = algorithm.before(model, instr, batches, mesh, parts)
        # resident weights: each DP rank takes the amaxes of its share, the sync the rest
        mine = _weight_share(instr.weights, mesh) if runner is None else None
        failure: BaseException | None = None
        tokens = 0
        try:
            tokens = _forwards(model, batches, progress, weight_amax, runner, mine, parts)
        except Exception as exc:  # noqa: BLE001 - re-raised below after telling the other ranks
            failure = exc
        t_fwd = time.perf_counter()
        qs = list(quantizers.values())
        dres, tres, tp_gathers = _sync_all(qs, mesh, tp_mods, failure)
        t_sync = time.perf_counter()
        # the algorithm's own work (and collectives), apart from the amax sync's
        with phases.phase(phases.ALGORITHM):  # the phase breakdown's line for its extra cost
            algo = algorithm.after(model, instr, batches, mesh, mine, parts, runner)
        algo = algo or awq_res
        t_after = time.perf_counter()
        state, report = _results(algorithm, algo, model, qs, quant_cfg, instr, mesh)
        parts["after_sync"] = time.perf_counter() - t_after
        report.update(
            # dealt batches (pure DP): the ones this rank ran
            batches=len(getattr(batches, "taken", batches)),
            tokens_this_rank=tokens,
            forward_seconds=round(t_fwd - t0 - awq_s, 4),
            forward_parts={k: round(v, 4) for k, v in parts.items()},
            weight_amax_here=len(mine) if mine is not None else None,
            sync_seconds=round(t_sync - t_fwd, 6),
            sync_collectives=dres.collectives + (tres.collectives if tres else 0) + tp_gathers,
            algorithm_seconds=round(t_after - t_sync + awq_s, 4),  # awq's ran before the forwards
            algorithm_collectives=0 if algo is None else algo.collectives,
            shared_from_layer=len(dres.shared),
        )
        if runner is not None:
            report["offload"] = runner.report()
        return state, report
    finally:
        remove_quantizers(model)


def _results(algorithm, algo, model, qs, quant_cfg, instr, mesh: Mesh):
    """Steps 5-6: (the file's state, the report), with the algorithm's findings."""
    expert_ranks = _expert_tokens(instr.experts, mesh)
    with gc_paused():
        # every amax on the host at once (a few copies), not a device read per quantizer
        amaxes = host_amaxes(qs)
        state = _state(model, qs, amaxes, quant_cfg)
        report = _report(qs, amaxes, instr.experts, expert_ranks, mesh)
        # which experts forward ran (auto's choice, and why when eager)
        report["moe_forward"] = instr.moe.report(bool(instr.experts))
        algorithm.apply(algo, state, report, model, instr, mesh)
    return state, report


def check_algorithm(algorithm: str | Algorithm, mesh: Mesh, runner: Any) -> Algorithm:
    """The algorithm object (by name: its default options); one line for a config it cannot
    run (:meth:`qckpt.calib.algorithms.Algorithm.check`)."""
    algo = algorithm_named(algorithm)
    algo.check(mesh, runner)
    return algo


def _sync_all(qs: list[TensorQuantizer], mesh: Mesh, tp_mods, failure: BaseException | None):
    """Step 4: the DP x EP sync, then the TP ones; a local failure is raised after the others
    heard of it. Returns (the data sync's result, the TP sync's or None, TP gathers)."""
    local_error = None if failure is None else f"{type(failure).__name__}: {failure}"
    try:
        dres = sync_amax(qs, mesh.data_group, what="data-parallel", local_error=local_error)
        tres = None
        tp_gathers = 0
        if mesh.tp_group is not None:
            # TP ranks see the same tokens but hold different shards of the sharded modules:
            # one amax per tensor is the max over the shards (every enabled per-tensor
            # quantizer joins; replicated modules' are equal on every TP rank anyway)
            was_shared = [q for q in qs if q.is_scalar and q.shared_from_layer]
            tres = sync_amax([q for q in qs if q.is_scalar], mesh.tp_group, what="tensor-parallel")
            for q in was_shared:  # the TP sync has nothing to share; keep the DP verdict
                q.shared_from_layer = True
        if tp_mods:
            # per-channel / per-block amaxes of a shard: the whole tensor's, as on 1 rank
            tp_gathers = gather_sharded_amax(qs, tp_mods, mesh.tp_group)
    except SyncError:
        if failure is not None:
            raise failure from None
        raise
    return dres, tres, tp_gathers


def _forwards(model, batches, progress, weight_amax, runner, mine, parts) -> int:
    """Steps 2-3, resident or one layer at a time; then the amaxes the forwards deferred are
    folded in (and checked for non-finite values), one host sync rather than one per hook.
    ``parts`` gets the seconds of each piece (the device synchronized at each boundary)."""
    if runner is None:
        tokens = _resident_pass(model, batches, progress, weight_amax, mine, parts)
    else:
        t0 = time.perf_counter()
        tokens = runner.run(model, batches, progress)
        parts["layerwise"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    settle(model)
    parts["settle"] = time.perf_counter() - t0
    return tokens


def _weight_share(weights, mesh: Mesh) -> set[str] | None:
    """This DP rank's share of the weight amaxes (None: all of them, one DP rank). The others'
    quantizers are marked not ``local``: the sync then expects their values from elsewhere
    (per-channel / per-block ones included) and MAX brings them in, exactly."""
    if mesh.dp <= 1:
        return None
    mine = split_weights(weights, mesh.dp, mesh.dp_rank)
    for src in weights:
        if src.quantizer.name not in mine:
            src.quantizer.local = False
    return mine


def _resident_pass(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    progress: Callable[[int], Any] | None,
    weight_amax: Mapping[str, torch.Tensor] | None,
    mine: set[str] | None,
    parts: dict[str, float],
) -> int:
    """Steps 2-3 with the whole model on its device: weight amax (``mine``: this DP rank's
    share only), then every batch's forward: ``first_batch`` (the warm-up) timed apart from
    ``batches`` (the others). Two more figures inside those, for telling warm-up from work:
    ``first_batch_host``, the first batch until its forward returned (before the device
    finished), and ``second_batch`` (the first of ``batches``)."""
    device = _model_device(model)
    t0 = time.perf_counter()
    calibrate_weights(model, weight_amax, within=None if mine is None else mine.__contains__)
    wait_device(device)
    parts["weight_amax"] = (t1 := time.perf_counter()) - t0
    tokens = 0
    with torch.no_grad(), dequantized_compute():
        for i, b in enumerate(batches):
            model(input_ids=b.to(device), use_cache=False)
            tokens += b.numel()
            if progress is not None:
                progress(1)
            if i == 0:
                parts["first_batch_host"] = time.perf_counter() - t1
                wait_device(device)
                now = time.perf_counter()
                parts["first_batch"], t1 = now - t1, now
            elif i == 1:
                wait_device(device)
                parts["second_batch"] = time.perf_counter() - t1
    wait_device(device)
    parts["batches"] = time.perf_counter() - t1
    return tokens


def wait_device(device: torch.device) -> None:
    """Let the device finish what was queued, so that the timing of a piece is its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _expert_tokens(experts, mesh: Mesh) -> list[list[list[int]]]:
    """Per experts module, per global expert: tokens it got on each data rank (one collective)."""
    group = mesh.data_group
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    sizes = [info.num_experts for info in experts]
    total = sum(sizes)
    if total == 0:
        return []
    buf = torch.zeros(world, total, dtype=torch.int64)
    buf[rank] = torch.tensor([t for info in experts for t in info.tokens], dtype=torch.int64)
    if group is not None:
        buf = buf.to(group_device(group))
        # a rank died after the sync, or the deadline passed before it: SyncError either way
        what = "the expert token report"
        (deadline_of(group) or Deadline(None)).run(
            what, dist.all_reduce, buf, group=group, error=SyncError
        )
    out, start = [], 0
    per_rank = buf.cpu().tolist()
    for n in sizes:
        out.append([[per_rank[r][start + e] for r in range(world)] for e in range(n)])
        start += n
    return out


def _state(model: nn.Module, qs: list[TensorQuantizer], amaxes: list, quant_cfg: QuantConfig):
    """The calibration file's contents; ``amaxes``: each quantizer's amax, on the host."""
    mtype = getattr(getattr(model, "config", None), "model_type", "") or ""
    amax = {q.key: a.float() for q, a in zip(qs, amaxes, strict=True) if a is not None}
    return CalibrationState(
        amax=amax,
        quantizers={q.key: q.describe(a) for q, a in zip(qs, amaxes, strict=True)},
        model_type=mtype,
        model_fingerprint=model_fingerprint(model_names_shapes(model)),
        quant=quant_cfg.record(),
    )


def _report(qs, amaxes: list, experts, expert_ranks, mesh: Mesh) -> dict[str, Any]:
    layers: dict[str, dict[str, Any]] = {}
    for q, a in zip(qs, amaxes, strict=True):
        if not q.enabled:
            continue
        row = layers.setdefault(
            layer_of(q.name),
            {
                "calibrated": 0,
                "total": 0,
                "amax_min": None,
                "amax_max": None,
                "shared": 0,
                "zero_amax": [],
            },
        )
        row["total"] += 1
        if a is None:
            continue
        row["calibrated"] += 1
        if a.dim() == 0:
            lo = hi = float(a)
        else:
            lo, hi = float(a.min()), float(a.max())
        row["amax_min"] = lo if row["amax_min"] is None else min(row["amax_min"], lo)
        row["amax_max"] = hi if row["amax_max"] is None else max(row["amax_max"], hi)
        if q.shared_from_layer:
            row["shared"] += 1
        if hi == 0.0:
            row["zero_amax"].append(q.key)
    for info, per_expert in zip(experts, expert_ranks, strict=True):
        row = layers.setdefault(layer_of(info.module_name + "."), {})
        hot = {
            str(e): " ".join(f"r{r}" for r, n in enumerate(counts) if n)
            for e, counts in enumerate(per_expert)
            if any(counts)
        }
        row["experts_with_tokens"] = hot
        row["experts_total"] = info.num_experts
        row["cold_experts"] = [e for e, counts in enumerate(per_expert) if not any(counts)]
        row["expert_tokens"] = {str(e): counts for e, counts in enumerate(per_expert)}
    enabled = [(q, a) for q, a in zip(qs, amaxes, strict=True) if q.enabled]
    return {
        "world_size": mesh.world_size,
        "dp": mesh.dp,
        "ep": mesh.ep,
        "tp": mesh.tp,
        "quantizers": len(enabled),
        "disabled": len(qs) - len(enabled),
        "calibrated": sum(1 for _, a in enabled if a is not None),
        "uncalibrated": [q.key for q, a in enabled if a is None],
        "layers": layers,
    }
