"""The diagonal of each linear's input Hessian, ``H_jj = sum over tokens of x_j**2``, per input
key, the same bits on one process and under DP x EP: what ``calibrate.mse_weighting: hessian``
weighs the weight errors with and what ``qckpt search``'s proxy sums
(:mod:`qckpt.search.sensitivity`).

Input keys: a dense linear's HF module name; an expert's ``{experts}:{e}:gate_up`` (gate and up
share their input) and ``{experts}:{e}:down``. How the sums are exact:

1. every key's amax is synced over the data group (given by the caller, or measured by
   :func:`measure_amax`: one forward, one float64 MAX);
2. one forward over this rank's batches; each key's rows (an expert's: its routed rows) are put
   on :mod:`qckpt.calib.gptq`'s fixed-point grid of that amax and their squares summed per
   column in float64: integers below 2**52, exact in any order;
3. one float64 SUM over the data group of the sums, each key's row count beside them and a
   failure flag (a rank that does not hold an expert sends zeros), so every rank has every
   diagonal and raises together when one failed.

A key no rank saw a row of (a cold expert) has ``rows == 0`` and a zero diagonal: what to do
with it is the caller's (search: its layer's mean; mse: the plain, unweighted search).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from qckpt.calib import gptq
from qckpt.errors import CalibrationError, SyncError
from qckpt.formats.tensor import dequantized_compute
from qckpt.parallel.deadline import Deadline, deadline_of
from qckpt.parallel.mesh import Mesh, group_device

SIDES = (("gate_up", ("gate", "up")), ("down", ("down",)))


@dataclass
class Diagonals:
    """Every key's summed diagonal (float64 ``[cols]``, squared input units) and rows."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    collectives: int = 0

    def mean(self, key: str) -> torch.Tensor | None:
        """``H_jj`` as the mean of ``x_j**2`` over the key's rows (None: no row anywhere)."""
        n = self.rows.get(key, 0)
        return None if n == 0 else self.sums[key] / n


def expert_key(module: str, e: int, side: str) -> str:
    return f"{module}:{e}:{side}"


def input_keys(instr) -> tuple[list[str], dict[str, int], dict[int, str]]:  # noqa: ANN001
    """(every input key in one order on every rank, its columns, weight quantizer id -> its
    input key); under EP remote experts' keys too."""
    dense = sorted(
        q.name for q in instr.quantizers.values() if q.kind == "weight" and q.expert_layer is None
    )
    cols: dict[str, int] = {}
    key_of: dict[int, str] = {}
    for name in dense:
        wq = instr.quantizers[f"{name}.weight_amax"]
        cols[name] = wq.shape[1]
        key_of[id(wq)] = name
    keys = list(dense)
    for info in instr.experts:
        for e in range(info.num_experts):
            for side, roles in SIDES:
                key = expert_key(info.module_name, e, side)
                keys.append(key)
                for r in roles:
                    wq = info.weight_q[e][r]
                    cols[key] = wq.shape[1]
                    key_of[id(wq)] = key
    return keys, cols, key_of


def tapped_forward(
    model: nn.Module,
    instr,  # noqa: ANN001
    todo: list[torch.Tensor],
    dense: dict[str, Callable[[torch.Tensor], None]],
    experts: Callable[[object, str], Callable | None],
) -> None:
    """One forward over ``todo`` with ``dense[module name](x)`` called on each dense linear's
    input and ``experts(info, side)``'s tap (or None) on each experts module side's routed
    rows; the report's token counts put back after."""
    undo = []
    for name, mod in model.named_modules():
        if name in dense:
            undo.append(mod.register_forward_pre_hook(_pre_hook(dense[name])))
    segs = []
    for info, mod in zip(instr.experts, instr.patched, strict=True):
        obs = getattr(mod.forward, "observer", None)
        if obs is None:
            raise CalibrationError(f"{info.module_name}: an experts module without its observer")
        for side, seg in (("gate_up", obs.gate_up), ("down", obs.down)):
            tap = experts(info, side)
            if tap is not None:
                seg.tap = tap
                segs.append(seg)
    tokens = [list(info.tokens) for info in instr.experts]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad(), dequantized_compute():
            for b in todo:
                model(input_ids=b.to(device), use_cache=False)
    finally:
        for h in undo:
            h.remove()
        for seg in segs:
            seg.tap = None
        for info, t in zip(instr.experts, tokens, strict=True):
            info.tokens[:] = t


def _pre_hook(add: Callable[[torch.Tensor], None]):
    def hook(_mod, args):
        if args:
            add(args[0])

    return hook


def _per_key(model, instr, todo, add: Callable[[str, torch.Tensor], None]) -> None:  # noqa: ANN001
    """:func:`tapped_forward` with ``add(key, rows)`` for every input key's rows."""
    keys, _, _ = input_keys(instr)
    dense = {k: (lambda x, k=k: add(k, x)) for k in keys if ":" not in k}

    def experts(info, side: str):  # noqa: ANN001, ANN202
        def tap(x: torch.Tensor, ids: torch.Tensor) -> None:
            for r in torch.unique(ids).tolist():
                add(expert_key(info.module_name, info.local_ids[r], side), x[ids == r])

        return tap

    tapped_forward(model, instr, todo, dense, experts)


