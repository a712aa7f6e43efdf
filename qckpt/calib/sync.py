"""The amax sync protocol: the one function every caller uses to agree on amax over a group.

Why a protocol and not ``all_reduce(amax, MAX)`` per quantizer: under data and expert parallelism
some ranks never calibrate some quantizers (an expert their batches never route to). A rank that
skips the collective for a quantizer it lacks mismatches the others and NCCL hangs forever; a rank
that silently keeps its own value exports a wrong scale. So every enabled quantizer joins every
sync of its group, presence travels with the values, and every decision that can fail is taken
from data that all ranks share, so all ranks take it together.

A sync is two collectives per group however many quantizers there are:

1. ``header`` (int64, MAX): a local-error flag (the failing rank + 1), a hash of the enabled
   quantizers' names and the value-buffer size, each with its negation so that MAX also yields
   the minimum (equal on every rank, or the ranks disagree on the layout).
   It is fixed-size, so it is safe even when ranks disagree on the layout, and it lets every rank
   raise before the variable-size collective if any rank failed locally or the layouts differ.
2. one float32 MAX over ``[values | presence | lacks]``: every amax flattened (a rank without it
   contributes zero, neutral because an amax is a max of absolute values); per quantizer
   ``K - dtype code`` or 0 when absent (MAX says whether anyone has it and the preferred dtype
   among those who do); per static quantizer 1 where a rank that should hold it lacks it.

Every decision that can fail is taken from the reduced buffer, so all ranks take it together. A
static (per-channel/per-block) amax that some ranks have and others lack costs one more small SUM,
on every rank, only to count the ranks for the error message.

Where the work happens: a sync moves ~10^4 numbers, so what it costs on GPUs is not bandwidth
but per-operation overhead: each torch op costs Python and dispatch time, each copy a runtime
call, and each wait for the GPU a stream synchronization. So packing, checks and decisions run
on the host, in numpy over whole banks, and the GPU sees a handful of copies. Under NCCL a sync
waits for the GPU three times, each for a copy whose data the host needs: the local values
(every bank's and every static amax's, one copy each, one wait), the reduced header, the reduced
buffer. Everything else is queued without waiting: the buffers go out from pinned host memory,
and the results go into the banks and static amaxes from the reduced buffer on the GPU. Under
gloo, or with no group, the buffers are plain host arrays and nothing touches CUDA unless the
amaxes themselves live on a GPU.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from qckpt.calib.quantizer import DTYPE_CODE, DTYPES, AmaxBank, TensorQuantizer
from qckpt.errors import SyncError
from qckpt.parallel.deadline import Deadline, deadline_of
from qckpt.parallel.mesh import group_device
from qckpt.phases import SYNC, timed

# presence travels as K - (dtype code): 1..K for the dtypes in DTYPES, 0 for absent
K = len(DTYPES)
COLLECTIVES_PER_SYNC = 2  # + 1 only on the way to raising for a static amax some ranks lack
_MAX_NAMED = 6  # how many quantizers an error message names before "and N more"

_Index = slice | np.ndarray  # positions as a slice when contiguous (views, not gathers)
_TORCH_DTYPE = {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64}


@dataclass
class SyncResult:
    """What one sync did, for the amax report and the tests."""

    what: str
    world: int
    quantizers: int = 0
    calibrated: int = 0
    uncalibrated: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    collectives: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMED])
    return shown + (f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else "")


@dataclass(eq=False)
class _BankPart:
    """The per-tensor quantizers of one sync that live in one bank."""

    bank: AmaxBank
    slots: _Index  # their slots in the bank
    pos: _Index  # their positions in the plan's order (= in the value buffer)
    span: slice  # the bank's slots from the first to the last of them: what travels
    rel: _Index  # ``slots`` relative to ``span``


@dataclass(eq=False)
class _ScalarGroups:
    """Sharing groups whose members are all per-tensor, flattened so one pass decides them all."""

    idx: np.ndarray  # the members, group after group (positions in the plan's order)
    starts: np.ndarray  # where each group begins in ``idx``
    sizes: np.ndarray
    gid: np.ndarray  # each member's group


@dataclass(eq=False)
class _Plan:
    """The buffer layout of one list of quantizers; the same on every rank for the same model."""

    order: list[TensorQuantizer]  # enabled quantizers, per-tensor ones first
    keys: list[str]  # theirs, for the report
    ns: int  # how many per-tensor ones (one float each, at the start of the value buffer)
    offsets: list[int]  # start of each quantizer's values in the value buffer (+ the end)
    offsets_np: np.ndarray  # the same, to map a value's position to its quantizer
    sizes: list[int]  # values per static quantizer
    layout_hash: int
    # routed-expert inputs that share their layer's value: all-per-tensor groups in one piece,
    # the others (per-block inputs) group by group; ``share_rank`` is each quantizer's group's
    # index among all groups (-1: none), to report the shared ones in group order
    share_scalar: _ScalarGroups | None
    share_other: list[list[int]]
    share_rank: np.ndarray
    strict: list[tuple[str, np.ndarray]]  # experts module -> routed-expert inputs not sharing
    expected: np.ndarray  # bool, per static quantizer: this rank holds its tensor
    # per static quantizer: a routed-expert input that shares its layer's value. Under DP/EP such
    # an input is routinely seen by only some ranks; its MAX with zeros from the others is still
    # exact, and sharing is the completeness rule for it, so "only some ranks" is no error
    static_shared: np.ndarray
    banks: list[_BankPart]


# Building a plan walks every quantizer a few times; a sync repeated on the same list (TP after DP,
# a benchmark) reuses it. The routing attributes (granularity, share_group, expert_layer, local)
# are fixed when a quantizer is made; whatever changes the layout (``enabled``, a reshaped static
# amax) bumps its AmaxStore's version, and the plan is cached by the first quantizer's store
# together with the versions of every store it covers.
def _plan(quantizers: Iterable[TensorQuantizer]) -> _Plan:
    qs = quantizers if isinstance(quantizers, list) else list(quantizers)
    owner = qs[0].store if qs else None
    cached = owner.cached_plan(qs) if owner is not None else None
    if cached is not None:
        return cached
    plan = _build_plan(qs)
    if owner is not None:
        owner.keep_plan(qs, {id(q.store): q.store for q in qs}.values(), plan)
    return plan


def _build_plan(qs: list[TensorQuantizer]) -> _Plan:
    enabled = [q.enabled for q in qs]
    on = [q for q, e in zip(qs, enabled, strict=True) if e]
    scal = [q for q in on if q.is_scalar]
    rest = [q for q in on if not q.is_scalar]
    order = scal + rest
    ns = len(scal)
    sizes = [max(1, math.prod(q.amax_shape)) for q in rest]
    offsets = list(range(ns + 1))
    for size in sizes:
        offsets.append(offsets[-1] + size)
    groups: dict[str, list[int]] = {}
    strict: dict[str, list[int]] = {}
    for i, q in enumerate(order):
        if q.share_group is not None:
            groups.setdefault(q.share_group, []).append(i)
        elif q.expert_layer is not None and q.kind == "input":
            strict.setdefault(q.expert_layer, []).append(i)
    share_rank = np.full(len(order), -1, dtype=np.int64)
    for g, idx in enumerate(groups.values()):
        share_rank[idx] = g
    scalar_groups = [idx for idx in groups.values() if idx[-1] < ns]
    keys = [q.key for q in order]
    sig = "\n".join(keys).encode()
    # 62 bits, so that its negation fits in int64 too (MAX of -h gives the minimum)
    h = ((zlib.crc32(sig) << 30) ^ zlib.adler32(sig) ^ len(order)) & ((1 << 62) - 1)
    return _Plan(
        order=order,
        keys=keys,
        ns=ns,
        offsets=offsets,
        offsets_np=np.array(offsets, dtype=np.int64),
        sizes=sizes,
        layout_hash=h,
        share_scalar=_scalar_groups(scalar_groups) if scalar_groups else None,
        share_other=[idx for idx in groups.values() if idx[-1] >= ns],
        share_rank=share_rank,
        strict=[(layer, np.array(idx, dtype=np.int64)) for layer, idx in strict.items()],
        expected=np.array([q.local for q in rest], dtype=bool),
        static_shared=np.array([q.share_group is not None for q in rest], dtype=bool),
        banks=_bank_parts(scal),
    )


def _bank_parts(scal: list[TensorQuantizer]) -> list[_BankPart]:
    by_bank: dict[int, tuple[AmaxBank, list[int], list[int]]] = {}
    for i, q in enumerate(scal):
        entry = by_bank.setdefault(id(q.bank), (q.bank, [], []))
        entry[1].append(q.slot)
        entry[2].append(i)
    parts = []
    for bank, slots, pos in by_bank.values():
        lo, hi = min(slots), max(slots) + 1
        rel = _index([s - lo for s in slots])
        parts.append(_BankPart(bank, _index(slots), _index(pos), slice(lo, hi), rel))
    return parts


def _index(items: list[int]) -> _Index:
    if items and items == list(range(items[0], items[0] + len(items))):
        return slice(items[0], items[0] + len(items))
    return np.array(items, dtype=np.int64)


def _scalar_groups(groups: list[list[int]]) -> _ScalarGroups:
    sizes = np.array([len(idx) for idx in groups], dtype=np.int64)
    return _ScalarGroups(
        idx=np.concatenate([np.array(idx, dtype=np.int64) for idx in groups]),
        starts=np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64),
        sizes=sizes,
        gid=np.repeat(np.arange(len(groups), dtype=np.int64), sizes),
    )


def _run(group, tensors_ops: list[tuple[torch.Tensor, dist.ReduceOp]], what: str) -> None:
    """All-reduce in place, all issued before any is waited on; failures become SyncError.

    Under the mesh's deadline (:mod:`qckpt.parallel.deadline`): after an earlier collective of
    the command failed (a forward's, with a peer gone), this raises at once instead of waiting
    another full timeout for the same dead peer.
    """

    def reduce_all() -> None:
        works = [dist.all_reduce(t, op=op, group=group, async_op=True) for t, op in tensors_ops]
        for w in works:
            w.wait()

    dl = deadline_of(group) or Deadline(None)  # a group made outside a mesh: no shared deadline
    dl.run(f"amax sync over the {what} group", reduce_all, error=SyncError)


def _host_buffer(numel: int, dtype: np.dtype, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """Uninitialized host memory for a wire buffer: the tensor, and an array viewing it.

    Pinned when the wire is a GPU, so that the copies to it need not wait (cheap after the first
    sync: the caching host allocator keeps the blocks); plain memory otherwise, where pinning
    would need CUDA.
    """
    if pin:
        t = torch.empty(numel, dtype=_TORCH_DTYPE[dtype], pin_memory=True)
        return t, t.numpy()
    a = np.empty(numel, dtype=dtype)
    return torch.from_numpy(a), a


class _Fetch:
    """Brings tensors to the host: every copy queued first, then one wait per device."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.devices: set[torch.device] = set()

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor | None, np.ndarray]:
        """``t``'s values as an array (valid once :meth:`wait` has returned) and the host copy
        holding them; no copy (None) when ``t`` is on the host: the array views ``t`` itself."""
        t = t.detach()  # an amax set by hand may require grad; numpy refuses those
        if t.device.type == "cpu":
            return None, t.numpy()
        if self.pin:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            self.devices.add(t.device)
        else:
            h = t.cpu()
        return h, h.numpy()

    def wait(self) -> None:
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()


