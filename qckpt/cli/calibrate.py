"""``qckpt calibrate``: max calibration over DP x EP x TP ranks, amax sync, calibration file."""

from __future__ import annotations

from qckpt.cli import _output
from qckpt.cli._common import start, world
from qckpt.cli._options import JsonOpt, NprocOpt, RecipeArg, SetOpt, VerboseOpt
from qckpt.outputs import guard as guard_paths
from qckpt.outputs import recipe_inputs
from qckpt.recipe import Recipe


def calibrate_cmd(
    recipe: RecipeArg,
    set_: SetOpt = None,
    json_path: JsonOpt = None,
    nproc_per_node: NprocOpt = 1,
    verbose: VerboseOpt = False,
) -> None:
    """Insert quantizers, run calibration data, sync amax over ranks, write the calibration file.

    Examples:

        qckpt calibrate configs/tiny-moe.yaml

        torchrun --nproc-per-node 2 -m qckpt calibrate configs/tiny-moe.yaml --json amax.json

        qckpt calibrate configs/tiny-moe.yaml --nproc-per-node 4 --set parallel.ep=2

        torchrun --nproc-per-node 2 -m qckpt calibrate configs/tiny-dense.yaml --set parallel.tp=2

        qckpt calibrate configs/tiny-dense.yaml --set calibrate.data.source=text --set calibrate.data.path=my.txt
    """

    def guard(r: Recipe) -> None:
        ins = recipe_inputs(r, recipe) + [("calibrate.data.path", r.calibrate.data.path)]
        outs = [("calibrate.output", r.calibrate.output), ("--json", json_path)]
        guard_paths(outs, ins, file_outputs=["calibrate.output", "--json"])

    r = start(recipe, set_, nproc_per_node, verbose, guard=guard)
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.state_file import save_calibration
    from qckpt.checkpoint.load import load_checkpoint
    from qckpt.models.build import build_model, materialize
    from qckpt.parallel.expert import shard_experts
    from qckpt.parallel.tensor import shard_tensor_parallel
    from qckpt.report import render_amax_report

    with world(r, r.load.device) as mesh:
        # built on the meta device: with parallel.ep / parallel.tp each rank then allocates and
        # reads only its own experts and linear shards, never the whole model
        model = build_model(r.model.source, dtype=r.model.dtype, seed=r.model.seed, device="meta")
        sharded = shard_experts(model, mesh)
        tp_sharded = shard_tensor_parallel(model, mesh)
        materialize(model, mesh.device)
        if sharded:
            _output.log(f"experts of {len(sharded)} MoE blocks sharded over {mesh.ep} EP ranks")
        if tp_sharded:
            _output.log(f"{len(tp_sharded)} linears split over {mesh.tp} TP ranks")
        # the data first: a short file under strict: true is refused before the weights load
        batches, data_report = _batches(r, model.config.vocab_size, mesh)
        _output.log(f"reading weights from {r.checkpoint.path}")
        load_checkpoint(
            model, r.checkpoint.path, format=r.checkpoint.format, stream=True, mesh=mesh
        )
        _output.log(f"calibrating on {len(batches)} batches")
        with _output.progress("calibrating", len(batches)) as advance:
            state, report = calibrate_model(
                model,
                batches,
                r.quant,
                mesh,
                share_expert_inputs=r.calibrate.share_expert_inputs,
                progress=advance,
            )
        out = r.calibrate.output
        if mesh.is_main:
            save_calibration(state, out)
        if _output.speaks():
            render_amax_report(report)
        report["data"] = data_report
        _output.write_json(json_path, report)
        n = len(state.amax)
        _output.result(f"wrote {out}: {n} amax values from {mesh.world_size} rank(s)")


def _batches(r: Recipe, vocab_size: int, mesh) -> tuple[list, dict]:
    """This data rank's batches, and what the whole set held (for the report)."""
    from qckpt.calib.data import calibration_batches

    stats: dict = {}
    batches = calibration_batches(
        r.calibrate.data,
        vocab_size=vocab_size,
        model_source=r.model.source,
        data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
        stats=stats,
    )
    return batches, _data_report(r.calibrate.data, stats["samples"])


def _data_report(cfg, samples: int) -> dict:
    """What the calibration set held; a short file is said out loud (strict: refused earlier)."""
    short = samples < cfg.num_samples
    if short:
        _output.log(
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
