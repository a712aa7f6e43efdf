"""``qckpt calibrate``'s body: the sharded model, the data, the weights, calibration, the file."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial

from qckpt import phases
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.hooks import SILENT, Hooks
from qckpt.pipeline.model import build_for
from qckpt.recipe import DataConfig, Recipe


@dataclass(kw_only=True)
class CalibrateResult:
    state: object  # qckpt.calib.state_file.CalibrationState
    report: dict  # the amax report
    data: dict  # what the calibration set held (data_summary)
    output: str
    world_size: int


def calibrate(recipe: Recipe, mesh: Mesh, *, hooks: Hooks = SILENT) -> CalibrateResult:
    """Calibrate ``recipe``'s model on its data over ``mesh``; the main rank writes the file."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.deal import dealable
    from qckpt.calib.state_file import save_calibration
    from qckpt.models.build import load_config, model_type
    from qckpt.models.naming import refuse_experts_layout

    refuse_experts_layout(model_type(load_config(recipe.model.source)), "calibrate")
    # built on the meta device: with parallel.ep / parallel.tp each rank then allocates and
    # reads only its own experts and linear shards, never the whole model. Quantized-resident
    # weights: the linears and experts the calibration quantizes are held in that format
    # (native tensors: the calibration instruments nn.Linear and fused experts, not TE's).
    # calibrate.offload: the model stays on meta; the runner allocates one layer at a time
    resident = recipe.calibrate.weights_resident
    offload = recipe.calibrate.offload != "none"
    if offload:
        from qckpt.pipeline.offload import build_meta

        built = build_meta(recipe, mesh)
    else:
        params = "none" if resident == "bf16" else resident
        built = build_for(recipe, mesh, params=params, backend="native")
    model = built.model
    if built.quantized:
        hooks.log(f"{len(built.quantized)} weights held as {resident} while calibrating")
    if built.ep_sharded:
        hooks.log(f"experts of {len(built.ep_sharded)} MoE blocks sharded over {mesh.ep} EP ranks")
    if built.tp_sharded:
        hooks.log(f"{len(built.tp_sharded)} linears split over {mesh.tp} TP ranks")
    # the data first: a short file under strict: true is refused before the weights load
    # (pure DP: every rank holds every batch and takes the next one when it comes free)
    dealt = dealable(mesh, offload)
    batches, data_report = calibration_data(recipe, mesh, model.config.vocab_size, dealt, hooks)
    runner, tap, read, steps = None, None, None, len(batches)
    with phases.phase(phases.READ):
        if offload:
            from qckpt.pipeline.offload import runner_for

            # layer: the checkpoint checked from its metadata; host: the layers read here
            runner = runner_for(recipe, mesh, model, hooks)
            steps *= model.config.num_hidden_layers
        else:
            tap, read = load_weights(recipe, mesh, model, bool(built.quantized), hooks)
    how = f", dealt to the {mesh.dp} DP ranks as they come free" if dealt else ""
    hooks.log(f"calibrating on {len(batches)} batches{how}")
    # the amax sync inside is charged to its own phase (calib.sync is timed); with offload
    # the layer reads overlap the forwards and are charged here too
    c, algorithm = recipe.calibrate, algorithm_of(recipe)
    # gptq under offload: its sidecar written layer by layer
    streaming = bool(algorithm.sidecar) and runner is not None
    with (
        phases.phase(phases.FORWARD),
        hooks.progress("calibrating", steps) as advance,
        _sidecar(streaming, c.output, mesh, algorithm),
    ):
        amax = tap.amax() if tap is not None else None
        if dealt:  # the bar shows the batches every rank has taken
            advance = partial(_advance_dealt, advance, batches)
        state, report = calibrate_model(
            model, batches, recipe.quant, mesh, share_expert_inputs=c.share_expert_inputs,
            progress=advance, weight_amax=amax, runner=runner, moe_forward=c.moe_forward,
            algorithm=algorithm,
        )  # fmt: skip
    _held(report, runner, model, resident, read, hooks)
    out = recipe.calibrate.output
    if algorithm.sidecar:  # gptq's and awq's weights, beside the file
        with phases.phase(phases.WRITE):
            from qckpt.calib.gptq_pass import write_weights

            write_weights(state, out, mesh, algorithm.sidecar, streaming)
    if mesh.is_main:
        with phases.phase(phases.WRITE):
            state.model = _model_record(recipe.model.source)
            save_calibration(state, out)
    return CalibrateResult(
        state=state, report=report, data=data_report, output=out, world_size=mesh.world_size
    )


def _sidecar(streaming: bool, out: str, mesh: Mesh, algorithm):
    """gptq under offload writes its sidecar layer by layer (never the whole model in memory:
    ``qckpt.calib.gptq_pass.streamed_sidecar``); otherwise nothing here."""
    from qckpt.calib.gptq_pass import streamed_sidecar

    return streamed_sidecar(out, mesh, algorithm) if streaming else contextlib.nullcontext()


def _held(report: dict, runner, model, resident: str, read, hooks: Hooks) -> None:
    """What the calibration held on the device, into the report and the log."""
    if runner is not None:
        from qckpt.pipeline.offload import held_bytes, summary

        hooks.log(summary(report["offload"]))
        report.update(weights_resident=resident, param_bytes=held_bytes(report["offload"]))
        return
    from qckpt.report import human_bytes

    report.update(weights_resident=resident, param_bytes=param_bytes(model), read=read)
    hooks.log(f"parameters held: {human_bytes(report['param_bytes'])} ({resident})")