@timed(SYNC)
def sync_amax(
    quantizers: Iterable[TensorQuantizer],
    group: dist.ProcessGroup | None,
    *,
    what: str = "data",
    local_error: str | None = None,
) -> SyncResult:
    """Agree on every enabled quantizer's amax over ``group``, or raise on every rank.

    Semantics (``../shared/DESIGN.md``, "Amax sync"):

    * Disabled quantizers are left alone and join nothing (the same set on every rank).
    * ``tensor`` and ``dynamic_block`` amax: MAX over the ranks that have it; nobody has it: it
      stays ``None`` everywhere; a calibrated zero stays zero.
    * ``channel`` and ``block`` (static) amax: nobody: skipped; every expected rank: MAX; only
      some: :class:`SyncError` on every rank naming the quantizer and how many ranks lacked it
      (except routed-expert inputs that share their layer's value: for them MAX, as per-tensor).
      (Expected: the ranks whose quantizer is ``local``; under EP a remote expert's is not.)
    * Routed-expert inputs with a ``share_group`` that nobody calibrated take the max over their
      layer's experts (over all ranks) and are marked ``shared_from_layer``. Routed-expert inputs
      without one that nobody calibrated: "MoE calibration incomplete" on every rank.
    * Values travel as float32; a rank keeps its own amax dtype; a rank that had none adopts the
      group's. The buffers live on ``group_device(group)``; results on each quantizer's device.
    * ``local_error``: this rank failed before the sync (e.g. a forward raised); every rank raises.
    * ``group=None`` (a world of one): no collectives, the same rules applied locally.

    Four phases: :func:`_pack` (local values into the wire buffer), :func:`_exchange` (the
    collectives), :func:`_decide` (from reduced data only), :func:`_write_back`.
    """
    t0 = time.perf_counter()
    plan = _plan(quantizers)
    world = 1 if group is None else dist.get_world_size(group)
    res = SyncResult(what=what, world=world, quantizers=len(plan.order))
    dev = group_device(group)
    packed = _pack(plan, dev.type == "cuda", local_error)
    wire = _exchange(plan, packed, group, what, dev, res)
    final, assigned, shared = _decide(plan, packed, group, what, dev, res)
    _write_back(plan, packed, wire, final, assigned, shared)
    keys = plan.keys
    res.shared = [keys[i] for i in shared.tolist()]
    unassigned = np.flatnonzero(~assigned).tolist()
    res.uncalibrated = [keys[i] for i in unassigned]
    res.calibrated = len(plan.order) - len(unassigned)
    res.seconds = time.perf_counter() - t0
    return res


