"""The projections serving stacks fuse into one weight (one scale after loading).

vLLM loads q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (DeepSeek's
``q_a_proj`` / ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``): what the export's shared scales,
the GPTQ pass, the export check and the evaluation's emulation all follow. Torch-free (``qckpt
check`` reads it).
"""

from __future__ import annotations

# the projections that vLLM fuses into one weight (one per-tensor scale after loading)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


# what vLLM fuses into one weight with one NVFP4 global scale (MLA's low-rank q and kv inputs too)
SCALE_FUSED_GROUPS = (*FUSED_GROUPS, ("q_a_proj", "kv_a_proj_with_mqa"))


def fused_parts(modules) -> list[list[str]]:  # noqa: ANN001 (any iterable of module names)
    """The modules that a client fuses into one weight (:data:`SCALE_FUSED_GROUPS` under one
    parent), grouped; groups of two or more only, each sorted."""
    by_parent: dict[tuple[str, int], list[str]] = {}
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        for gi, group in enumerate(SCALE_FUSED_GROUPS):
            if leaf in group:
                by_parent.setdefault((parent, gi), []).append(m)
    return [sorted(ms) for ms in by_parent.values() if len(ms) > 1]
