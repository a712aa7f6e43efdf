"""Transformer Engine destinations: TE's quantized parameters behind the planner's protocol.

The streaming planner talks to a destination through a small protocol (nominal ``shape``,
``dtype``, ``device``, ``fmt``; ``quantize_(src, update_state)``; ``quant_state()`` /
``load_quant_state()``; ``dequantize()``). Native :class:`~qckpt.formats.QuantizedTensor` speaks
it directly; :class:`TEDestination` makes TE's ``Float8Tensor`` (delayed and current scaling),
``Float8BlockwiseQTensor``, ``MXFP8Tensor`` and ``NVFP4Tensor`` speak it.

* quantize in place: TE turns ``copy_`` from a plain tensor into ``quantize_``; we call
  ``quantize_`` directly, under ``no_grad`` (parameters made under ``fp8_model_init`` require
  grad). The source is the planner's full-shape scratch, so a destination is never written
  through a narrowed view: MXFP8, blockwise and NVFP4 cannot express a partial slice without
  dequantizing, and per-tensor scaling must see the whole value.
* quantizer state: for delayed scaling the quantizer's ``amax`` is a view of row 0 of the recipe's
  amax history and ``scale`` is the recipe's scale; a quantize writes the amax. We snapshot every
  tensor attribute of the quantizer that a quantize may write and restore it in place, so the
  history and scale are left bit-identical.

TE is optional (``pip install 'qckpt[te]'``); nothing here imports it until asked.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qckpt.errors import UsageError

# quantizer attributes that a quantize may update (delayed: amax -> history row 0)
_STATE_ATTRS = ("amax", "scale", "amax_history")

INSTALL_HINT = "pip install 'qckpt[te]' on a machine with CUDA"


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _te_quantized_base() -> type | None:
    if not te_available():
        return None
    try:
        from transformer_engine.pytorch.tensor import QuantizedTensor
    except Exception:  # an install without the torch extension: treat as absent
        return None
    return QuantizedTensor


def is_te_quantized(t: Any) -> bool:
    base = _te_quantized_base()
    return base is not None and isinstance(t, base)


class TEDestination:
    """A TE quantized tensor seen through the planner's destination protocol."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype  # TE's nominal (high-precision) dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def fmt(self) -> str:
        return f"te:{type(self.tensor).__name__}"

    def numel(self) -> int:
        return self.tensor.numel()

    def dim(self) -> int:
        return self.tensor.dim()

    def size(self, i: int | None = None):
        return self.tensor.size() if i is None else self.tensor.size(i)

    def _quantizer(self) -> Any:
        return getattr(self.tensor, "_quantizer", None)

    def quant_state(self) -> dict[str, torch.Tensor]:
        q = self._quantizer()
        out: dict[str, torch.Tensor] = {}
        if q is None:
            return out
        for name in _STATE_ATTRS:
            v = getattr(q, name, None)
            if isinstance(v, torch.Tensor):
                out[name] = v.detach().clone()
        return out

    def load_quant_state(self, state: dict[str, torch.Tensor]) -> None:
        q = self._quantizer()
        if q is None:
            return
        with torch.no_grad():
            for name, v in state.items():
                cur = getattr(q, name, None)
                if isinstance(cur, torch.Tensor):
                    cur.copy_(v)  # in place: the amax is a view into the recipe's history

    def quantize_(self, src: torch.Tensor, update_state: bool = True) -> None:
        snap = None if update_state else self.quant_state()
        with torch.no_grad():
            self.tensor.quantize_(src)
        if snap is not None:
            self.load_quant_state(snap)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.tensor.dequantize(dtype=dtype or self.dtype)


def te_recipe(params_fmt: str) -> Any:
    """The TE recipe for ``load.params`` (fp8_delayed, fp8, fp8_block, mxfp8, nvfp4)."""
    from transformer_engine.common import recipe

    table = {
        "fp8_delayed": "DelayedScaling",
        "fp8": "Float8CurrentScaling",
        "fp8_block": "Float8BlockScaling",
        "mxfp8": "MXFP8BlockScaling",
        "nvfp4": "NVFP4BlockScaling",
    }
    name = table.get(params_fmt)
    if name is None or not hasattr(recipe, name):
        raise UsageError(f"load.params: {params_fmt!r} has no Transformer Engine recipe here")
    return getattr(recipe, name)()


def require_te() -> None:
    if not te_available():
        raise UsageError(
            f"load.backend: te needs Transformer Engine, which is not installed ({INSTALL_HINT})"
        )
    if not torch.cuda.is_available():
        raise UsageError("load.backend: te needs a CUDA device")


def _model_init(params_fmt: str):
    import transformer_engine.pytorch as te

    init = getattr(te, "quantized_model_init", None) or te.fp8_model_init
    return init(enabled=True, recipe=te_recipe(params_fmt))


def build_te_linears(
    model: nn.Module,
    params_fmt: str,
    *,
    skip: Callable[[str], bool] = lambda _name: False,
    device: Any = None,
) -> dict[str, str]:
    """Swap every ``nn.Linear`` whose name ``skip`` does not take (the recipe's ignore rule,
    :func:`qckpt.models.naming.ignored`) for a ``te.Linear`` whose weight is a TE
    quantized tensor of ``params_fmt``; returns ``{param name: fmt}``. The checkpoint's values
    come later, through the planner; the module keeps its name, so the state-dict keys match.
    Fused MoE experts stay as they are (TE's grouped GEMM layers are not mapped yet)."""
    require_te()
    import transformer_engine.pytorch as te

    done: dict[str, str] = {}
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not skip(name)
    ]
    for name, mod in targets:
        dev = device or mod.weight.device
        with _model_init(params_fmt):
            new = te.Linear(
                mod.in_features,
                mod.out_features,
                bias=mod.bias is not None,
                params_dtype=mod.weight.dtype,
                device=dev,
            )
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, new)
        done[f"{name}.weight"] = f"te:{type(new.weight).__name__}"
    return done