@dataclass(eq=False)
class _Packed:
    """This rank's side of one sync, packed: one float32 host buffer, reduced with MAX:
    ``[amax values | K - dtype code per quantizer (0: absent) | "lacks it" per static one]``."""

    pin: bool  # the wire is a GPU: host buffers are pinned, copies queued
    buf: torch.Tensor  # the host buffer
    hb: np.ndarray  # a view of it
    codes: np.ndarray  # per quantizer: dtype code, -1 absent here
    have_local: np.ndarray  # codes >= 0
    lacks: np.ndarray  # per static quantizer: this rank should hold it and does not
    bank_vals: list  # per bank part: (host copy or None, array of its values)
    local_error: str | None

    @property
    def total(self) -> int:
        return len(self.hb) - len(self.codes) - len(self.lacks)


def _pack(plan: _Plan, pin: bool, local_error: str | None) -> _Packed:
    """Local values to the host (one copy per bank, one for all static amaxes), packed; no
    communication yet. Presence travels in the same buffer as the values."""
    order, ns, offsets = plan.order, plan.ns, plan.offsets
    n, total = len(order), offsets[-1]
    fetch = _Fetch(pin)
    bank_vals = [
        (None, p.bank.values.numpy()[p.span])
        if p.bank.values.device.type == "cpu"
        else fetch(p.bank.values[p.span])
        for p in plan.banks
    ]
    rest = [q.amax for q in order[ns:]]  # a static amax is the stored tensor itself, no copy
    here = [j for j, a in enumerate(rest) if a is not None]
    flat = _static_flat([rest[j] for j in here], fetch)
    fetch.wait()
    buf, hb = _host_buffer(total + n + (n - ns), np.dtype(np.float32), pin)
    vals = hb[:total]
    codes = np.full(n, -1, dtype=np.int64)
    for p, (_, bv) in zip(plan.banks, bank_vals, strict=True):
        # a bank's absent slots may hold stale numbers: select, never trust them
        present = np.frombuffer(p.bank.present, dtype=np.uint8)[p.slots] != 0
        bank_codes = np.frombuffer(p.bank.codes, dtype=np.uint8)[p.slots].astype(np.int64)
        codes[p.pos] = np.where(present, bank_codes, -1)
        vals[p.pos] = np.where(present, bv[p.rel], 0.0)
    _place_static(plan, vals, here, flat)
    if here:
        codes[ns:][here] = [DTYPE_CODE.get(rest[j].dtype, -2) for j in here]
    if local_error is None:
        local_error = _local_fault(plan, codes, vals)
    have_local = codes >= 0
    # K - code: 0 for "not here"; under MAX, > 0 means "somebody has it", and the largest is the
    # most preferred dtype among those who have it (DTYPES is in order of preference)
    hb[total : total + n] = np.where(have_local, K - codes, 0)
    lacks = plan.expected & ~have_local[ns:]
    hb[total + n :] = lacks
    return _Packed(pin, buf, hb, codes, have_local, lacks, bank_vals, local_error)


