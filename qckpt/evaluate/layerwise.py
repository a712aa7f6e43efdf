"""``qckpt eval --offload layer``: the source and the export one decoder layer at a time, for
models larger than the device (like ``calibrate.offload: layer``).

Both models are built on the meta device; only their outer modules (embeddings, rotary, final
norm, head) are allocated. One forward per batch with every decoder layer replaced by a
recorder captures layer 0's input and each layer's other arguments (masks, position
embeddings), all made by the model's own code. Then, layer by layer and model by model, the
layer is allocated on the device, filled from its dir (the export's quantized linears and
experts emulated as in the resident mode), runs every batch, and is dropped; its outputs become
the next layer's inputs. Last, a forward per batch with every layer replaced by a replay of the
final hidden states runs the model's own final norm and head. The values are the resident
mode's: the same modules, the same inputs, in the same batches.

Device memory: the outer modules of both models, one decoder layer (the export's emulated
layer in float32), and every batch's hidden states of both models (``--batch-size`` x seq_len x
hidden each, kept on the device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qckpt.calib.layerwise import decoder_layers
from qckpt.evaluate import metrics
from qckpt.evaluate.build import DirTensors, empty_meta, emulate, use_kv_attention
from qckpt.evaluate.cpu_linear import half_linears_in_float32
from qckpt.evaluate.scheme import ExportScheme
from qckpt.models.build import materialize


class _Side:
    """One model (source or export) walked layer by layer."""

    def __init__(self, path: Any, dtype: torch.dtype, dev: torch.device, scheme: Any) -> None:
        self.model = empty_meta(path, dtype)
        self.tensors = DirTensors(path, self.model)
        self.scheme, self.dev = scheme, dev
        self.mtype = getattr(self.model.config, "model_type", "")
        self.layers_name, self.layers = decoder_layers(self.model)
        self.counts = {"linears": 0, "experts": 0, "kv_cache_layers": 0}
        self._outer()
        self.states: list[torch.Tensor] = []
        self.kwargs: list[list[dict[str, Any]]] = []
        self.tuple_out = False

    def _outer(self) -> None:
        parent_name, _, leaf = self.layers_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, leaf, nn.ModuleList())
        try:
            materialize(self.model, self.dev)
            self.tensors.fill(self.model)
            if self.scheme is not None:
                self._add(emulate(self.model, self.scheme, self.tensors.fetch, self.mtype))
        finally:
            setattr(parent, leaf, self.layers)
        if self.scheme is not None:
            use_kv_attention(self.model, self.scheme)

    def _add(self, c: dict[str, int]) -> None:
        for k, v in c.items():
            self.counts[k] += v

    def capture(self, batch: torch.Tensor) -> None:
        """Layer 0's input and every layer's keyword arguments for ``batch``."""
        got: list[dict[str, Any]] = []
        first: list[torch.Tensor] = []

        def recorder(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not first:
                first.append(hidden_states)
            got.append(kwargs)
            return hidden_states

        self._patch(lambda i: recorder)
        try:
            self.model(batch, use_cache=False)
        finally:
            self._unpatch()
        self.states.append(first[0])
        self.kwargs.append(got)

    def _patch(self, make: Any) -> None:
        for i, layer in enumerate(self.layers):
            layer.forward = make(i)

    def _unpatch(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)

    def run_layer(self, i: int) -> None:
        layer = self.layers[i]
        materialize(layer, self.dev)
        prefix = f"{self.layers_name}.{i}."
        self.tensors.fill(layer, prefix)
        if self.scheme is not None:
            self._add(emulate(layer, self.scheme, self.tensors.fetch, self.mtype, prefix))
        for j, h in enumerate(self.states):
            out = layer(h, **self.kwargs[j][i])
            self.tuple_out = isinstance(out, tuple)
            self.states[j] = out[0] if self.tuple_out else out
        self.layers[i] = nn.Module()  # its weights are freed; the replay needs no weights

    def logits(self, j: int, batch: torch.Tensor) -> torch.Tensor:
        h = self.states[j]
        out = (h,) if self.tuple_out else h
        for i in range(len(self.layers)):
            self.layers[i] = _Replay(out)
        return self.model(batch, use_cache=False).logits


class _Replay(nn.Module):
    def __init__(self, out: Any) -> None:
        super().__init__()
        self.out = out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.out


def run_layerwise(
    source_dir: Any,
    scheme: ExportScheme,
    ids: torch.Tensor,
    nbytes: list[int],
    batch_size: int,
    dtype: torch.dtype,
    dev: torch.device,
    step: Any,
) -> tuple[metrics.Sums, dict[str, int]]:
    """The sums of :mod:`qckpt.evaluate.metrics` and the emulated counts, layer by layer."""
    src = _Side(source_dir, dtype, dev, None)
    exp = _Side(scheme.path, dtype, dev, scheme)
    batches = [ids[i : i + batch_size].to(dev) for i in range(0, ids.shape[0], batch_size)]
    sums = metrics.Sums()
    with torch.no_grad(), half_linears_in_float32(dev):
        for b in batches:
            src.capture(b[:, :-1])
            exp.capture(b[:, :-1])
        for i in range(len(src.layers)):
            src.run_layer(i)
            exp.run_layer(i)
            for j in range(len(batches)):
                sums.add_layer(i, src.states[j], exp.states[j])
        for j, b in enumerate(batches):
            sums.add_logits(src.logits(j, b[:, :-1]), exp.logits(j, b[:, :-1]), b[:, 1:])
            sums.nbytes += sum(nbytes[j * batch_size : (j + 1) * batch_size])
            step(int(b.shape[0]))
    return sums, exp.counts
