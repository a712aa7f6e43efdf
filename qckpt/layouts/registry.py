"""Which family a dir holds, and which family an export writes: one table each.

Reading: a dir's ``config.json`` ``quantization_config`` (its ``quant_method``) and
``hf_quant_config.json`` name the family whose module builds the dir's
:class:`~qckpt.layouts.source_layout.SourceLayout` (:data:`SOURCE_FAMILIES`); a dir with no
quantization config and nothing quantized in it is ``plain``; anything quantized that no family
explains (an F8 tensor or a ``*_scale`` tensor without a ``quantization_config``, a layout or a
bit width we do not read) is refused with one line naming what was found: codes are never read
as values. Writing: ``export.format`` (and the weights' format) name the
:class:`~qckpt.layouts.export_layout.ExportLayout` (:data:`EXPORT_FAMILIES`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qckpt.errors import CheckpointError, ExportError
from qckpt.layouts import compressed_tensors, ct_writers, deepseek, gpt_oss, modelopt
from qckpt.layouts.export_layout import BlockScales, ExportLayout
from qckpt.layouts.names import GPT_OSS_METHOD
from qckpt.layouts.source_layout import (
    FP8_DTYPES,
    SourceLayout,
    found,
    is_param,
    model_dtype,
    read_json_if_any,
)
from qckpt.recipe import QuantConfig
from qckpt.storage.slices import Index

# quant_method -> the family module's reader of a dir's layout: (stored index, config.json's
# quantization_config, hf_quant_config.json) -> SourceLayout
SOURCE_FAMILIES: dict[str, Callable[[Index, Any, Any], SourceLayout]] = {
    "modelopt": modelopt.read_layout,
    "compressed-tensors": compressed_tensors.read_layout,
    "fp8": deepseek.read_layout,  # DeepSeek-V3's blockwise FP8
    GPT_OSS_METHOD: gpt_oss.read_layout,  # gpt-oss's MXFP4 experts
}
# export.format -> the family's ExportLayout for a one-scheme quant config, the model dtype and
# where NVFP4 block scales come from
EXPORT_FAMILIES: dict[str, Callable[[QuantConfig, torch.dtype, BlockScales | None], ExportLayout]]
EXPORT_FAMILIES = {
    "compressed-tensors": ct_writers.export_layout,
    "modelopt": modelopt.ModelOptLayout,
}
# export.format -> the family's layout of a quant.schemes recipe (the same and each linear's
# entry index: None, the model dtype)
MIXED_FAMILIES: dict[str, Callable[..., ExportLayout]] = {
    "compressed-tensors": ct_writers.mixed_layout,
    "modelopt": modelopt.mixed_layout,
}


def detect_layout(
    index: Index, config: dict[str, Any] | None, hf_quant: dict[str, Any] | None, where: str
) -> SourceLayout:
    """The layout of a dir from its tensors (``index``), ``config.json`` and
    ``hf_quant_config.json`` (None when absent). One-line CheckpointError when it is quantized in
    a way qckpt does not read."""
    qc = (config or {}).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    # ModelOpt's hf_quant_config.json names the family whatever config.json says
    read = SOURCE_FAMILIES.get("modelopt" if hf_quant is not None else method)
    try:
        if read is not None:
            layout = read(index, qc if isinstance(qc, dict) else None, hf_quant)
        elif qc is not None:
            raise CheckpointError(
                f"quantization_config with quant_method {method!r}: not a source layout qckpt "
                "reads (fp8 blockwise, compressed-tensors, modelopt, mxfp4 of gpt-oss)"
            )
        else:
            what = found(index)
            if what:
                raise CheckpointError(
                    f"unknown quantized layout: {what}, and no quantization_config in config.json"
                )
            return SourceLayout(name="plain", dtype=model_dtype(config))
    except CheckpointError as exc:  # its kind (and exit code) kept, the dir named
        raise type(exc)(f"{where}: {exc}") from None
    layout.dtype = model_dtype(config)
    claimed = {k for w in layout.weights.values() for k in (w.codes, *w.aux_keys)}
    for k, (_, _, dt) in index.items():
        if k in claimed:
            continue
        if is_param(k):
            layout.hidden.add(k)  # activation / KV-cache scales and the like
        elif dt in FP8_DTYPES or (dt == torch.uint8 and f"{k}_scale" in index):
            raise CheckpointError(
                f"{where}: {k} is stored as {dt} but the {layout.describe()} layout gives it no "
                "scale; refusing to read its codes as values"
            )
    return layout


def source_layout(path: str | os.PathLike, index: Index) -> SourceLayout:
    """``detect_layout`` with the dir's own config files."""
    p = Path(path)
    return detect_layout(
        index,
        read_json_if_any(p / "config.json"),
        read_json_if_any(p / "hf_quant_config.json"),
        str(p),
    )


def refuse_quantized_dcp(names: dict[str, torch.dtype], where: str) -> None:
    """A DCP dir holding codes or scales: no layout of ours says how to read it; refuse."""
    index: Index = {k: ("", (), dt) for k, dt in names.items()}
    what = found(index)
    if what:
        raise CheckpointError(
            f"{where}: unknown quantized layout: {what} in a DCP checkpoint (qckpt reads "
            "quantized HF safetensors dirs, and DCP checkpoints of high-precision values)"
        )


def make_layout(
    export_format: str,
    quant: QuantConfig,
    model_dtype: torch.dtype,
    block_scales: BlockScales | None = None,
    assignment: dict[str, int | None] | None = None,
) -> ExportLayout:
    """The :class:`ExportLayout` of ``export.format`` for ``quant``; a one-line ExportError for
    a format no family writes (each family's constructor refuses a recipe it cannot express;
    for ``quant.schemes``, a SchemeError naming the entry). ``assignment`` (each linear's entry
    index, :func:`qckpt.models.schemes.assign_schemes`) is needed for ``quant.schemes``."""
    make = EXPORT_FAMILIES.get(export_format)
    if make is None:
        raise ExportError(
            f"export.format: unknown layout {export_format!r} (compressed-tensors | modelopt)"
        )
    if quant.mixed:
        return MIXED_FAMILIES[export_format](quant, model_dtype, block_scales, assignment or {})
    return make(quant, model_dtype, block_scales)
