"""One NVFP4 global scale per weight that serving stacks fuse.

vLLM loads q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (DeepSeek's
``q_a_proj`` / ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``) and keeps a single NVFP4 global
scale for the fused weight, the largest of the parts' ``weight_global_scale`` (compressed-
tensors: the smallest amax) or of their ``weight_scale_2`` (ModelOpt: the largest amax). A part
whose own global scale differs is then dequantized with another part's and comes out scaled by
the ratio of the two amaxes: on the shared real-text Llama, per-linear global scales gave 4.79 bits per
byte in vLLM 0.26 on an H200 (BF16 1.09). ModelOpt and llm-compressor both give the parts of a
fused weight one global amax, the largest; so does qckpt, before the block scales are made
under it. FP8 per-tensor weights are left apart: vLLM requantizes those to the largest scale
itself, and the files stay what earlier releases wrote.
"""

from __future__ import annotations

import torch

from qckpt.checkpoint.layout_names import fused_parts

__all__ = ["fused_parts", "share_fused_amax"]


def share_fused_amax(
    amax: dict[str, torch.Tensor], modules: list[str], kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """``amax`` with each fused group's per-tensor ``{kind}_amax`` set to the group's largest;
    a new dict.
    Amaxes that are not one value (per-channel, per-block) are left alone."""
    out = dict(amax)
    for group in fused_parts(modules):
        for kind in kinds:
            keys = [k for k in (f"{m}.{kind}_amax" for m in group) if k in amax]
            if len(keys) < 2 or any(amax[k].numel() != 1 for k in keys):
                continue
            # torch's max propagates a NaN, so the export's finiteness check still sees it
            top = torch.stack([amax[k].detach().float().reshape(()) for k in keys]).max()
            for k in keys:
                out[k] = top.clone().reshape(amax[k].shape)
    return out