def _model_record(source: str) -> dict:
    """What export needs of the model (``qckpt.export.model_record``), so that it need not
    import the model's code; made from a meta build of the config (the model's code is loaded
    here anyway), as export would make it."""
    from qckpt.export.model_record import make_record
    from qckpt.export.plan import config_dict, model_modules
    from qckpt.models.build import load_config

    cfg = load_config(source)
    return make_record(source, config_dict(cfg), model_modules(cfg))


def algorithm_of(recipe):
    """The calibration algorithm (``qckpt.calib.algorithms``) of ``recipe``'s ``calibrate``
    section, its options from the YAML keys as they are; a scheme whose inputs gptq's
    ``gptq_inputs: quantized`` cannot quantize as the clients do is refused here, in one line."""
    import torch

    from qckpt.calib.algorithms import algorithm_from
    from qckpt.calib.gptq_inputs import QUANTIZED, input_mode
    from qckpt.calib.instrument import entry_scheme

    c = recipe.calibrate
    # FP8 static scales as stored: compressed-tensors' model dtype
    ct = recipe.export.format == "compressed-tensors"
    dtype = getattr(torch, recipe.model.dtype) if ct else torch.float32
    if c.gptq_inputs == QUANTIZED:
        # every scheme's inputs checked now (before any work): each linear's own scheme
        # decides its inputs' quantization in the pass
        for entry in recipe.quant.entries():
            input_mode(entry_scheme(entry.inputs, "input"), dtype)
    algo = algorithm_from(c, dtype)
    algo.check_schemes([entry_scheme(e.weights, "weight") for e in recipe.quant.entries()])
    return algo


def calibration_data(recipe: Recipe, mesh: Mesh, vocab_size: int, dealt: bool, hooks: Hooks):
    """This rank's batches (all of them, dealt as the ranks come free, when ``dealt``) and
    what the calibration set held; a set EP cannot split evenly is refused here."""
    from qckpt.calib.data import calibration_batches, check_even_split
    from qckpt.calib.deal import DealtBatches

    data_cfg = recipe.calibrate.data
    with phases.phase(phases.DATA):
        batches = calibration_batches(
            data_cfg,
            vocab_size=vocab_size,
            model_source=recipe.model.source,
            data_rank=0 if dealt else mesh.data_rank,
            data_world=1 if dealt else mesh.data_parallel_size,
            stats=(data_stats := {}),
        )
        if dealt:
            batches = DealtBatches(batches, mesh.dp_group)
    data_report = data_summary(data_cfg, data_stats["samples"], hooks)
    check_even_split(data_stats["samples"], data_cfg.batch_size, mesh.data_parallel_size, mesh.ep)
    return batches, data_report


def _advance_dealt(advance, batches, *_) -> None:
    advance(batches.position, len(batches))


def load_weights(recipe: Recipe, mesh: Mesh, model, quantized: bool, hooks: Hooks):
    """The whole (sharded) model's weights from the checkpoint; the weight-amax tap of a
    quantized-resident model (else None), and what this rank read (bytes, split or not)."""
    from qckpt.calib.calibrate import wait_device
    from qckpt.calib.weight_amax import CheckpointWeightAmax
    from qckpt.load.loader import load_checkpoint
    from qckpt.pipeline import dp_read

    hooks.log(f"reading weights from {recipe.checkpoint.path}")
    # a quantized weight's amax comes from the checkpoint's value as it streams in, not from
    # the re-quantized codes the model then holds
    # under DP each rank takes its share of them; the calibration's sync completes the rest
    split = (mesh.dp_rank, mesh.dp)
    tap = CheckpointWeightAmax(model, recipe.quant, split=split) if quantized else None
    # a DP-replicated model: each rank reads its share, the group broadcasts the rest
    shares = (
        dp_read.read_shares(model, mesh.dp) if dp_read.splittable(mesh, model, quantized) else None
    )
    only = None if shares is None else {n for names, _ in shares[mesh.dp_rank] for n in names}
    t0 = time.perf_counter()
    rep = load_checkpoint(
        model,
        recipe.checkpoint.path,
        format=recipe.checkpoint.format,
        stream=True,
        mesh=mesh,
        tap=tap,
        reader=recipe.load.reader,
        max_inflight=recipe.load.max_inflight,
        only=only,
    )
    moved, t1 = 0, time.perf_counter()
    if shares is not None:
        moved = dp_read.broadcast_shares(shares, mesh.dp_group)
        wait_device(mesh.device)  # the phase ends here anyway: the broadcasts' own time
        hooks.log(f"read 1/{mesh.dp} of the weights here, {moved / 1e9:.2f} GB broadcast over DP")
    read = {"bytes_read": rep.bytes_read, "split_over_dp": shares is not None, "broadcast": moved}
    # this rank's reading apart from the broadcasts (the phase also has the planning above)
    read.update(
        load_seconds=round(t1 - t0, 4), broadcast_seconds=round(time.perf_counter() - t1, 4)
    )
    return tap, read


def param_bytes(model) -> int:
    """Bytes the model's parameters hold on this rank: codes and scales for a quantized one."""
    from qckpt.formats import is_quantized

    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.quantized_nbytes() if is_quantized(p) else p.numel() * p.element_size()
    return total


def data_summary(cfg: DataConfig, samples: int, hooks: Hooks = SILENT) -> dict:
    """What the calibration set held; a short file is said out loud (strict: refused earlier)."""
    short = samples < cfg.num_samples
    if short:
        hooks.warn(
            f"[yellow]warning:[/yellow] calibrate.data.path: {cfg.path} holds {samples} samples "
            f"of {cfg.seq_len} tokens, fewer than num_samples {cfg.num_samples}; calibrating "
            "on those (calibrate.data.strict: true refuses instead)"
        )
    return {
        "source": cfg.source,
        "num_samples": cfg.num_samples,
        "samples_used": samples,
        "short": short,
    }
