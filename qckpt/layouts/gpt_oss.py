"""gpt-oss's MXFP4 experts (``quant_method: mxfp4``): read only, qckpt writes none.

OpenAI's gpt-oss releases keep attention, routers, embeddings and ``lm_head`` in BF16
(``modules_to_not_convert``) and store each MoE layer's fused experts as MXFP4 (transformers'
``integrations/mxfp4.py`` reads them):

* ``{experts}.{proj}_blocks`` uint8 ``[E, rows, cols / 32, 16]``: expert ``e``'s ``[rows, cols]``
  linear (rows its outputs), 32 E2M1 codes of a row's group in 16 bytes, the even column in the
  low nibble;
* ``{experts}.{proj}_scales`` uint8 ``[E, rows, cols / 32]``: the groups' E8M0 exponents (bias
  127), no global scale;
* beside them the BF16 biases ``{proj}_bias``, which are model tensors as they are.

The model (``GptOssExperts``) holds ``{proj}`` transposed, ``[E, cols, rows]`` (``x @ W``): the
logical weight is that, under that name, so a dequantized dir is what ``save_pretrained`` of a
BF16 gpt-oss writes (``gate_up_proj`` [E, hidden, 2 * intermediate], its gate and up columns
interleaved, as the model keeps them; ``down_proj`` [E, intermediate, hidden]).
"""

from __future__ import annotations

from typing import Any

import torch

from qckpt.errors import SourceLayoutError
from qckpt.formats.scheme import MX_BLOCK, SCHEMES
from qckpt.layouts.names import GPT_OSS_BLOCKS, GPT_OSS_SCALES
from qckpt.layouts.source_layout import QuantWeight, SourceLayout
from qckpt.storage.slices import Index

# bytes of one group's codes: 32 E2M1 codes, two a byte
_GROUP_BYTES = MX_BLOCK // 2


def read_layout(index: Index, qc: dict[str, Any] | None, hf_quant: Any = None) -> SourceLayout:
    """The layout of a gpt-oss MXFP4 dir (``qc``, ``hf_quant``: the registry's signature; the
    tensors alone say which weights are quantized). A ``_blocks`` without its ``_scales`` (or
    the reverse), or a shape or dtype that does not fit, is a one-line SourceLayoutError."""
    del qc, hf_quant
    cls = next(c for c in SCHEMES.values() if c.mx and c.code_bits == 4)
    weights: dict[str, QuantWeight] = {}
    for key, (f, shape, dt) in index.items():
        if (
            key.endswith(GPT_OSS_SCALES)
            and key.removesuffix(GPT_OSS_SCALES) + GPT_OSS_BLOCKS not in index
        ):
            raise SourceLayoutError(
                f"{key}: MXFP4 scales without their codes "
                f"({key.removesuffix(GPT_OSS_SCALES)}{GPT_OSS_BLOCKS} missing)"
            )
        if not key.endswith(GPT_OSS_BLOCKS):
            continue
        name = key.removesuffix(GPT_OSS_BLOCKS)
        skey = name + GPT_OSS_SCALES
        _check(key, tuple(shape), dt, skey, index)
        experts, rows, groups, _ = (int(n) for n in shape)
        weights[name] = QuantWeight(
            name=name,
            shape=(experts, groups * MX_BLOCK, rows),
            scheme=cls(),
            granularity="group",
            block=(1, MX_BLOCK),
            codes=key,
            scale=skey,
            file=f,
            experts=experts,
        )
    if not weights:
        raise SourceLayoutError(
            f"quant_method mxfp4 but no *{GPT_OSS_BLOCKS} / *{GPT_OSS_SCALES} tensors (gpt-oss's "
            "MXFP4 experts) in the checkpoint"
        )
    return SourceLayout(
        name="gpt-oss-mxfp4", detail=f"mxfp4 experts e8m0 per {MX_BLOCK}", weights=weights
    )


def _check(key: str, shape: tuple[int, ...], dt: torch.dtype, skey: str, index: Index) -> None:
    """A ``_blocks`` tensor and its ``_scales`` as transformers' dequantization reads them."""
    if dt != torch.uint8 or len(shape) != 4 or shape[-1] != _GROUP_BYTES:
        raise SourceLayoutError(
            f"{key}: gpt-oss MXFP4 blocks must be uint8 [experts, rows, groups, {_GROUP_BYTES}]; "
            f"got {dt} {list(shape)}"
        )
    if skey not in index:
        raise SourceLayoutError(f"{skey}: missing (the E8M0 scales of {key})")
    _, sshape, sdt = index[skey]
    if sdt != torch.uint8 or tuple(sshape) != shape[:3]:
        raise SourceLayoutError(
            f"{skey}: gpt-oss MXFP4 scales must be uint8 {list(shape[:3])} (one E8M0 exponent "
            f"per 32 codes of {key}); got {sdt} {list(sshape)}"
        )
