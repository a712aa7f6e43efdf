"""The streaming-dequant DCP load planner.

DCP's readers call, for every read item, ``planner.resolve_tensor(item)`` (where to copy the
item's data), copy into it, then ``planner.commit_tensor(item, tensor)``. The default planner
returns a narrowed view of the destination. A quantized destination (a ``QuantizedTensor``) cannot
be narrowed and written piece by piece without dequantizing it, and quantizing piece by piece
recomputes the scale per piece (per-tensor scaling: silently wrong weights). So here:

* each quantized destination gets ONE full-shape high-precision scratch (its nominal dtype, e.g.
  BF16) the first time one of its items is resolved; every item narrows into it;
* at its last item (counted from the final plan in ``finish_plan``) the scratch is quantized into
  the destination once, from the whole value, and dropped;
* ``finish_plan`` reorders the plan so the items of one destination are adjacent; a reader that
  follows the plan order (``OrderedFileSystemReader``, ``HFSafetensorsReader``) then holds one
  scratch at a time: transient = one destination in its nominal dtype, 2 * max(numel) bytes for
  BF16. DCP's stock ``FileSystemReader`` groups items per file, so a destination whose chunks lie
  in k files keeps its scratch across the files in between: with it the bound is the sum over
  destinations spanning a file boundary (2 * sum(numel) in the worst case, a fully sharded save);
* plain destinations take ``DefaultLoadPlanner``'s path untouched (bit-exact);
* quantizer state (the amax history of delayed scaling) is left bit-identical: quantize with
  ``update_state=False`` and restore a ``quant_state()`` snapshot as well;
* with ``main_params=True`` the full-shape buffer is an FP32 master copy that is kept: it receives
  the checkpoint values exactly (FP32 holds BF16/FP16/FP32 exactly) and the destination is
  quantized from its nominal-dtype rounding, the same value a BF16 scratch would hold;
* checkpoints whose tensors carry extra leading singleton axes plan against the checkpoint's
  shape (a zero-byte placeholder) and the scratch is unwrapped with ``view`` at the end;
* ``shards`` places local blocks (EP-sharded fused experts) inside the checkpoint's global
  tensor, so a DP x EP layout reads only its rows;
* destinations are reached through ``destination_of``: native ``QuantizedTensor`` or, through
  ``qckpt.formats.te``, Transformer Engine's quantized tensors;
* ``whole_amax(fqn, target, src)`` (``shard_scales.WholeScales``, sharded loads) is called in
  ``_finish`` before the quantize and may return the whole tensor's amax, reduced over the
  ranks that hold the tensor's blocks: a collective inside the read loop.

Order invariant (sharded loads rely on it): ``_finish`` runs once per quantized destination, in
plan order, and plan order is the state dict's order grouped by destination (``finish_plan``),
the same on every rank. A reader may fetch items in parallel, but it must call
``commit_tensor`` in plan order on one thread, so that the collectives in ``_finish`` meet in
the same order on every rank of a group.

Host side (CPU loads): DCP's reader ``torch.load``s each stored chunk before copying it into the
scratch, so the host holds chunk + scratch (up to 2 x 2 * max(numel)) for a moment; on CUDA the
chunk stays on the host and the device transient is the scratch alone.

The fast reader (``fast_read``) calls ``resolve_tensor`` / ``resolve_run`` ahead of the commits
for up to ``max_inflight`` quantized destinations (``streams(fqn)`` says which fqns are those),
so their scratches fill while the previous one is quantized; it reads the bytes of the next
ones into host staging buffers before their scratch exists (``run_layout(fqn)``: the buffer's
shape, dtype and device, nothing allocated). Every planner call still happens on the calling
thread, scratches are resolved in plan order, and ``commit_tensor`` (hence ``_finish``)
strictly in plan order, the same on every rank: ``_finish`` may run collectives.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from qckpt.errors import CheckpointError, FormatError
from qckpt.formats.numerics import defer_finite_checks, first_not_finite
from qckpt.load.destination import destination_of, prepended_axes, unwrap_prepended
from qckpt.load.meter import MemoryMeter
from qckpt.read.read_items import local_load_items


@dataclass
class _Dest:
    """A quantized destination being filled (lives from its first item to its last)."""

    target: Any  # the destination protocol object (QuantizedTensor or TE adapter)
    ckpt_shape: torch.Size  # shape the read items address (with prepended axes, if any)
    prepended: int
    expected: int = 0
    done: int = 0
    buf: torch.Tensor | None = None  # full-shape scratch (nominal dtype) or FP32 master
    buf_bytes: int = 0


def _region(buf: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """``buf[o0:o0+n0, o1:o1+n1, ...]`` as one strided view (DCP's ``transform_tensor`` narrows
    axis by axis: three ops per item, and a fused expert tensor has thousands of items)."""
    if len(offsets) != buf.dim():
        for axis, (o, n) in enumerate(zip(offsets, lengths, strict=False)):
            buf = buf.narrow(axis, o, n)
        return buf
    strides = buf.stride()
    start = buf.storage_offset() + sum(o * st for o, st in zip(offsets, strides, strict=True))
    return buf.as_strided(tuple(lengths), strides, start)


class StreamingDequantLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that streams quantized destinations through one scratch at a time.

    ``main_params=True`` keeps an FP32 master copy of every quantized destination, filled with
    the checkpoint's values (take them with ``take_main_params()``). ``meter`` records memory;
    ``progress(n)`` is called once per finished tensor; ``tap(fqn, value)`` sees each quantized
    destination's whole value (this rank's block) just before it is quantized; ``whole_amax``:
    see the module doc.
    """

    def __init__(
        self,
        *,
        main_params: bool = False,
        meter: MemoryMeter | None = None,
        progress: Callable[[int], Any] | None = None,
        allow_partial_load: bool = False,
        shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        tap: Callable[[str, torch.Tensor], Any] | None = None,
        whole_amax: Callable[[str, Any, torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        # tap(fqn, value): sees each quantized destination's whole value (nominal dtype, the
        # checkpoint's own numbers) before it is quantized, e.g. to take weight amaxes from it
        self.tap = tap
        # sharded loads: the whole tensor's amax for a block's scale (see the order invariant)
        self.whole_amax = whole_amax
        # local shards of plain tensors (EP-sharded experts): fqn -> (global shape, offsets of
        # this rank's block); DCP plans them as one chunk of the checkpoint's global tensor
        self.shards = dict(shards or {})
        self.keep_main_params = bool(main_params)
        self.meter = meter
        self.progress = progress
        self._dests: dict[str, _Dest] = {}
        self._main: dict[str, torch.Tensor] = {}
        self._plain_expected: dict[str, int] = {}
        self._user_sd: dict[str, Any] = {}
        # each quantized destination's NaN/Inf checks, made once after its last item
        # (_check_finite): one host sync per load, not one per destination
        self._unchecked: list[tuple[str, tuple[torch.Tensor, str]]] = []
        self.stats: dict[str, int] = {"items": 0, "quantized": 0, "plain": 0}

    # ---- planning ------------------------------------------------------------------------

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.reset()
        self._user_sd = state_dict
        subst: dict[str, Any] = {}
        md_all = metadata.state_dict_metadata if metadata is not None else {}
        for fqn, value in state_dict.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor):
                continue
            md = md_all.get(fqn)
            k = 0
            if isinstance(md, TensorStorageMetadata):
                k = prepended_axes(md.size, local.shape, fqn)
            dest = destination_of(local)
            if dest is not None:
                if isinstance(value, DTensor):
                    raise CheckpointError(
                        f"{fqn}: a DTensor of quantized shards is not a supported destination"
                    )
                ckpt_shape = torch.Size(md.size) if k else torch.Size(local.shape)
                self._dests[fqn] = _Dest(target=dest, ckpt_shape=ckpt_shape, prepended=k)
                if k:
                    # DCP plans against the checkpoint's shape; a zero-byte placeholder of that
                    # shape stands in (the data goes to our scratch, never to it)
                    subst[fqn] = torch.empty((), dtype=local.dtype, device=local.device).expand(
                        ckpt_shape
                    )
            elif k and not isinstance(value, DTensor):
                # plain tensors stay on the default path, through a view with the extra axes
                subst[fqn] = local.view(md.size)
        sd = {**state_dict, **subst} if subst else state_dict
        super().set_up_planner(sd, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        md_all = self.metadata.state_dict_metadata if self.metadata is not None else {}
        shards = {k: v for k, v in self.shards.items() if k in self.state_dict}
        for fqn, obj in self.state_dict.items():
            md = md_all.get(fqn)
            if md is None:
                if not self.allow_partial_load:
                    raise CheckpointError(f"{fqn}: missing from the checkpoint")
                continue
            size = getattr(obj, "size", None)
            if isinstance(md, TensorStorageMetadata) and size is not None:
                want = tuple(shards[fqn][0]) if fqn in shards else tuple(obj.size())
                if tuple(md.size) != want:
                    raise CheckpointError(
                        f"{fqn}: shape {tuple(md.size)} in the checkpoint, {want} in the model"
                    )
        if not shards:
            if self.metadata is None or set(md_all) - set(self.state_dict):
                # DCP's planner looks for a pre-2.4 checkpoint's names then: its own path
                return super().create_local_plan()
            return LoadPlan(
                local_load_items(self.state_dict, self.metadata, not self.allow_partial_load)
            )
        full = self.state_dict
        # DCP's own helper on the other entries (super() would see the shards as keys missing
        # from the state dict and fall back to the full dict)
        rest = {k: v for k, v in full.items() if k not in shards}
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, (_, offsets) in shards.items():
            local = ChunkStorageMetadata(
                offsets=torch.Size(offsets), sizes=torch.Size(full[fqn].size())
            )
            # dest offsets come out relative to the local block, which is what we hold
            items += create_read_items_for_chunk_list(fqn, md_all[fqn], [local])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.shards:
            # a plain local block: DCP's lookup would look for a shard at that offset
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """Group each destination's items together and count them (for the last-item quantize).

        Destinations keep the order of their first item, which follows the state dict (the
        model's parameter order, the same on every rank): the order invariant of the module
        doc."""
        groups: dict[str, list[ReadItem]] = {}
        for item in new_plan.items:
            groups.setdefault(item.dest_index.fqn, []).append(item)
        items: list[ReadItem] = []
        for fqn, its in groups.items():
            items.extend(its)
            covered = sum(math.prod(i.lengths) for i in its)
            d = self._dests.get(fqn)
            if d is not None:
                d.expected = len(its)
                need = math.prod(d.ckpt_shape)
                if covered != need:
                    raise CheckpointError(
                        f"{fqn}: the checkpoint covers {covered} of its {need} elements"
                    )
            else:
                self._plain_expected[fqn] = len(its)
        for fqn, d in self._dests.items():
            if d.expected == 0 and math.prod(d.ckpt_shape) > 0 and not self.allow_partial_load:
                raise CheckpointError(f"{fqn}: no data for it in the checkpoint")
        new_plan.items[:] = items
        return new_plan

    # ---- reading -------------------------------------------------------------------------

    def streams(self, fqn: str) -> bool:
        """Whether ``fqn`` goes through a scratch (a quantized destination not yet finished):
        the fast reader bounds how many of those are live at once."""
        return fqn in self._dests

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        d = self._dests.get(fqn)
        if d is None:
            return super().resolve_tensor(read_item)
        return _region(self._scratch(d), read_item.dest_offsets, read_item.lengths)

    def _scratch(self, d: _Dest) -> torch.Tensor:
        """``d``'s full-shape buffer, allocated at its first item."""
        if d.buf is None:
            if self.meter is not None:
                self.meter.open_window()
            d.buf = torch.empty(d.ckpt_shape, dtype=self._scratch_dtype(d), device=d.target.device)
            if self.keep_main_params:
                if self.meter is not None:
                    self.meter.add_output(d.buf.numel() * 4)
            else:
                d.buf_bytes = d.buf.numel() * d.buf.element_size()
                if self.meter is not None:
                    self.meter.add_scratch(d.buf_bytes)
            if self.meter is not None:
                self.meter.sample(fresh=True)  # the level while the scratch is live
        return d.buf

    def _scratch_dtype(self, d: _Dest) -> torch.dtype:
        """The dtype of ``d``'s full-shape buffer: float32 when the main params are kept."""
        return torch.float32 if self.keep_main_params else d.target.dtype

    # ---- runs of items (the fast reader): one call for many items of one destination ----------

    def resolve_run(self, fqn: str) -> torch.Tensor | None:
        """The whole contiguous buffer that ``fqn``'s items fill, addressed by the items'
        ``dest_offsets``: a quantized destination's scratch (allocated now if it is not yet), or
        a plain destination's own tensor when it is a contiguous plain tensor (None otherwise:
        a DTensor or another subclass takes ``resolve_tensor`` item by item). The fast reader
        writes a run of items' bytes straight into it and then calls ``commit_run``: the same as
        ``resolve_tensor`` + ``commit_tensor`` per item, in plan order, on the calling thread."""
        d = self._dests.get(fqn)
        if d is not None:
            return self._scratch(d)
        t = self.state_dict.get(fqn)
        # exactly what DCP's resolve_tensor narrows for these items (lookup_tensor of a plain
        # tensor, or of a local block of self.shards, is the tensor itself)
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta or not t.is_contiguous():
            return None
        return t.detach()

    def run_layout(self, fqn: str) -> tuple[torch.Size, torch.dtype, torch.device] | None:
        """(shape, dtype, device) of the contiguous buffer ``resolve_run(fqn)`` will return,
        nothing allocated (None for a plain destination): the fast reader plans a destination's
        reads, and reads its bytes into host staging buffers, before admitting it."""
        d = self._dests.get(fqn)
        if d is None:
            return None
        return d.ckpt_shape, self._scratch_dtype(d), torch.device(d.target.device)

    def commit_run(self, items: Sequence[ReadItem]) -> None:
        """``commit_tensor`` of consecutive plan items of one destination whose data
        ``resolve_run``'s buffer holds (a quantized one's last item: ``_finish``)."""
        if not items:
            return
        fqn = items[0].dest_index.fqn
        d = self._dests.get(fqn)
        if d is None:
            self._commit_plain(fqn, len(items))
            return
        self.stats["items"] += len(items)
        d.done += len(items)
        if d.done >= d.expected:
            self._finish(fqn, d)
        if self.meter is not None:
            self.meter.sample()

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        d = self._dests.get(fqn)
        if d is None:
            super().commit_tensor(read_item, tensor)
            self._commit_plain(fqn, 1)
            return
        self.stats["items"] += 1
        d.done += 1
        if d.done >= d.expected:
            self._finish(fqn, d)
        if self.meter is not None:
            self.meter.sample()

    def _commit_plain(self, fqn: str, n: int) -> None:
        """``n`` items of the plain destination ``fqn`` are in place (DCP's own commit of a
        plain item does nothing): count them, and the tensor once its last item is in."""
        self.stats["items"] += n
        left = self._plain_expected.get(fqn, 1) - n
        self._plain_expected[fqn] = left
        if left <= 0:
            self._plain_expected.pop(fqn, None)
            self.stats["plain"] += 1
            if self.progress is not None:
                self.progress(1)
        if self.meter is not None:
            self.meter.sample()
        self._maybe_release()

    def _finish(self, fqn: str, d: _Dest) -> None:
        assert d.buf is not None
        full = unwrap_prepended(d.buf, d.prepended, fqn)
        meter = self.meter
        if self.keep_main_params:
            self._main[fqn] = full
            # the destination is quantized from the nominal-dtype rounding of the exact FP32
            # value: the same number a BF16 scratch would have held, so stream == bulk
            src = full.to(d.target.dtype)
            d.buf_bytes = src.numel() * src.element_size()
            if meter is not None:
                meter.add_scratch(d.buf_bytes)
                meter.sample(fresh=True)
        else:
            src = full
        if self.tap is not None:
            self.tap(fqn, src)
        state = d.target.quant_state()
        # a collective under a sharded load: every rank of the group reaches it in plan order
        amax = self.whole_amax(fqn, d.target, src) if self.whole_amax is not None else None
        try:
            with defer_finite_checks() as checks:
                if amax is None:
                    d.target.quantize_(src, update_state=False)
                else:
                    d.target.quantize_(src, update_state=False, amax=amax)
        except FormatError as exc:  # NaN/Inf in the checkpoint: name the tensor
            raise CheckpointError(f"{fqn}: cannot quantize the checkpoint's value: {exc}") from None
        self._unchecked.extend((fqn, c) for c in checks)
        # belt and braces for formats whose quantize_ touches state anyway
        d.target.load_quant_state(state)
        if not self.keep_main_params:
            # DCP's reader still holds a view of this scratch in its loop variable while it
            # resolves the next item; without this, two scratches are alive at that moment
            # (twice the bound). Freeing the storage makes the old view empty, not dangling.
            d.buf.untyped_storage().resize_(0)
        del src, full
        d.buf = None
        if meter is not None:
            meter.sub_scratch(d.buf_bytes)
            meter.close_window()
        del self._dests[fqn]
        self.stats["quantized"] += 1
        if self.progress is not None:
            self.progress(1)
        self._maybe_release()

    def _maybe_release(self) -> None:
        # the last item of the plan: nothing the load needed may outlive it
        if not self._dests and not self._plain_expected:
            self._check_finite()
            self._release()

    def _check_finite(self) -> None:
        """Refuse a checkpoint value with NaN/Inf, naming the first such tensor (in plan
        order): the quantized destinations' checks, deferred to the end of the load."""
        pending, self._unchecked = self._unchecked, []
        bad = first_not_finite([c for _, c in pending])
        if bad is not None:
            i, msg = bad
            raise CheckpointError(f"{pending[i][0]}: cannot quantize the checkpoint's value: {msg}")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        # we may plan on a copy of the caller's dict (placeholders); write the value through
        if fqn in self._user_sd and fqn in self.state_dict:
            self._user_sd[fqn] = self.state_dict[fqn]

    # ---- state ---------------------------------------------------------------------------

    def _release(self) -> None:
        """Forget every reference the load needed (called after the last item, and on reset)."""
        self._unchecked = []
        self._dests = {}
        self._plain_expected = {}
        self._user_sd = {}

    def reset(self) -> None:
        """Drop scratch and per-item state (after a failed load, or before a new one)."""
        self._release()
        self._main = {}

    def pending(self) -> dict[str, int]:
        """What the planner still holds: destinations, scratch buffers and their bytes."""
        bufs = [d.buf for d in self._dests.values() if d.buf is not None]
        return {
            "destinations": len(self._dests),
            "plain_items": len(self._plain_expected),
            "scratch_buffers": len(bufs),
            "scratch_bytes": sum(b.numel() * b.element_size() for b in bufs),
        }

    def take_main_params(self) -> dict[str, torch.Tensor]:
        """The FP32 master copies (``main_params=True``), handed over and forgotten."""
        out, self._main = self._main, {}
        return out
