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
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from qckpt.calib import quantizer as _quantizer
from qckpt.calib.quantizer import DTYPE_CODE, DTYPES, AmaxBank, TensorQuantizer
from qckpt.errors import SyncError
from qckpt.parallel.mesh import group_device

# presence travels as K - (dtype code): 1..K for the dtypes in DTYPES, 0 for absent
K = len(DTYPES)
COLLECTIVES_PER_SYNC = 2  # + 1 only on the way to raising for a static amax some ranks lack
_MAX_NAMED = 6  # how many quantizers an error message names before "and N more"


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


def _numel(shape: tuple[int, ...]) -> int:
    m = 1
    for s in shape:
        m *= s
    return m


@dataclass(eq=False)
class _Plan:
    """The buffer layout of one list of quantizers; the same on every rank for the same model."""

    order: list[TensorQuantizer]  # enabled quantizers, per-tensor ones first
    ns: int  # how many per-tensor ones (one float each, at the start of the value buffer)
    offsets: list[int]  # start of each quantizer's values in the value buffer (+ the end)
    layout_hash: int
    share_groups: list[list[int]]  # routed-expert inputs that share their layer's value
    strict: dict[str, list[int]]  # experts module -> routed-expert inputs that do not share
    expected: torch.Tensor  # int32, per static quantizer: 1 if this rank holds its tensor
    # per static quantizer: a routed-expert input that shares its layer's value. Under DP/EP such
    # an input is routinely seen by only some ranks; its MAX with zeros from the others is still
    # exact, and sharing is the completeness rule for it, so "only some ranks" is no error
    static_shared: torch.Tensor
    # per-tensor quantizers by bank: (bank, slots in the bank, positions in ``order``), each a
    # slice when contiguous (the usual case: views and copies instead of gathers and scatters)
    banks: list[tuple[AmaxBank, torch.Tensor | slice, torch.Tensor | slice]]


# Building a plan walks every quantizer a few times; a sync repeated on the same list (TP after DP,
# a benchmark) reuses it. The routing attributes (granularity, share_group, expert_layer, local)
# are fixed when a quantizer is made; changing ``enabled`` anywhere bumps CONFIG_VERSION.
_LAST: list = [None]


def _plan(quantizers: Iterable[TensorQuantizer]) -> _Plan:
    qs = quantizers if isinstance(quantizers, list) else list(quantizers)
    key = tuple(qs)
    version = _quantizer.CONFIG_VERSION[0]
    last = _LAST[0]
    if last is not None and last[1] == version and last[0] == key:
        return last[2]
    enabled = [q.enabled for q in qs]
    on = [q for q, e in zip(qs, enabled, strict=True) if e]
    scal = [q for q in on if q.is_scalar]
    rest = [q for q in on if not q.is_scalar]
    order = scal + rest
    offsets = list(range(len(scal) + 1))
    for q in rest:
        offsets.append(offsets[-1] + max(1, _numel(q.amax_shape)))
    groups: dict[str, list[int]] = {}
    strict: dict[str, list[int]] = {}
    for i, q in enumerate(order):
        if q.share_group is not None:
            groups.setdefault(q.share_group, []).append(i)
        elif q.expert_layer is not None and q.kind == "input":
            strict.setdefault(q.expert_layer, []).append(i)
    sig = "\n".join([q.key for q in order]).encode()
    # 62 bits, so that its negation fits in int64 too (MAX of -h gives the minimum)
    h = ((zlib.crc32(sig) << 30) ^ zlib.adler32(sig) ^ len(order)) & ((1 << 62) - 1)
    by_bank: dict[int, tuple[AmaxBank, list[int], list[int]]] = {}
    for i, q in enumerate(scal):
        entry = by_bank.setdefault(id(q._bank), (q._bank, [], []))
        entry[1].append(q._slot)
        entry[2].append(i)
    banks = [(b, _index(sl), _index(pos)) for b, sl, pos in by_bank.values()]
    plan = _Plan(
        order=order,
        ns=len(scal),
        offsets=offsets,
        layout_hash=h,
        share_groups=list(groups.values()),
        strict=strict,
        expected=torch.tensor([1 if q.local else 0 for q in rest], dtype=torch.int32),
        static_shared=torch.tensor([q.share_group is not None for q in rest], dtype=torch.bool),
        banks=banks,
    )
    _LAST[0] = (key, version, plan)
    return plan


