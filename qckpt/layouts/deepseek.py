"""DeepSeek-V3-style blockwise FP8 (``quant_method: fp8``): read only, qckpt writes none.

Per quantized linear: ``weight`` F8_E4M3 [M, N] and ``weight_scale_inv`` F32
[ceil(M/b0), ceil(N/b1)] for ``weight_block_size [b0, b1]`` (edge blocks partial); without a
block size one scale, per tensor.
"""

from __future__ import annotations

from typing import Any

from qckpt.errors import CheckpointError
from qckpt.layouts.source_layout import SourceLayout, fp8_weights
from qckpt.storage.slices import Index


def read_layout(index: Index, qc: dict[str, Any], hf_quant: Any = None) -> SourceLayout:
    """The layout of a blockwise FP8 dir (``hf_quant``: unused, the registry's signature)."""
    bs = qc.get("weight_block_size")
    if bs is None:
        options: list[tuple[str, Any]] = [("tensor", None)]
        detail = "fp8 per-tensor weight_scale_inv"
    else:
        if (
            not isinstance(bs, list)
            or len(bs) != 2
            or not all(isinstance(b, int) and b > 0 for b in bs)
        ):
            raise CheckpointError(
                f"quantization_config.weight_block_size: two positive ints, got {bs!r}"
            )
        options = [("block", (bs[0], bs[1]))]
        detail = f"fp8 block {bs}"
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise CheckpointError(f"quantization_config.fmt {fmt!r}: only e4m3 fp8 sources are read")
    return SourceLayout(
        name="fp8-blockwise", detail=detail, weights=fp8_weights(index, "_scale_inv", options)
    )