def measure_amax(model, instr, todo, mesh: Mesh, res: Diagonals) -> dict[str, float]:  # noqa: ANN001
    """Step 1 where the caller has no synced amax: every key's ``max |x|`` over this rank's
    rows, MAX over the data group (a key no rank saw: 0)."""
    keys, _, _ = input_keys(instr)
    local: dict[str, float] = {}
    failure: BaseException | None = None

    def add(key: str, x: torch.Tensor) -> None:
        if x.numel():
            a = float(x.detach().abs().amax().float())
            local[key] = max(local.get(key, 0.0), a)

    try:
        _per_key(model, instr, todo, add)
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the exchange
        failure = exc
    flat = torch.tensor([local.get(k, 0.0) for k in keys] + [0.0], dtype=torch.float64)
    flat[-1] = 1.0 if failure is not None else 0.0
    res.collectives += reduce(flat, dist.ReduceOp.MAX, mesh, "the input amaxes for H_jj")
    raise_any(failure, flat[-1], "the Hessian diagonals")
    return dict(zip(keys, flat[:-1].tolist(), strict=True))


def gather(model, instr, todo, mesh: Mesh, amax: dict[str, float]) -> Diagonals:  # noqa: ANN001
    """Steps 2-3 of the module doc, with every key's synced amax ``amax`` (0: no rows)."""
    res = Diagonals()
    keys, cols, _ = input_keys(instr)
    tokens = torch.tensor([sum(int(b.numel()) for b in todo)], dtype=torch.float64)
    res.collectives += reduce(tokens, dist.ReduceOp.SUM, mesh, "the calibration token count")
    bits = gptq.grid_bits(int(tokens.item()))
    grid: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(key: str, x: torch.Tensor) -> None:
        a = amax.get(key, 0.0)
        if not x.numel() or a <= 0:
            return
        xi = gptq.fixed_point(x, a, bits)
        part = (xi * xi).sum(dim=0)  # integers below 2**52: exact in any order
        grid[key] = part if key not in grid else grid[key].add_(part)
        counts[key] = counts.get(key, 0) + xi.shape[0]

    failure: BaseException | None = None
    try:
        _per_key(model, instr, todo, add)
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the exchange
        failure = exc
    flat = torch.zeros(sum(cols[k] + 1 for k in keys) + 1, dtype=torch.float64)
    at = 0
    for k in keys:
        if k in grid:
            flat[at : at + cols[k]] = grid[k].cpu()
            flat[at + cols[k]] = counts.get(k, 0)
        at += cols[k] + 1
    flat[-1] = 1.0 if failure is not None else 0.0
    res.collectives += reduce(flat, dist.ReduceOp.SUM, mesh, "the Hessian diagonals")
    raise_any(failure, flat[-1], "the Hessian diagonals")
    at = 0
    for k in keys:
        unit = (amax.get(k, 0.0) / 2.0**bits) ** 2  # grid units -> squared input values
        res.sums[k] = flat[at : at + cols[k]].clone() * unit
        res.rows[k] = int(flat[at + cols[k]])
        at += cols[k] + 1
    return res


def reduce(t: torch.Tensor, op, mesh: Mesh, what: str) -> int:  # noqa: ANN001
    """``t`` (host) all-reduced in place over the data group; the collectives it took."""
    group = mesh.data_group
    if group is None or dist.get_world_size(group) == 1:
        return 0
    buf = t.to(group_device(group))
    (deadline_of(group) or Deadline(None)).run(
        what, dist.all_reduce, buf, op=op, group=group, error=SyncError
    )
    t.copy_(buf.cpu())
    return 1


def raise_any(failure: BaseException | None, flag: torch.Tensor, what: str) -> None:
    """This rank's failure, or one for another rank's (its flag summed in)."""
    if failure is not None:
        raise failure
    if float(flag):
        raise SyncError(f"{what}: another rank failed (see its log); giving up")


@dataclass
class Weights:
    """``calibrate.mse_weighting: hessian``'s per-column weights: weight quantizer id -> float32
    ``H_jj`` (the mean of ``x_j**2`` over its input's rows; None: a cold expert, no row on any
    rank), the same on every rank."""

    by_quantizer: dict[int, torch.Tensor | None] = field(default_factory=dict)
    cold: list[str] = field(default_factory=list)  # input keys no rank saw a row of
    collectives: int = 0

    def of(self, q) -> torch.Tensor | None:  # noqa: ANN001
        return self.by_quantizer.get(id(q))


def input_weights(model, instr, batches, mesh: Mesh) -> Weights:  # noqa: ANN001
    """Steps 1-3 of the module doc with measured amaxes, as :class:`Weights`. Two forwards over
    this rank's batches (its amaxes, then its sums); the caller pauses the quantizers."""
    taken = getattr(batches, "taken", None)
    todo = [batches.batches[i] for i in taken] if taken is not None else list(batches)
    probe = Diagonals()
    amax = measure_amax(model, instr, todo, mesh, probe)
    got = gather(model, instr, todo, mesh, amax)
    _, _, key_of = input_keys(instr)
    out = Weights(collectives=probe.collectives + got.collectives)
    means: dict[str, torch.Tensor | None] = {}
    for k in got.sums:
        m = got.mean(k)
        # float32 once: the values the file carries and the export searches with again
        means[k] = None if m is None else m.to(torch.float32)
        if m is None:
            out.cold.append(k)
    out.by_quantizer = {qid: means[k] for qid, k in key_of.items()}
    return out
