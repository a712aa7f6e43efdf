"""Layer-by-layer calibration: the model stays on meta and one decoder layer at a time comes
onto the device, runs every calibration batch, and hands its outputs to the next layer.

Why the amaxes equal a resident run's bit for bit:

* every layer gets the arguments the model's own forward gives it. One forward per batch with
  each decoder layer's ``forward`` replaced by a recorder captures the embeddings (layer 0's
  input) and each layer's other arguments (causal mask, position ids, rotary cos/sin, ...),
  all built by the model's own modules; the last layer's recorder stops the forward there;
* a layer runs the batches in batch order with those arguments and its outputs replace its
  inputs: the very values a resident forward passes from layer to layer (a copy to and from
  host memory is exact);
* weight amaxes come from the same loaded values, and a max does not depend on whether the
  layers or the batches come first;
* quantizers outside the decoder layers (lm_head's, when it is quantized): one more forward
  per batch with the layers replaced by a replay of the final hidden states, so the model's own
  final norm and head run as they do resident.

A background thread brings layer ``i + 1``'s weights (read from the checkpoint, or copied from
host memory) while layer ``i`` runs: at most two layers' weights are on the device. Under EP every
rank walks the layers and batches in the same order, so the expert exchange's collectives
(:mod:`qckpt.parallel.expert`) meet as they do resident; a weight read never runs a collective.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import nn

from qckpt.calib.instrument import calibrate_weights, instrumentation
from qckpt.errors import CalibrationError

Modules = list[tuple[str, nn.Module]]


class LayerWeights(Protocol):
    """What puts weights on the device for a set of modules of a meta model, and takes them off."""

    mode: str

    def fetch(self, modules: Modules) -> int:
        """Allocate ``modules`` on the device with their checkpoint values; bytes allocated."""

    def release(self, modules: Modules) -> None:
        """Back onto meta (the device memory is freed)."""

    def report(self) -> dict[str, Any]: ...


class _Stop(Exception):
    """Raised by the last layer's recorder: the capture forward ends there."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layers' ModuleList (``model.layers`` of an HF causal LM) and its name."""
    want = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            if want is None or len(mod) >= want:
                return name, mod
    raise CalibrationError("calibrate.offload: cannot find the decoder layers of this model")


def _bytes(mod: nn.Module) -> int:
    ts = {id(t): t for t in [*mod.parameters(), *mod.buffers()]}
    return sum(t.numel() * t.element_size() for t in ts.values())


def _outer_modules(model: nn.Module, layers_name: str, head: bool) -> Modules:
    """The modules with weights of their own outside the decoder layers (embeddings, norms,
    rotary, and lm_head when ``head``), each named as in the model."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = []
    for name, mod in model.named_modules():
        if name == layers_name or name.startswith(layers_name + "."):
            continue
        own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        if not own or (mod is out_emb and not head):
            continue
        out.append((name, mod))
    return out


@contextlib.contextmanager
def _patched(layers: nn.ModuleList, make: Callable[[int], Callable]) -> Iterator[None]:
    """Every layer's ``forward`` replaced on the instance by ``make(i)``, restored after."""
    for i, layer in enumerate(layers):
        layer.forward = make(i)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def _dedupe(new: Any, old: Any) -> Any:
    """``new`` with every tensor equal to its counterpart in ``old`` replaced by that one, so
    that batches of one shape share one causal mask and one rotary table."""
    if isinstance(new, torch.Tensor):
        same = (
            isinstance(old, torch.Tensor)
            and old.shape == new.shape
            and old.dtype == new.dtype
            and old.device == new.device
            and torch.equal(old, new)
        )
        return old if same else new
    if isinstance(new, (tuple, list)) and isinstance(old, type(new)) and len(old) == len(new):
        return type(new)(_dedupe(a, b) for a, b in zip(new, old, strict=True))
    if isinstance(new, dict) and isinstance(old, dict) and old.keys() == new.keys():
        return {k: _dedupe(v, old[k]) for k, v in new.items()}
    return new


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


