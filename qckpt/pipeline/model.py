"""The one order in which a model becomes a rank's model: a correctness rule, kept here only.

build (on meta, or seeded) -> shard EP -> shard TP -> quantize params -> materialize.

On meta (every build a checkpoint fills: ``qckpt load``, ``qckpt calibrate``) the quantized
parameters are made shape-only (``formats.empty``) and materialize allocates each one straight
in its final format and block: no high-precision copy, no random init, on the device. A seeded
build (tests, a recipe's demo model, ``load.backend: te``) has its values on the device first,
and its parameters are quantized from them.

EP goes first: it keeps a rank's block of the fused experts, which TP leaves whole; TP then
splits the attention and dense-MLP linears. Both must run before anything is allocated so that
a rank only ever holds its own blocks, and before the parameters are quantized, so that a
quantized parameter's scale covers the block the rank holds (its ``ShardSpec``) and not the
whole tensor. Loading comes last: the loader reads each parameter's ShardSpec to know which
block of the checkpoint to read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from qckpt import phases
from qckpt.parallel.mesh import Mesh
from qckpt.recipe import Recipe


@dataclass(kw_only=True)
class Built:
    """A rank's model and what sharding did to it (names of the sharded modules)."""

    model: nn.Module
    ep_sharded: list[str] = field(default_factory=list)
    tp_sharded: list[str] = field(default_factory=list)
    quantized: dict[str, str] = field(default_factory=dict)


def shard(model: nn.Module, mesh: Mesh) -> tuple[list[str], list[str]]:
    """EP, then TP: the sharded MoE blocks and the sharded linears (both empty at ep = tp = 1)."""
    from qckpt.parallel.expert import shard_experts
    from qckpt.parallel.tensor import shard_tensor_parallel

    return shard_experts(model, mesh), shard_tensor_parallel(model, mesh)


def build(
    source: str,
    mesh: Mesh,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    seeded: bool = False,
    sharded: bool = True,
    params: str = "none",
    ignore: Iterable[str] = (),
    backend: str = "native",
    before_shard: Callable[[nn.Module], None] | None = None,
    **param_opts: Any,
) -> Built:
    """This rank's model of ``source`` on ``mesh.device``.

    ``seeded=False``: built on meta, sharded, its quantized parameters made shape-only, then
    allocated in their final format (fields defined, see ``formats.empty``) and its plain
    tensors uninitialized, for a checkpoint to fill (a load refuses one that does not cover
    every tensor). ``seeded=True``: the seeded random weights (the same on every rank),
    sharded after the build, quantized from their values; ``load.backend: te`` with quantized
    parameters is always seeded (Transformer Engine makes its linears on a real device).
    ``sharded=False`` keeps the whole model on every rank (``qckpt load`` today: sharded
    loads are issue 17). ``before_shard(model)`` sees the whole model (tests bias routers
    there). ``params`` / ``ignore`` / ``backend`` / ``param_opts``: the quantized parameters
    (``qckpt.models.quantize_params``).
    """
    from qckpt.models.build import build_model

    seeded = seeded or (backend == "te" and params not in (None, "none"))
    device = mesh.device if seeded else "meta"
    with phases.phase(phases.BUILD):
        model = build_model(source, dtype=dtype, seed=seed, device=device)
    if before_shard is not None:
        before_shard(model)
    return prepare(
        model, mesh, sharded=sharded, params=params, ignore=ignore, backend=backend, **param_opts
    )


def prepare(
    model: nn.Module,
    mesh: Mesh,
    *,
    sharded: bool = True,
    params: str = "none",
    ignore: Iterable[str] = (),
    backend: str = "native",
    **param_opts: Any,
) -> Built:
    """The rest of the order for a model already built (whole, on meta or with its weights):
    shard EP then TP, quantize the parameters (shape-only on meta), allocate a meta model on
    ``mesh.device``.

    :func:`build` ends here; a caller holding a model it built itself (before its mesh, or
    with changes of its own) calls it directly.
    """
    from qckpt.models.build import materialize
    from qckpt.models.quantize_params import quantize_model_params

    with phases.phase(phases.BUILD):
        ep_names, tp_names = shard(model, mesh) if sharded else ([], [])
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and backend == "te" and params not in (None, "none"):
            materialize(model, mesh.device)  # TE's linears are made on a real device
            on_meta = False
    with phases.phase(phases.QUANTIZE):
        # on meta: shape-only quantized params, nothing computed
        quantized = quantize_model_params(
            model, params, ignore=ignore, backend=backend, **param_opts
        )
    if on_meta:
        with phases.phase(phases.BUILD):
            materialize(model, mesh.device)
    return Built(model=model, ep_sharded=ep_names, tp_sharded=tp_names, quantized=quantized)


def build_for(
    recipe: Recipe,
    mesh: Mesh,
    *,
    sharded: bool = True,
    seeded: bool = False,
    params: str = "none",
    backend: str | None = None,
) -> Built:
    """``build`` with a recipe's model and quantized-parameter settings (``backend``: the
    recipe's ``load.backend`` unless given)."""
    return build(
        recipe.model.source,
        mesh,
        dtype=recipe.model.dtype,
        seed=recipe.model.seed,
        seeded=seeded,
        sharded=sharded,
        params=params,
        ignore=recipe.quant.ignore,
        backend=recipe.load.backend if backend is None else backend,
    )