def _static_flat(present: list[torch.Tensor], fetch: _Fetch) -> np.ndarray | None:
    """The present static amaxes, flattened, as float32 on the host (valid after the wait)."""
    if not present:
        return None
    parts = [a.reshape(-1) for a in present]
    parts = [p if p.dtype == torch.float32 else p.to(torch.float32) for p in parts]
    if len({p.device for p in parts}) == 1:
        return fetch(torch.cat(parts) if len(parts) > 1 else parts[0])[1]
    return torch.cat([p.cpu() for p in parts]).numpy()  # several devices: no faster path


def _place_static(plan: _Plan, vals: np.ndarray, here: list[int], flat) -> None:
    ns, offsets = plan.ns, plan.offsets
    nr = len(plan.order) - ns
    if flat is not None and len(here) == nr:  # the usual case (weights): all in one piece
        vals[offsets[ns] :] = flat
    elif nr:
        vals[offsets[ns] :] = 0.0
        at = 0
        for j in here:
            size = plan.sizes[j]
            vals[offsets[ns + j] : offsets[ns + j + 1]] = flat[at : at + size]
            at += size


def _local_fault(plan: _Plan, codes: np.ndarray, vals: np.ndarray) -> str | None:
    """What makes this rank's values unfit to send, found before any collective."""
    if len(plan.order) > plan.ns and bool((codes[plan.ns :] == -2).any()):
        return "an amax dtype the sync cannot carry (float32/16, bfloat16 or float64 only)"
    if len(vals) and not bool(np.isfinite(vals).all()):
        at = np.flatnonzero(~np.isfinite(vals))
        bad = np.unique(np.searchsorted(plan.offsets_np, at, side="right") - 1)
        return f"non-finite amax in {_names([plan.order[i].key for i in bad.tolist()])}"
    return None


