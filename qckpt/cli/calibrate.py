"""``qckpt calibrate``: max calibration over DP x EP x TP ranks, amax sync, calibration file."""

from __future__ import annotations

import gc
import os

from qckpt import phases
from qckpt.cli import output
from qckpt.cli._common import start, world
from qckpt.cli._options import JsonOpt, NprocOpt, RecipeArg, SetOpt, VerboseOpt
from qckpt.cli.gpu_use import GpuUse
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
        from qckpt.calib.datasets import precheck

        precheck(r.calibrate.data)

    def gpus(r: Recipe) -> GpuUse:
        return GpuUse("load.device", r.load.device)

    r = start(recipe, set_, nproc_per_node, verbose, guard=guard, gpus=gpus)
    with phases.phase(phases.STARTUP):
        from qckpt.pipeline.imports import cuda_warmup, warm_imports

        mods = ("qckpt.pipeline.calibrate", "qckpt.load.loader", "qckpt.calib.calibrate")
        mods += ("qckpt.calib.data", "qckpt.calib.state_file")
        warm = cuda_warmup(r, "calibrate", os.environ)
        warm_imports(r.model.source, *mods, cuda_first_use=warm or False)
        from qckpt.pipeline.calibrate import calibrate
        from qckpt.report import render_amax_report, render_command
        from qckpt.summary import calibrate_summary

        # the ~400k objects the imports made live as long as the process: out of the cyclic
        # GC's sight, a full collection (one fell after the sync, where the file's 10^4 amaxes
        # are made) walks what the command made since, not them too (0.5 -> 0.1 s on a CPU)
        gc.freeze()

    with world(r, r.load.device) as mesh:
        res = calibrate(r, mesh, hooks=output.hooks())
        with phases.phase(phases.REPORT):
            # each rank's forward apart: under DP the slowest one sets the pace
            keys = ("forward_seconds", "forward_parts", "tokens_this_rank", "weight_amax_here")
            keys += ("batches",)  # pure DP: dealt as the ranks came free, so they differ
            mine = {k: res.report.get(k) for k in (*keys, "read")}
            data = output.with_phases({**res.report, "data": res.data}, mesh, mine)
            if output.verbose():
                render_amax_report(res.report)
                render_command(data)
            output.summary(calibrate_summary(data, str(res.output), r.calibrate.algorithm))
            output.write_json(json_path, data)
        n = len(res.state.amax)
        output.result(f"wrote {res.output}: {n} amax values from {res.world_size} rank(s)")
