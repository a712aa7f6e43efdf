"""``qckpt eval``'s options (torch-free: the CLI checks them before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class EvalOptions:
    windows: int = 64
    seq_len: int = 512
    seed: int = 7
    batch_size: int = 16
    device: str = "auto"
    top_layers: int = 3
    offload: str = "none"  # none: both models resident | layer: one decoder layer at a time
    # fused linears (q/k/v, gate/up): vllm = one scale per fused weight as vLLM makes it at
    # load | as-stored = every shard with its own scales, as the files mean them
    fused: str = "vllm"
    # as-exported: each linear's inputs quantized as the export says | unquantized: the weights
    # alone, what a weight-only kernel computes | hopper: as a Hopper client runs it (NVFP4
    # linears weight-only, vLLM's Marlin W4A16; FP8 inputs quantized as exported)
    inputs: str = "as-exported"
    # as-exported: the weights dequantized from the export | unquantized: the source's weights
    # (with inputs as-exported: what the inputs' quantization alone costs)
    weights: str = "as-exported"


def options_from(ev: Any) -> EvalOptions:
    """The options of a recipe's ``eval:`` section (:class:`qckpt.recipe.EvalConfig`)."""
    return EvalOptions(
        windows=ev.windows,
        seq_len=ev.seq_len,
        seed=ev.seed,
        batch_size=ev.batch_size,
        device=ev.device,
        top_layers=ev.top_layers,
        offload=ev.offload,
        fused=ev.fused,
        inputs=ev.inputs,
        weights=ev.weights,
    )
