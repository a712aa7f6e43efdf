"""The amax sync protocol: the one function every caller uses to agree on amax over a group.

Why a protocol and not ``all_reduce(amax, MAX)`` per quantizer: under data and expert parallelism
some ranks never calibrate some quantizers (an expert their batches never route to). A rank that
skips the collective for a quantizer it lacks mismatches the others and NCCL hangs forever; a rank
that silently keeps its own value exports a wrong scale. So every enabled quantizer joins every
sync of its group, presence travels with the values, and every decision that can fail is taken
from data that all ranks share, so all ranks take it together.

A sync is three collectives per group however many quantizers there are:

1. ``header`` (int64, MAX): a local-error flag (the failing rank + 1) and a hash of the layout
   (names, granularities, amax shapes), with its negation so that MAX also yields the minimum.
   It is fixed-size, so it is safe even when ranks disagree on the layout, and it lets every rank
   raise before the variable-size collectives if any rank failed locally or the layouts differ.
2. ``flags`` (int32, SUM): per quantizer, how many ranks hold its amax in each calibrator dtype
   (float32/bfloat16/float16/float64), and how many ranks were expected to hold it (``local``).
3. ``values`` (float32, MAX): every amax flattened into one buffer; a rank without an amax
   contributes zero, which is neutral because an amax is a max of absolute values.

2 and 3 are issued together (async) since neither depends on the other; the decisions that need
the flags (raise for a static per-channel amax only some ranks have, raise for an incomplete MoE
layer in strict mode) are taken afterwards, identically on every rank.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from qckpt.calib.quantizer import TensorQuantizer
from qckpt.errors import SyncError
from qckpt.parallel.mesh import group_device

# calibrator dtypes the flags can carry, in order of preference when ranks that have the amax
# used different dtypes and a rank that has none must adopt one
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}
K = len(DTYPES)
COLLECTIVES_PER_SYNC = 3
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


def _layout_hash(order: list[TensorQuantizer]) -> int:
    sig = "\n".join([q.key for q in order]).encode()
    # 62 bits so that the negation also fits in int64
    return ((zlib.crc32(sig) << 30) ^ zlib.adler32(sig) ^ len(order)) & ((1 << 62) - 1)


def _run(group, tensors_ops: list[tuple[torch.Tensor, dist.ReduceOp]], what: str) -> None:
    """All-reduce in place, all issued before any is waited on; failures become SyncError."""
    try:
        works = [dist.all_reduce(t, op=op, group=group, async_op=True) for t, op in tensors_ops]
        for w in works:
            w.wait()
    except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError subclasses
        raise SyncError(
            f"amax sync over the {what} group failed: a rank died or timed out ({exc})".splitlines()[
                0
            ]
        ) from None


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
      some: :class:`SyncError` on every rank naming the quantizer and how many ranks lacked it.
    * Routed-expert inputs with a ``share_group`` that nobody calibrated take the max over their
      layer's experts (over all ranks) and are marked ``shared_from_layer``. Routed-expert inputs
      without one that nobody calibrated: "MoE calibration incomplete" on every rank.
    * Values travel as float32; a rank keeps its own amax dtype; a rank that had none adopts the
      group's. The buffers live on ``group_device(group)``; results on each quantizer's device.
    * ``local_error``: this rank failed before the sync (e.g. a forward raised); every rank raises.
    * ``group=None`` (a world of one): no collectives, the same rules applied locally.
    """
    t0 = time.perf_counter()
    order = [q for q in quantizers if q.enabled]
    # scalars first so that they form one contiguous region that is unpacked in one call
    order = [q for q in order if q.is_scalar] + [q for q in order if not q.is_scalar]
    ns = sum(1 for q in order if q.is_scalar)
    n = len(order)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    res = SyncResult(what=what, world=world, quantizers=n)
    dev = group_device(group)

    amaxes = [q._amax for q in order]
    present = [i for i, a in enumerate(amaxes) if a is not None]
    numels = [1] * ns + [max(1, _numel(q.amax_shape)) for q in order[ns:]]
    offsets = [0] * (n + 1)
    for i, m in enumerate(numels):
        offsets[i + 1] = offsets[i] + m
    total = offsets[n]

    # -- local packing (no communication yet) ---------------------------------------------------
    values = torch.zeros(total, dtype=torch.float32, device=dev)
    codes = torch.full((n,), -1, dtype=torch.int64)
    if present:
        sp = [i for i in present if i < ns]
        if sp:
            stacked = torch.stack([amaxes[i].reshape(()) for i in sp])
            values[torch.tensor(sp, device=dev)] = stacked.to(device=dev, dtype=torch.float32)
            codes[sp] = torch.tensor([_CODE.get(amaxes[i].dtype, -2) for i in sp])
        for i in present:
            if i >= ns:
                a = amaxes[i]
                values[offsets[i] : offsets[i + 1]] = a.reshape(-1).to(dev, torch.float32)
                codes[i] = _CODE.get(a.dtype, -2)
        if local_error is None and not bool(torch.isfinite(values).all()):
            bad = [order[i].key for i in present if not bool(torch.isfinite(amaxes[i]).all())]
            local_error = f"non-finite amax in {_names(bad)}"
    if local_error is None and bool((codes == -2).any()):
        local_error = (
            "an amax has a dtype the sync cannot carry (use float32/16, bfloat16 or float64)"
        )

    flags = torch.zeros(n * K + n, dtype=torch.int32)
    have_local = codes >= 0
    if present:
        idx = torch.nonzero(have_local).squeeze(1)
        flags[idx * K + codes[idx]] = 1
    flags[n * K :] = torch.tensor([1 if q.local else 0 for q in order], dtype=torch.int32)

    # -- collectives ----------------------------------------------------------------------------
    if group is not None:
        h = _layout_hash(order)
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
        flags = flags.to(dev)
        _run(group, [(flags, dist.ReduceOp.SUM), (values, dist.ReduceOp.MAX)], what)
        res.collectives += 2
        res.bytes = header.numel() * 8 + flags.numel() * 4 + values.numel() * 4
    elif local_error is not None:
        raise SyncError(f"calibration failed: {local_error}")

    # -- decisions, identical on every rank because they read only reduced data -----------------
    flags = flags.cpu()
    counts = flags[: n * K].view(n, K)
    have = counts.sum(1)
    expected = flags[n * K :]
    have_l, exp_l = have.tolist(), expected.tolist()

    uneven = [
        f"{order[i].key} ({order[i].granularity}: {exp_l[i] - have_l[i]} of {exp_l[i]} ranks lacked it)"
        for i in range(ns, n)
        if 0 < have_l[i] < exp_l[i]
    ]
    if uneven:
        raise SyncError(
            f"amax sync over the {what} group: static amax calibrated on only some ranks: "
            f"{_names(uneven)}; every rank must calibrate a per-channel/per-block quantizer, "
            "or none"
        )

    # routed-expert layer values: max over the layer's experts of the reduced values
    groups: dict[str, list[int]] = {}
    cold_strict: dict[str, list[int]] = {}
    for i, q in enumerate(order):
        if q.share_group is not None:
            groups.setdefault(q.share_group, []).append(i)
        elif q.expert_layer is not None and q.kind == "input" and have_l[i] == 0:
            cold_strict.setdefault(q.expert_layer, []).append(i)
    if cold_strict:
        parts = []
        for layer, idx in cold_strict.items():
            experts = sorted({order[i].expert for i in idx if order[i].expert is not None})
            parts.append(f"{layer}: experts {', '.join(map(str, experts))}")
        raise SyncError(
            "MoE calibration incomplete: routed experts received no tokens on any rank of the "
            f"{what} group: {'; '.join(parts)} (more calibration data, or let the experts share "
            "the layer's input amax: calibrate.share_expert_inputs: true)"
        )

    # the dtype a rank without the amax adopts: the preferred one among the ranks that have it
    group_code = torch.argmax((counts > 0).to(torch.int8), dim=1)  # first present in DTYPES order
    final_code = torch.where(have_local, codes, group_code).tolist()

    shared_src: dict[int, torch.Tensor] = {}
    for idx in groups.values():
        hot = [i for i in idx if have_l[i] > 0]
        if not hot or len(hot) == len(idx):
            continue
        layer_val = _layer_max(values, order, offsets, hot, ns)
        hot_code = final_code[hot[0]]
        for i in idx:
            if have_l[i] == 0:
                shared_src[i] = layer_val
                if not have_local[i]:
                    final_code[i] = hot_code

    # -- write back -------------------------------------------------------------------------------
    if ns:
        scal = values[:ns]
        for code in set(final_code[:ns]):
            sel = [i for i in range(ns) if final_code[i] == code and have_l[i] > 0]
            if not sel:
                continue
            dev_q = order[sel[0]].device
            vals = scal[torch.tensor(sel, device=dev)].to(device=dev_q, dtype=DTYPES[code])
            for i, v in zip(sel, vals.unbind(0), strict=True):
                q = order[i]
                if q.device != dev_q:
                    v = v.to(q.device)
                d = q.__dict__
                d["_amax"] = v
                d["shared_from_layer"] = False
    for i in range(ns, n):
        if have_l[i] > 0:
            q = order[i]
            v = values[offsets[i] : offsets[i + 1]].reshape(q.amax_shape)
            q.__dict__["_amax"] = v.to(device=q.device, dtype=DTYPES[final_code[i]])
            q.__dict__["shared_from_layer"] = False
    for i, v in shared_src.items():
        q = order[i]
        q.__dict__["_amax"] = v.reshape(q.amax_shape).to(
            device=q.device, dtype=DTYPES[final_code[i]]
        )
        q.__dict__["shared_from_layer"] = True
        res.shared.append(q.key)
    for i in range(n):
        if have_l[i] == 0 and i not in shared_src:
            order[i].__dict__["_amax"] = None
            res.uncalibrated.append(order[i].key)
    res.calibrated = n - len(res.uncalibrated)
    res.seconds = time.perf_counter() - t0
    return res


def _numel(shape: tuple[int, ...]) -> int:
    m = 1
    for s in shape:
        m *= s
    return m


def _layer_max(
    values: torch.Tensor, order: list[TensorQuantizer], offsets: list[int], hot: list[int], ns: int
) -> torch.Tensor:
    """Elementwise max over the reduced amaxes of the layer's experts that some rank calibrated."""
    if all(i < ns for i in hot):
        return values[torch.tensor(hot, device=values.device)].max()
    parts = [values[offsets[i] : offsets[i + 1]] for i in hot]
    return torch.stack(parts).amax(dim=0)
