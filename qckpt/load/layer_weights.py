"""Where layer-by-layer calibration (:mod:`qckpt.calib.layerwise`) gets a layer's weights.

* :class:`CheckpointLayers` (``calibrate.offload: layer``): the weights stay on disk; each fetch
  allocates the modules on the device and fills them through :func:`load_checkpoint` (the same
  readers and streaming planner as a resident load, so the values are the same), reading only
  this rank's experts and TP blocks (their ``ShardSpec``) and never running a collective (the
  read runs on a prefetch thread while the main thread's forward may be in an EP exchange).
* :class:`HostLayers` (``calibrate.offload: host``): every decoder layer is read once into host
  memory (pinned under CUDA), then each fetch copies a layer to the device. On a CPU device the
  host tensors are used as they are.

A fetched module is taken off the device by putting it back on meta (``release``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from qckpt.load.loader import load_checkpoint

Modules = list[tuple[str, nn.Module]]


def _shell(modules: Modules, config: Any) -> nn.Module:
    """A module holding ``modules`` at their names in the model, so that its state-dict names
    are the checkpoint's; ``config`` gives the HF reader the model type (fused experts)."""
    root = nn.Module()
    for name, mod in modules:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        parent.add_module(leaf, mod)
    root.config = config
    return root


def _nbytes(modules: Modules) -> int:
    seen = {}
    for _, mod in modules:
        for t in [*mod.parameters(), *mod.buffers()]:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _to_meta(modules: Modules) -> None:
    for _, mod in modules:
        mod.to_empty(device="meta")


class CheckpointLayers:
    """Weights read from the checkpoint at ``path`` each time they are fetched."""

    mode = "layer"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        format: str,
        device: torch.device,
        config: Any,
        reader: str = "fast",
        max_inflight: int = 2,
    ) -> None:
        self.path, self.format, self.config = path, format, config
        self.kind, self.max_inflight = reader, max_inflight
        self.device = torch.device(device)
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.loads = 0
        self._reader: Any = None  # opened by check(), reused by every fetch

    def check(self, model: nn.Module) -> None:
        """Refuse, from metadata alone, a checkpoint that cannot fill ``model`` (a missing
        tensor, a wrong shape or dtype): before the first layer runs, not at the layer that
        lacks it. The same check a resident load makes."""
        from qckpt.load.preflight import preflight

        pre = preflight(
            model, self.path, self.format, reader=self.kind, max_inflight=self.max_inflight
        )
        # one reader for every layer: an HF dir's index of every tensor is built once, not
        # once per layer (fetches run one at a time, so it is never used by two threads)
        self._reader = pre.reader

    def fetch(self, modules: Modules) -> int:
        from qckpt.models.build import materialize
        from qckpt.parallel.mesh import Mesh

        if not modules:
            return 0
        t0 = time.perf_counter()
        for _, mod in modules:
            materialize(mod, self.device)
        # a mesh of one: the read is this rank's alone (its ShardSpecs say which blocks)
        rep = load_checkpoint(
            _shell(modules, self.config),
            self.path,
            format=self.format,
            stream=True,
            mesh=Mesh(device=self.device),
            reader=self._reader or self.kind,
            max_inflight=self.max_inflight,
        )
        self.bytes_read += rep.bytes_read
        self.read_seconds += time.perf_counter() - t0
        self.loads += 1
        return _nbytes(modules)

    def release(self, modules: Modules) -> None:
        _to_meta(modules)

    def report(self) -> dict[str, Any]:
        return {
            "weights_on": "disk",
            "bytes_read": int(self.bytes_read),
            "read_seconds": round(self.read_seconds, 4),
            "reads": self.loads,
        }


class HostLayers:
    """Decoder layers read once into host memory (:meth:`hold`), copied to the device per fetch;
    anything not held (embeddings, norms, lm_head) is read from the checkpoint."""

    mode = "host"

    def __init__(self, disk: CheckpointLayers) -> None:
        self.disk = disk
        self.device = disk.device
        self.pin = self.device.type == "cuda"
        self.host: dict[str, dict[str, torch.Tensor]] = {}
        self.host_bytes = 0

    def hold(self, modules: Modules) -> None:
        """Read ``modules`` into host memory (one read for all) and put them back on meta."""
        reader = CheckpointLayers(
            self.disk.path, format=self.disk.format, device=torch.device("cpu"),
            config=self.disk.config,
        )  # fmt: skip
        reader._reader = self.disk._reader
        reader.fetch(modules)
        for name, mod in modules:
            state = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
            # pinned memory: the copy to the device runs without a staging buffer
            kept = {
                k: (v.detach().pin_memory() if self.pin else v.detach()) for k, v in state.items()
            }
            self.host[name] = kept
            self.host_bytes += sum(v.numel() * v.element_size() for v in kept.values())
        _to_meta(modules)
        self.disk.bytes_read += reader.bytes_read
        self.disk.read_seconds += reader.read_seconds
        self.disk.loads += reader.loads

    def fetch(self, modules: Modules) -> int:
        held = [(n, m) for n, m in modules if n in self.host]
        self.disk.fetch([(n, m) for n, m in modules if n not in self.host])
        for name, mod in held:
            for key, t in self.host[name].items():
                # same stream as the forward that will use it: ordered without an event
                v = t if t.device == self.device else t.to(self.device, non_blocking=True)
                owner_name, _, leaf = key.rpartition(".")
                owner = mod.get_submodule(owner_name) if owner_name else mod
                if leaf in owner._parameters:
                    owner._parameters[leaf] = nn.Parameter(v, requires_grad=False)
                else:
                    owner._buffers[leaf] = v
        return _nbytes(modules)

    def release(self, modules: Modules) -> None:
        _to_meta(modules)

    def report(self) -> dict[str, Any]:
        return {
            **self.disk.report(),
            "weights_on": "host (pinned)" if self.pin else "host",
            "host_weight_bytes": int(self.host_bytes),
        }
