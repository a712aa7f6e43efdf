"""Tensor quantizers: what calibration observes and what the amax sync moves between ranks.

A :class:`TensorQuantizer` does not change the model's numbers; during calibration it only
records the running max of ``|x|`` (max calibration), at the granularity the recipe asks for.
Its amax is ``None`` until it has seen data: the sync tells "never calibrated" from "calibrated
to zero" by presence, never by value.

The amax is kept as a plain attribute (not a registered buffer) on purpose: instrumenting a model
must not change its ``state_dict``, and the sync reads and writes tens of thousands of amaxes, which
has to stay far below the cost of ``nn.Module.__setattr__`` per quantizer. For the same reason the
sync may leave a per-tensor amax as a reference ``(buffer, index, shared)`` into its result buffer
instead of a tensor of its own: creating 10,000 tensor views costs more than the collectives. The
``amax`` property turns the reference into a 0-d tensor on first access.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from qckpt.errors import CalibrationError

GRANULARITIES = ("tensor", "channel", "block", "dynamic_block")
KINDS = ("weight", "input")
# the granularities whose stored amax is one number; the sync treats them alike
SCALAR_GRANULARITIES = ("tensor", "dynamic_block")


class TensorQuantizer(nn.Module):
    """One quantizer of one tensor (a linear's weight or its input).

    ``name`` is the HF checkpoint module name (``model.layers.0.mlp.experts.3.gate_proj``) and
    ``kind`` is ``"weight"`` or ``"input"``; ``key`` (``{name}.{kind}_amax``) is its entry in the
    calibration file. ``amax_shape`` is fixed at construction from the module's shapes, so every
    rank lays out the sync buffers identically even for quantizers it never calibrated.

    Granularities: ``tensor`` (one amax), ``channel`` (one per index of ``axis`` of a 2-D weight),
    ``block`` (static per block of ``block_size``; for inputs, blocks of the last dim), and
    ``dynamic_block`` (NVFP4: block scales are computed at quantization time; only the per-tensor
    global amax is calibrated, so it syncs exactly like ``tensor``).
    """

    def __init__(
        self,
        name: str,
        kind: str,
        *,
        shape: Sequence[int],
        granularity: str = "tensor",
        fmt: str = "fp8",
        axis: int = 0,
        block_size: Sequence[int] = (128, 128),
        enabled: bool = True,
        calib_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        local: bool = True,
        share_group: str | None = None,
        expert_layer: str | None = None,
        expert: int | None = None,
    ) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.name = name
        self.kind = kind
        self.shape = tuple(
            int(s) for s in shape
        )  # the observed tensor's shape ([..., in] for inputs)
        self.granularity = granularity
        self.format = fmt
        self.axis = axis
        self.block_size = tuple(int(b) for b in block_size)
        self.enabled = enabled
        self.calib_dtype = calib_dtype
        self.device = torch.device(device)
        # False for a routed expert that another EP rank holds: this rank keeps the quantizer so
        # that every rank's sync layout is the same, but is not expected to calibrate it
        self.local = local
        # routed-expert inputs that opt in to sharing: the key of their layer's sharing group
        self.share_group = share_group
        # routed-expert quantizers: the experts module and the global expert index (for messages)
        self.expert_layer = expert_layer
        self.expert = expert
        self._shared = False
        # plain attributes, not properties: the sync reads them for every quantizer
        self.is_scalar = granularity in SCALAR_GRANULARITIES
        self.amax_shape = self._amax_shape()
        self._amax: torch.Tensor | None = None

    # -- properties -----------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return f"{self.name}.{self.kind}_amax"

    @property
    def amax(self) -> torch.Tensor | None:
        a = self.__dict__["_amax"]
        if type(a) is tuple:  # a reference left by the sync
            buf, i, shared = a
            a = buf[i]
            self.__dict__["_amax"] = a
            self.__dict__["_shared"] = shared
        return a

    @property
    def shared_from_layer(self) -> bool:
        """True when this routed expert saw no tokens and took its layer's input amax."""
        a = self.__dict__["_amax"]
        return a[2] if type(a) is tuple else self.__dict__["_shared"]

    @shared_from_layer.setter
    def shared_from_layer(self, value: bool) -> None:
        _ = self.amax  # resolve a reference first, or it would override this
        self.__dict__["_shared"] = bool(value)

    @amax.setter
    def amax(self, value: torch.Tensor | None) -> None:
        if value is not None and tuple(value.shape) != self.amax_shape:
            raise ValueError(
                f"{self.key}: amax of shape {tuple(value.shape)}, expected {self.amax_shape}"
            )
        self.__dict__["_amax"] = value
        self.__dict__["_shared"] = False

    @property
    def is_enabled(self) -> bool:
        return self.enabled

    def reset(self) -> None:
        self.__dict__["_amax"] = None
        self.__dict__["_shared"] = False

    def _amax_shape(self) -> tuple[int, ...]:
        if self.granularity in SCALAR_GRANULARITIES:
            return ()
        if self.granularity == "channel":
            if len(self.shape) != 2:
                raise ValueError(
                    f"{self.name}: per-channel amax needs a 2-D weight, got {self.shape}"
                )
            return (self.shape[self.axis],)
        # static per-block
        if self.kind == "input":
            b = self.block_size[-1]
            return (math.ceil(self.shape[-1] / b),)
        if len(self.shape) != 2:
            raise ValueError(f"{self.name}: per-block amax needs a 2-D weight, got {self.shape}")
        b0, b1 = self.block_size if len(self.block_size) == 2 else (1, self.block_size[0])
        return (math.ceil(self.shape[0] / b0), math.ceil(self.shape[1] / b1))

    # -- calibration ----------------------------------------------------------------------------
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The max of ``|x|`` at this quantizer's granularity, in ``calib_dtype``.

        ``abs`` and ``amax`` are exact in any float dtype, so reducing in the tensor's own dtype
        and converting the (small) result afterwards gives the same bits as upcasting first,
        without a full-size float32 temporary.
        """
        x = x.detach()
        if self.granularity in SCALAR_GRANULARITIES:
            a = x.abs().amax() if x.numel() else x.new_zeros(())
        elif self.granularity == "channel":
            other = 1 - (self.axis % 2)
            a = x.abs().amax(dim=other)
        elif self.kind == "input":
            b = self.block_size[-1]
            flat = x.reshape(-1, x.shape[-1])
            n = self.amax_shape[0]
            pad = n * b - flat.shape[-1]
            if pad:
                flat = torch.nn.functional.pad(flat, (0, pad))
            a = flat.abs().reshape(flat.shape[0], n, b).amax(dim=(0, 2))
        else:
            r, c = x.shape
            n0, n1 = self.amax_shape
            b0, b1 = self.block_size if len(self.block_size) == 2 else (1, self.block_size[0])
            padded = torch.nn.functional.pad(x, (0, n1 * b1 - c, 0, n0 * b0 - r))
            a = padded.abs().reshape(n0, b0, n1, b1).amax(dim=(1, 3))
        return a.to(self.calib_dtype)

    def collect(self, x: torch.Tensor) -> None:
        """Fold ``x`` into the running max; a non-finite value is an error naming the module."""
        if not self.enabled:
            return
        a = self.reduce(x)
        if not bool(torch.isfinite(a).all()):
            raise CalibrationError(
                f"{self.name}: non-finite {self.kind} during calibration (NaN or Inf in the "
                f"{'weight' if self.kind == 'weight' else 'activations'}); amax would be meaningless"
            )
        a = a.to(self.device)
        cur = self.amax
        # not in place: a synced amax may be a view into a shared buffer
        self.__dict__["_amax"] = a if cur is None else torch.maximum(cur, a.to(cur.dtype))

    def extra_repr(self) -> str:
        amax = self.amax
        if amax is None:
            val = "None"
        elif amax.numel() == 1:
            val = f"{float(amax):.4g}"
        else:
            val = f"[{tuple(amax.shape)}] max={float(amax.max()):.4g}"
        return (
            f"{self.key}, {self.granularity}, {self.format}, enabled={self.enabled}, amax={val}"
            + (", shared_from_layer" if self.shared_from_layer else "")
        )

    def describe(self) -> dict:
        """The calibration file's metadata entry for this quantizer."""
        amax = self.amax
        d = {
            "module": self.name,
            "kind": self.kind,
            "granularity": self.granularity,
            "format": self.format,
            "enabled": self.enabled,
            "calibrated": amax is not None,
            "shared": self.shared_from_layer,
            "dtype": str(amax.dtype if amax is not None else self.calib_dtype).replace(
                "torch.", ""
            ),
            "amax_shape": list(self.amax_shape),
        }
        if self.granularity == "channel":
            d["axis"] = self.axis
        if self.granularity == "block":
            d["block_size"] = list(self.block_size)
        if self.expert is not None:
            d["expert"] = self.expert
        return d