def _index(items: list[int]) -> torch.Tensor | slice:
    if items and items == list(range(items[0], items[0] + len(items))):
        return slice(items[0], items[0] + len(items))
    return torch.tensor(items, dtype=torch.int64)


def _on(idx: torch.Tensor | slice, device: torch.device) -> torch.Tensor | slice:
    return idx if isinstance(idx, slice) else idx.to(device)


def _run(group, tensors_ops: list[tuple[torch.Tensor, dist.ReduceOp]], what: str) -> None:
    """All-reduce in place, all issued before any is waited on; failures become SyncError."""
    try:
        works = [dist.all_reduce(t, op=op, group=group, async_op=True) for t, op in tensors_ops]
        for w in works:
            w.wait()
    except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError subclasses
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SyncError(
            f"amax sync over the {what} group failed: a rank died or timed out ({first})"
        ) from None


def _idx(items: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(items, dtype=torch.int64, device=device)


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
    """
    t0 = time.perf_counter()
    plan = _plan(quantizers)
    order, ns, offsets = plan.order, plan.ns, plan.offsets
    n, total = len(order), plan.offsets[-1]
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    res = SyncResult(what=what, world=world, quantizers=n)
    dev = group_device(group)

    # -- local packing (no communication yet) ---------------------------------------------------
    # one float32 buffer, reduced with MAX: [amax values | presence+dtype per quantizer | "lacks
    # it" per static quantizer]. Presence travels in the same collective as the values.
    buf = torch.zeros(total + n + (n - ns), dtype=torch.float32, device=dev)
    values = buf[:total]
    codes_t = torch.full((n,), -1, dtype=torch.int64)
    for bank, slots, pos in plan.banks:
        # a bank's absent slots may hold stale numbers: select, never trust them
        present = bank.view("present")[slots].bool()
        codes_t[pos] = torch.where(present, bank.view("codes")[slots].to(torch.int64), -1)
        vals = bank.values[_on(slots, bank.device)].to(device=dev)
        values[_on(pos, dev)] = torch.where(present.to(dev), vals, 0.0)
    if n > ns:
        rest = [q.__dict__["_amax"] for q in order[ns:]]
        here = [j for j, a in enumerate(rest) if a is not None]
        if len(here) == n - ns:  # the usual case (weights): one copy for all of them
            flat = torch.cat([a.reshape(-1).to(dev, torch.float32) for a in rest])
            values[offsets[ns] :] = flat
        else:
            for j in here:
                i = ns + j
                values[offsets[i] : offsets[i + 1]] = rest[j].reshape(-1).to(dev, torch.float32)
        if here:
            codes_t[ns:][here] = torch.tensor([DTYPE_CODE.get(rest[j].dtype, -2) for j in here])
    if local_error is None and bool((codes_t == -2).any()):
        local_error = "an amax dtype the sync cannot carry (float32/16, bfloat16 or float64 only)"
    if local_error is None and total and not bool(torch.isfinite(values).all()):
        bad = []
        for i, q in enumerate(order):
            if not bool(torch.isfinite(values[offsets[i] : offsets[i + 1]]).all()):
                bad.append(q.key)
        local_error = f"non-finite amax in {_names(bad)}"
    have_local = codes_t >= 0
    # K - code: 0 for "not here"; under MAX, > 0 means "somebody has it", and the largest is the
    # most preferred dtype among those who have it (DTYPES is in order of preference)
    tail = torch.where(have_local, K - codes_t, 0).to(torch.float32)
    lacks = (plan.expected > 0) & ~have_local[ns:]  # static: this rank should have it but does not
    buf[total:] = torch.cat([tail, lacks.to(torch.float32)]).to(dev)

    # -- collectives ----------------------------------------------------------------------------
    if group is not None:
        h = plan.layout_hash
        err = rank + 1 if local_error is not None else 0
        header = torch.tensor([err, h, -h, total, -total], dtype=torch.int64, device=dev)
        _run(group, [(header, dist.ReduceOp.MAX)], what)
        res.collectives += 1
        err, hmax, hmin_neg, tmax, tmin_neg = header.tolist()
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
        _run(group, [(buf, dist.ReduceOp.MAX)], what)
        res.collectives += 1
        res.bytes = header.numel() * 8 + buf.numel() * 4
    elif local_error is not None:
        raise SyncError(f"calibration failed: {local_error}")

    # -- decisions, identical on every rank because they read only reduced data -----------------
    tail_r = buf[total:].cpu()
    best = tail_r[:n].to(torch.int64)
    have = best > 0
    if n > ns:
        some = have[ns:] & (tail_r[n:] > 0) & ~plan.static_shared
        some = torch.nonzero(some).squeeze(1).tolist()
        if some:
            # every rank is here (the condition reads reduced data only): count who lacked what
            counts = torch.stack([lacks, plan.expected > 0]).to(torch.int32)[:, some]
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
    have_l = have.tolist()
    if plan.strict:
        parts = []
        for layer, idx in plan.strict.items():
            cold = sorted({order[i].expert for i in idx if have_l[i] == 0} - {None})
            if cold:
                parts.append(f"{layer}: experts {', '.join(map(str, cold))}")
        if parts:
            raise SyncError(
                "MoE calibration incomplete: routed experts received no tokens on any rank of "
                f"the {what} group: {'; '.join(parts)} (more calibration data, or let them share "
                "the layer's input amax: calibrate.share_expert_inputs: true)"
            )

    # the dtype a rank without the amax adopts: the first in DTYPES among the ranks that have it
    final = torch.where(have_local, codes_t, (K - best).clamp(max=K - 1))
    assigned = have.clone()
    shared: list[int] = []
    for idx in plan.share_groups:
        hot = [i for i in idx if have_l[i] > 0]
        if not hot or len(hot) == len(idx):
            continue
        layer_val = _layer_max(values, offsets, hot, ns)
        for i in idx:
            if have_l[i] == 0:
                values[offsets[i] : offsets[i + 1]] = layer_val.reshape(-1)
                final[i] = final[hot[0]]
                assigned[i] = True
                shared.append(i)
    shared_mask = torch.zeros(n, dtype=torch.bool)
    shared_mask[shared] = True
    shared_set = set(shared)

    # -- write back -------------------------------------------------------------------------------
    for bank, slots, pos in plan.banks:
        bank.values[_on(slots, bank.device)] = values[_on(pos, dev)].to(bank.device)
        bank.view("present")[slots] = assigned[pos].to(torch.uint8)
        bank.view("codes")[slots] = final[pos].clamp(min=0).to(torch.uint8)
        bank.view("shared")[slots] = shared_mask[pos].to(torch.uint8)
    if n > ns:
        final_l = final[ns:].tolist()
        assigned_l = assigned[ns:].tolist()
        # one split into views of this sync's own buffer (nobody else writes it, so no copies)
        chunks = torch.split(
            values[offsets[ns] :], [offsets[i + 1] - offsets[i] for i in range(ns, n)]
        )
        for j, (q, v) in enumerate(zip(order[ns:], chunks, strict=True)):
            if assigned_l[j]:
                d = q.__dict__
                d["_amax"] = v.view(q.amax_shape).to(device=q.device, dtype=DTYPES[final_l[j]])
                d["_shared"] = (ns + j) in shared_set
    res.shared = [order[i].key for i in shared]
    unassigned = torch.nonzero(~assigned).squeeze(1).tolist()
    res.uncalibrated = [order[i].key for i in unassigned]
    res.calibrated = n - len(unassigned)
    res.seconds = time.perf_counter() - t0
    return res


def _layer_max(values: torch.Tensor, offsets: list[int], hot: list[int], ns: int) -> torch.Tensor:
    """Elementwise max over the reduced amaxes of the layer's experts that some rank calibrated."""
    if all(i < ns for i in hot):
        return values[_idx(hot, values.device)].max()
    return torch.stack([values[offsets[i] : offsets[i + 1]] for i in hot]).amax(dim=0)