def _exchange(
    plan: _Plan, packed: _Packed, group, what: str, dev: torch.device, res: SyncResult
) -> torch.Tensor:
    """The header (any rank failed? same layout?) and then the buffer, each a MAX; afterwards
    the host buffer holds the reduced values. Returns the buffer on the wire's device."""
    buf, wire, pin, local_error = packed.buf, packed.buf, packed.pin, packed.local_error
    if group is None:
        if local_error is not None:
            raise SyncError(f"calibration failed: {local_error}")
        return wire
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    h, total = plan.layout_hash, packed.total
    header, hh = _host_buffer(5, np.dtype(np.int64), pin)
    hh[:] = (rank + 1 if local_error is not None else 0, h, -h, total, -total)
    wire_header = header
    if pin:  # both queued now; the buffer's copy overlaps the header's round trip
        wire_header = header.to(dev, non_blocking=True)
        wire = buf.to(dev, non_blocking=True)
    _run(group, [(wire_header, dist.ReduceOp.MAX)], what)
    res.collectives += 1
    if pin:
        header.copy_(wire_header)
    err, hmax, hmin_neg, tmax, tmin_neg = hh.tolist()
    if err:
        if local_error is not None:
            raise SyncError(f"amax sync over the {what} group: this rank failed: {local_error}")
        raise SyncError(
            f"amax sync over the {what} group: rank {err - 1} of {world} failed before the "
            "sync (see its log); giving up on every rank"
        )
    if hmax != -hmin_neg or tmax != -tmin_neg:
        raise SyncError(
            f"amax sync over the {what} group: ranks disagree on the quantizers to sync "
            "(different models or recipes on different ranks)"
        )
    _run(group, [(wire, dist.ReduceOp.MAX)], what)
    res.collectives += 1
    if pin:
        buf.copy_(wire)
    res.bytes = header.numel() * 8 + buf.numel() * 4
    return wire


