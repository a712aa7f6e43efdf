"""``calibrate.offload: layer | host``: the model stays on meta and calibrates one decoder layer
at a time (:mod:`qckpt.calib.layerwise`), its weights read from the checkpoint per layer
(``layer``) or held in host memory (``host``, :mod:`qckpt.load.layer_weights`)."""

from __future__ import annotations

from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.hooks import SILENT, Hooks
from qckpt.pipeline.model import Built, shard
from qckpt.recipe import Recipe


def build_meta(recipe: Recipe, mesh: Mesh) -> Built:
    """The model on meta, EP then TP sharded (the order of :mod:`qckpt.pipeline.model`), with
    nothing allocated: the runner allocates one layer at a time."""
    from qckpt.models.build import build_model

    m = recipe.model
    model = build_model(m.source, dtype=m.dtype, seed=m.seed, device="meta")
    ep_names, tp_names = shard(model, mesh)
    return Built(model=model, ep_sharded=ep_names, tp_sharded=tp_names)


def runner_for(recipe: Recipe, mesh: Mesh, model, hooks: Hooks = SILENT):
    """The :class:`LayerwiseRunner` for the recipe's ``calibrate.offload`` (``host``: the
    decoder layers are read into host memory here, before calibration starts)."""
    from qckpt.calib.layerwise import LayerwiseRunner, decoder_layers
    from qckpt.load.layer_weights import CheckpointLayers, HostLayers

    cal = recipe.calibrate
    disk = CheckpointLayers(
        recipe.checkpoint.path, format=recipe.checkpoint.format, device=mesh.device,
        config=model.config, reader=recipe.load.reader, max_inflight=recipe.load.max_inflight,
    )  # fmt: skip
    disk.check(model)
    weights = disk
    layers_name, layers = decoder_layers(model)
    if cal.offload == "host":
        weights = HostLayers(disk)
        hooks.log(f"reading {len(layers)} decoder layers into host memory")
        weights.hold([(f"{layers_name}.{i}", layer) for i, layer in enumerate(layers)])
    where = "host memory" if cal.activations == "host" else str(mesh.device)
    hooks.log(
        f"calibrating one of {len(layers)} decoder layers at a time on {mesh.device} "
        f"(weights: {'disk' if cal.offload == 'layer' else 'host memory'}, activations: {where})"
    )
    return LayerwiseRunner(weights, device=mesh.device, activations=cal.activations)


def held_bytes(rep: dict) -> int:
    """The most parameter bytes on the device at once: two layers' and the outer modules'."""
    return int(rep["layer_weight_bytes_peak"] + rep["outer_weight_bytes"])


def summary(rep: dict) -> str:
    """One log line of the runner's report: what it kept and held, what it read."""
    mib = 2**20
    return (
        f"offload {rep['mode']}: {rep['layers']} layers; activations kept "
        f"{rep['activation_bytes'] / mib:.1f} MiB + {rep['layer_args_bytes'] / mib:.1f} MiB of "
        f"layer arguments on {rep['activations_on']}; layer weights on the device at most "
        f"{rep['layer_weight_bytes_peak'] / mib:.1f} MiB (one layer "
        f"{rep['layer_weight_bytes_max'] / mib:.1f} MiB) + "
        f"{rep['outer_weight_bytes'] / mib:.1f} MiB outside the layers; read "
        f"{rep['bytes_read'] / 1e9:.2f} GB in {rep['read_seconds']:.1f} s, waited "
        f"{rep['prefetch_wait_seconds']:.1f} s for reads"
    )