def capture_layer_inputs(
    model: nn.Module,
    layers: nn.ModuleList,
    batches: Sequence[torch.Tensor],
    device: torch.device,
    *,
    what: str,
    keep: Callable[[torch.Tensor, None], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[list[tuple[tuple, dict]]]]:
    """Layer 0's input and each layer's other arguments, per batch, from the model's own
    forward: each decoder layer's ``forward`` replaced by a recorder, the last one stopping the
    forward there (see the module doc). Batches of one shape share their arguments
    (:func:`_dedupe`). ``keep(x, None)``: how a layer-0 input is held (as it is by default);
    ``what``: the setting a forward that skips a layer is reported under. Used by the layer at
    a time runner and by the algorithms that run layer by layer (gptq, awq)."""
    n = len(layers)
    seen: dict[int, tuple[tuple, dict]] = {}

    def recorder(i: int) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            seen[i] = (args, kwargs)
            if i == n - 1:
                raise _Stop
            return args[0]

        return forward

    hidden: list[torch.Tensor] = []
    calls: list[list[tuple[tuple, dict]]] = []
    prev: Any = None
    with _patched(layers, recorder), torch.no_grad():
        for b in batches:
            seen.clear()
            try:
                model(input_ids=b.to(device), use_cache=False)
            except _Stop:
                pass
            if len(seen) != n:
                raise CalibrationError(
                    f"{what}: the model's forward called {len(seen)} of its {n} decoder layers"
                )
            per_layer = _dedupe([(seen[i][0][1:], seen[i][1]) for i in range(n)], prev)
            prev = per_layer
            calls.append(per_layer)
            x = seen[0][0][0]
            hidden.append(x if keep is None else keep(x, None))
    seen.clear()
    return hidden, calls


class LayerwiseRunner:
    """Steps 2-3 of :func:`qckpt.calib.calibrate.calibrate_model` one decoder layer at a time.

    ``weights`` supplies the weights (``qckpt.load.layer_weights``); ``activations`` says
    where the layer outputs wait between layers: ``device``, or ``host`` (pinned under CUDA).
    """

    def __init__(
        self, weights: LayerWeights, *, device: torch.device, activations: str = "device"
    ) -> None:
        if activations not in ("device", "host"):
            raise CalibrationError(f"calibrate.activations: device or host, got {activations!r}")
        self.weights = weights
        self.device = torch.device(device)
        self.on_host = activations == "host" and self.device.type != "cpu"
        self._lock = threading.Lock()
        self._live = 0
        self._stats: dict[str, Any] = {
            "layers": 0,
            "activation_bytes": 0,
            "layer_args_bytes": 0,
            "outer_weight_bytes": 0,
            "layer_weight_bytes_max": 0,
            "layer_weight_bytes_peak": 0,
            "prefetch_wait_seconds": 0.0,
            "layers_seconds": 0.0,
        }

    def run(
        self,
        model: nn.Module,
        batches: Sequence[torch.Tensor],
        progress: Callable[[int], Any] | None = None,
    ) -> int:
        """Weight and activation amaxes of every quantizer of ``model``; tokens seen."""
        layers_name, layers = decoder_layers(model)
        inside = layers_name + "."
        instr = instrumentation(model)
        tail = any(
            q.enabled and q.kind != "weight" and not q.name.startswith(inside)
            for q in instr.quantizers.values()
        )
        outer = _outer_modules(model, layers_name, head=tail)
        self._stats["outer_weight_bytes"] = self.weights.fetch(outer)
        try:
            calibrate_weights(model, within=lambda name: not name.startswith(inside))
            hidden, calls = self._capture(model, layers, batches)
            self._layers(model, layers_name, layers, hidden, calls, progress)
            if tail:
                self._tail(model, layers, batches, hidden)
        finally:
            self.weights.release(outer)
        return sum(int(b.numel()) for b in batches)

    def report(self) -> dict[str, Any]:
        """What it held: activation and weight bytes, where, and what the weights cost."""
        where = "host (pinned)" if self.on_host else str(self.device)
        out = {"mode": self.weights.mode, "activations_on": where, **self._stats}
        out["prefetch_wait_seconds"] = round(out["prefetch_wait_seconds"], 4)
        out["layers_seconds"] = round(out["layers_seconds"], 4)
        return {**out, **self.weights.report()}

    # -- capture: the layers' inputs and arguments, from the model's own forward --------------

    def _capture(
        self, model: nn.Module, layers: nn.ModuleList, batches: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[list[tuple[tuple, dict]]]]:
        hidden, calls = capture_layer_inputs(
            model, layers, batches, self.device, what="calibrate.offload", keep=self._keep
        )
        self._stats["layers"] = len(layers)
        self._stats["activation_bytes"] = sum(h.numel() * h.element_size() for h in hidden)
        args = {t.data_ptr(): t for t in _tensors(calls) if t.device.type != "meta"}
        self._stats["layer_args_bytes"] = sum(t.numel() * t.element_size() for t in args.values())
        return hidden, calls

    def _keep(self, x: torch.Tensor, slot: torch.Tensor | None) -> torch.Tensor:
        """A layer output kept for the next layer: as is on the device, or in pinned memory."""
        if not self.on_host:
            return x
        if slot is None or slot.shape != x.shape or slot.dtype != x.dtype:
            slot = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        slot.copy_(x)
        return slot

    # -- the layers, with the next one's weights fetched meanwhile -----------------------------

    def _fetch(self, name: str, layer: nn.Module) -> int:
        if self.device.type == "cuda":
            # a thread starts on CUDA device 0: anything the read allocates without naming a
            # device must land on this rank's
            torch.cuda.set_device(self.device)
        n = self.weights.fetch([(name, layer)])
        with self._lock:
            self._live += n
            s = self._stats
            s["layer_weight_bytes_max"] = max(s["layer_weight_bytes_max"], n)
            s["layer_weight_bytes_peak"] = max(s["layer_weight_bytes_peak"], self._live)
        return n

    def _release(self, name: str, layer: nn.Module, n: int) -> None:
        self.weights.release([(name, layer)])
        with self._lock:
            self._live -= n

    def walk(self, layers_name: str, layers: nn.ModuleList, body: Callable[[int], Any]) -> None:
        """``body(i)`` for each decoder layer in order, with that layer's weights on the device.
        The next layer's read runs in a thread meanwhile, and a layer goes back to meta only
        after that read has ended, so the two are live together on every step (the bound
        ``qckpt plan`` predicts), not only on the steps whose read was quicker than the body.
        Used by the max pass (:meth:`run`) and by GPTQ's pass with ``calibrate.offload``."""
        t0 = time.perf_counter()
        names = [f"{layers_name}.{i}" for i in range(len(layers))]
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qckpt-layer-prefetch")
        held: dict[int, int] = {}  # layers whose weights are fetched and not released yet

        def take(j: int, fetch: Future) -> None:
            t = time.perf_counter()
            try:
                held[j] = fetch.result()
            finally:
                self._stats["prefetch_wait_seconds"] += time.perf_counter() - t

        try:
            take(0, pool.submit(self._fetch, names[0], layers[0]))
            for i, layer in enumerate(layers):
                nxt = None
                if i + 1 < len(layers):
                    nxt = pool.submit(self._fetch, names[i + 1], layers[i + 1])
                try:
                    body(i)
                finally:
                    if nxt is not None:
                        take(i + 1, nxt)
                self._release(names[i], layer, held.pop(i))
        finally:
            pool.shutdown(wait=True)  # a failure above: let the read finish, then free it
            for j, n in list(held.items()):
                with contextlib.suppress(Exception):
                    self._release(names[j], layers[j], n)
        self._stats["layers_seconds"] += time.perf_counter() - t0

    def outer(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """The weights outside the decoder layers (not the output embedding) on the device
        inside the block: what capturing the layers' inputs needs."""
        layers_name, _ = decoder_layers(model)
        return self._holding(_outer_modules(model, layers_name, head=False))

    @contextlib.contextmanager
    def _holding(self, modules: Modules) -> Iterator[None]:
        self.weights.fetch(modules)
        try:
            yield
        finally:
            self.weights.release(modules)

    def keep(self, x: torch.Tensor, slot: torch.Tensor | None) -> torch.Tensor:
        """A layer output kept for the next layer (see ``calibrate.activations``)."""
        return self._keep(x, slot)

    def _layers(self, model, layers_name, layers, hidden, calls, progress) -> None:
        names = [f"{layers_name}.{i}" for i in range(len(layers))]
        self.walk(
            layers_name,
            layers,
            lambda i: self._run_layer(model, names[i], layers[i], i, hidden, calls, progress),
        )

    def _run_layer(self, model, name, layer, i, hidden, calls, progress) -> None:
        inside = name + "."
        calibrate_weights(model, within=lambda q: q.startswith(inside))
        with torch.no_grad():
            for b in range(len(hidden)):
                args, kwargs = calls[b][i]
                out = layer(hidden[b].to(self.device), *args, **kwargs)
                if isinstance(out, tuple):  # older transformers return (hidden, ...)
                    out = out[0]
                hidden[b] = self._keep(out, hidden[b] if self.on_host else None)
                if progress is not None:
                    progress(1)

    # -- after the layers: quantizers on the final norm's output (lm_head) ---------------------

    def _tail(self, model, layers, batches, hidden) -> None:
        last = len(layers) - 1
        cur: dict[str, torch.Tensor] = {}

        def replay(i: int) -> Callable:
            def forward(*args: Any, **kwargs: Any) -> Any:
                return cur["h"] if i == last else args[0]

            return forward

        with _patched(layers, replay), torch.no_grad():
            for b, ids in enumerate(batches):
                cur["h"] = hidden[b].to(self.device)
                model(input_ids=ids.to(self.device), use_cache=False)
        cur.clear()