def _decide(
    plan: _Plan, packed: _Packed, group, what: str, dev: torch.device, res: SyncResult
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Who gets which value, identical on every rank because it reads only reduced data:
    (dtype code per quantizer, assigned mask, the shared ones in group order)."""
    order, ns, n = plan.order, plan.ns, len(plan.order)
    total, hb = packed.total, packed.hb
    best = hb[total : total + n].astype(np.int64)
    have = best > 0
    if n > ns:
        some = np.flatnonzero(have[ns:] & (hb[total + n :] > 0) & ~plan.static_shared).tolist()
        if some:
            _raise_static_partial(plan, packed, some, group, what, dev, res)
    parts_msg = []
    for layer, idx in plan.strict:
        cold_idx = idx[~have[idx]].tolist()
        cold = sorted({order[i].expert for i in cold_idx} - {None})
        if cold:
            parts_msg.append(f"{layer}: experts {', '.join(map(str, cold))}")
    if parts_msg:
        raise SyncError(
            "MoE calibration incomplete: routed experts received no tokens on any rank of "
            f"the {what} group: {'; '.join(parts_msg)} (more calibration data, or let them share "
            "the layer's input amax: calibrate.share_expert_inputs: true)"
        )
    # the dtype a rank without the amax adopts: the first in DTYPES among the ranks that have it
    final = np.where(packed.have_local, packed.codes, np.minimum(K - best, K - 1))
    assigned = have.copy()
    shared = _share(plan, have, hb[:total], final, assigned)
    return final, assigned, shared


def _raise_static_partial(plan, packed, some, group, what, dev, res) -> None:
    """A static amax some ranks hold and others lack: every rank is here (the condition reads
    reduced data only); one more SUM counts who lacked what, for the message."""
    order, ns = plan.order, plan.ns
    counts = torch.from_numpy(np.stack([packed.lacks, plan.expected])[:, some].astype(np.int32))
    if group is not None:
        counts = counts.to(dev)
        _run(group, [(counts, dist.ReduceOp.SUM)], what)
        res.collectives += 1
    lacked, expected = counts.cpu().tolist()
    items = [
        f"{order[ns + j].key} ({order[ns + j].granularity}: "
        f"{lacked[k]} of {expected[k]} ranks lacked it)"
        for k, j in enumerate(some)
    ]
    raise SyncError(
        f"amax sync over the {what} group: static amax calibrated on only some ranks: "
        f"{_names(items)}; every rank must calibrate a per-channel/per-block quantizer, "
        "or none"
    )


def _write_back(
    plan: _Plan,
    packed: _Packed,
    wire: torch.Tensor,
    final: np.ndarray,
    assigned: np.ndarray,
    shared: np.ndarray,
) -> None:
    """The decisions into the banks (flags on the host, values by one queued copy each) and
    into the stores' static amaxes (views of this sync's own buffer, nobody else writes it)."""
    ns, offsets, total = plan.ns, plan.offsets, packed.total
    buf, vals = packed.buf, packed.hb[:total]
    shared_mask = np.zeros(len(plan.order), dtype=bool)
    shared_mask[shared] = True
    if wire is not buf and shared.size:
        # shared values were set on the host: the device buffer feeds the banks and static amaxes
        wire[:total].copy_(buf[:total], non_blocking=True)
    for p, (host, bv) in zip(plan.banks, packed.bank_vals, strict=True):
        bank = p.bank
        np.frombuffer(bank.present, dtype=np.uint8)[p.slots] = assigned[p.pos]
        np.frombuffer(bank.codes, dtype=np.uint8)[p.slots] = np.maximum(final[p.pos], 0)
        np.frombuffer(bank.shared, dtype=np.uint8)[p.slots] = shared_mask[p.pos]
        target = bank.values
        if host is not None and target.device == wire.device and isinstance(p.slots, slice):
            target[p.slots].copy_(wire[p.pos])  # device to device, queued
        else:  # into the bank (on the host) or its host copy, which then goes back in one copy
            bv[p.rel] = vals[p.pos]
            if host is not None:
                target[p.span].copy_(host, non_blocking=packed.pin)
    if len(plan.order) == ns:
        return
    final_l, assigned_l = final[ns:].tolist(), assigned[ns:].tolist()
    shared_l = shared_mask[ns:].tolist()
    chunks = torch.split(wire[offsets[ns] : total], plan.sizes)
    for j, (q, v) in enumerate(zip(plan.order[ns:], chunks, strict=True)):
        if assigned_l[j]:
            value = v.view(q.amax_shape).to(device=q.device, dtype=DTYPES[final_l[j]])
            q.store.set_static(q.static_ix, value, shared_l[j])


def _share(
    plan: _Plan, have: np.ndarray, vals: np.ndarray, final: np.ndarray, assigned: np.ndarray
) -> np.ndarray:
    """Give sharing inputs that nobody calibrated their layer's value; returns who got it.

    A group takes part when some but not all of its members were calibrated (on any rank): its
    cold members get the elementwise max of its hot ones and the dtype of its first hot one.
    """
    shared: list[np.ndarray] = []
    g = plan.share_scalar
    if g is not None:
        hot = have[g.idx]
        n_hot = np.add.reduceat(hot, g.starts, dtype=np.int64)
        mixed = (n_hot > 0) & (n_hot < g.sizes)
        if mixed.any():
            layer_max = np.maximum.reduceat(np.where(hot, vals[g.idx], -np.inf), g.starts)
            first_hot = np.flatnonzero(hot)
            # per group, the first hot member (meaningful for the mixed groups only)
            first_hot = first_hot[np.minimum(np.searchsorted(first_hot, g.starts), hot.sum() - 1)]
            cold = ~hot & mixed[g.gid]
            to, gid = g.idx[cold], g.gid[cold]
            vals[to] = layer_max[gid]
            final[to] = final[g.idx[first_hot[gid]]]
            assigned[to] = True
            shared.append(to)
    if plan.share_other:
        shared += _share_one_by_one(plan, have, torch.from_numpy(vals), final, assigned)
    if not shared:
        return np.zeros(0, dtype=np.int64)
    out = np.concatenate(shared)
    if len(shared) > 1:  # in the order of the groups, as they first appear in the plan
        out = out[np.lexsort((out, plan.share_rank[out]))]
    return out


def _share_one_by_one(
    plan: _Plan, have: np.ndarray, values: torch.Tensor, final: np.ndarray, assigned: np.ndarray
) -> list[np.ndarray]:
    """The groups with per-channel/per-block members: few, so one by one, in torch as they always
    were (a group of mismatched shapes fails with the same error)."""
    offsets, shared = plan.offsets, []
    for idx in plan.share_other:
        hot = [i for i in idx if have[i]]
        if not hot or len(hot) == len(idx):
            continue
        layer_val = _layer_max(values, offsets, hot, plan.ns)
        cold = [i for i in idx if not have[i]]
        for i in cold:
            values[offsets[i] : offsets[i + 1]] = layer_val.reshape(-1)
            final[i] = final[hot[0]]
            assigned[i] = True
        shared.append(np.array(cold, dtype=np.int64))
    return shared


def _layer_max(values: torch.Tensor, offsets: list[int], hot: list[int], ns: int) -> torch.Tensor:
    """Elementwise max over the reduced amaxes of the layer's experts that some rank calibrated."""
    if all(i < ns for i in hot):
        return values[torch.tensor(hot, dtype=torch.int64)].max()
    return torch.stack([values[offsets[i] : offsets[i + 1]] for i in hot]).amax(dim=0)
