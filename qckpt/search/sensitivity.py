"""``qckpt search``'s sensitivities: for every linear and candidate scheme, the output error that
rounding its weights to that scheme costs on the calibration tokens, as a diagonal proxy.

For a linear ``y = W x`` whose inputs over the calibration set are the rows of ``X``, rounding
``W`` to ``Q(W)`` moves the outputs by ``|X (W - Q(W))^T|^2 = sum((dW H) * dW)``, ``H = X^T X``.
The search keeps ``H``'s diagonal only,

    E = sum_j H_jj * |W[:, j] - Q(W)[:, j]|^2,    H_jj = sum over tokens of x_j^2,

which is exact when the inputs' channels are uncorrelated and otherwise the first-order term
of it (GPTQ's full ``H`` is ``cols^2`` numbers a linear; the diagonal is ``cols``, so a whole
model's fits in memory at once and the pass is one forward over the data). ``Q`` is the
export's round-to-nearest with max-rule scales (:func:`qckpt.calib.awq.fake_quant`: gptq's
``ColumnQuantizer``, the codes the export writes for a max calibration); the model dtype
(weights ``format: none``) has ``E = 0``. The scale of each linear is its own (the export shares
a fused group's largest per-tensor amax: the group's ``E`` under it is at least this one).

How it is exact under DP x EP, bit for bit the one process's:

1. the input amaxes are the max calibration's (a probe recipe: FP8 per-tensor static inputs on
   every linear the search covers), synced over the data group; routed experts share their
   layer's (``share_expert_inputs``), so a cold expert has one too;
2. one forward over this rank's batches; each linear's inputs (an expert's: its routed rows)
   are put on :mod:`qckpt.calib.gptq`'s fixed-point grid of that amax and their squares summed
   per column in float64: integers below 2**52, exact in any order. One float64 SUM over the
   data group (the routed rows of an expert are seen by the ranks that hold it, the others
   send zeros) gives every rank every diagonal, with each key's row count beside it (steps 1-2:
   :mod:`qckpt.calib.hdiag`, which ``calibrate.mse_weighting: hessian`` shares);
3. a cold expert (no row on any rank) takes the mean of its layer's hot experts' diagonals of
   the same side (gate/up's input, or down's), in expert order (an expert that gets no
   calibration token still gets tokens when served: the layer's average is the neutral guess);
   a layer with no hot expert keeps zeros;
4. ``E`` of each (weight, candidate) on the rank that owns the weight (under DP, its share:
   :func:`qckpt.calib.weight_amax.split_weights`); every sum in it is a pairwise tree of
   elementwise adds (:func:`tree_sum`), whose value depends on the shape only, not on threads
   or devices; one float64 MAX over the data group (owners agree, the others send zeros)
   gives every rank every ``E``.

A failure on one rank rides in both collectives as a flag, so every rank raises together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from qckpt.calib import hdiag
from qckpt.calib.algorithms import Algorithm, paused
from qckpt.calib.awq import fake_quant
from qckpt.parallel.mesh import Mesh


@dataclass
class Sensitivity:
    """What the pass found, the same on every rank."""

    # HF module name -> (out, in) of every linear the search covers, in a fixed order
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # input key -> float64 H_jj in squared input units ([in]); dense: the module's name,
    # experts: "{experts}:{e}:gate_up" | ":down"
    diag: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)  # calibration rows per input key
    errors: dict[str, list[float]] = field(default_factory=dict)  # module -> E per candidate
    # module -> the export's bytes per candidate (None: the export cannot write it so)
    bytes: dict[str, list[int | None]] = field(default_factory=dict)
    cold: list[str] = field(default_factory=list)  # input keys given the layer's mean
    collectives: int = 0
    seconds: float = 0.0


def tree_sum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``t`` summed over ``dim`` by halving (elementwise adds of the two halves, a zero slice
    padding an odd length): the same bits for the same values and shape on any thread count or
    device, which a reduction kernel does not promise."""
    t = t.movedim(dim, 0)
    while t.shape[0] > 1:
        n = t.shape[0]
        if n % 2:
            t = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
            n += 1
        t = t[: n // 2] + t[n // 2 :]
    return t[0] if t.shape[0] else t.new_zeros(t.shape[1:])


@dataclass(kw_only=True)
class SensitivityPass(Algorithm):
    """The pass of the module doc as a step of :func:`qckpt.calib.calibrate.calibrate_model`
    (after the max calibration's sync, so the input amaxes are final). Not registered: no
    recipe names it; ``qckpt search`` passes it in. ``candidates``: the candidates' weight
    schemes (:class:`qckpt.formats.scheme.Scheme`); ``sizes(shapes)``: module -> the export's
    bytes per candidate (:func:`qckpt.search.sizes.linear_bytes`), None where it cannot write
    it (no E is made there)."""

    name: ClassVar[str] = "search"
    offload: ClassVar[tuple[str, ...]] = ("none",)
    candidates: list[Any]
    sizes: Any = None

    def after(self, model, instr, batches, mesh, mine, parts, runner):  # noqa: ANN001
        t0 = time.perf_counter()
        with paused(instr):
            res = measure(model, instr, batches, mesh, self.candidates, mine, self.sizes)
        res.seconds = time.perf_counter() - t0
        parts["search"] = res.seconds
        return res

    def apply(self, res, state, report, model, instr, mesh) -> None:  # noqa: ANN001
        super().apply(res, state, report, model, instr, mesh)
        report["search"] = res


def _keys(instr) -> tuple[list[str], dict[str, int], dict[int, str], dict[str, float]]:
    """(every input key in one order on every rank, its columns, weight quantizer id -> its
    input key, each key's synced input amax)."""
    keys, cols, key_of = hdiag.input_keys(instr)
    amax: dict[str, float] = {}
    for k in keys:
        if ":" not in k:
            amax[k] = _amax(instr.quantizers[f"{k}.input_amax"])
    for info in instr.experts:
        for e in range(info.num_experts):
            for side, roles in hdiag.SIDES:
                amax[hdiag.expert_key(info.module_name, e, side)] = _amax(info.input_q[e][roles[0]])
    return keys, cols, key_of, amax


def _amax(q) -> float:
    a = q.amax
    return 0.0 if a is None else float(a.float().max())


def measure(
    model: nn.Module, instr, batches, mesh: Mesh, candidates: list, mine=None, sizes=None
) -> Sensitivity:
    """Steps 2-4 of the module doc on an instrumented, max-calibrated model."""
    res = Sensitivity()
    res.shapes = {
        q.name: tuple(int(s) for s in q.shape)
        for q in instr.quantizers.values()
        if q.kind == "weight"
    }
    res.bytes = sizes(res.shapes) if sizes is not None else {}
    skip = {(n, c) for n, row in res.bytes.items() for c, b in enumerate(row) if b is None}
    _, _, key_of, amax = _keys(instr)
    got = hdiag.gather(model, instr, _batches(batches), mesh, amax)
    res.collectives += got.collectives
    res.diag, res.rows = got.sums, got.rows
    res.cold = _fill_cold(instr, res)
    _errors(model, instr, mesh, candidates, mine, skip, key_of, res)
    return res


def _batches(batches) -> list[torch.Tensor]:
    taken = getattr(batches, "taken", None)
    return [batches.batches[i] for i in taken] if taken is not None else list(batches)


def _fill_cold(instr, res: Sensitivity) -> list[str]:
    """Step 3: each cold expert's diagonal, its layer's hot experts' mean (per side)."""
    cold = []
    for info in instr.experts:
        for side in ("gate_up", "down"):
            keys = [f"{info.module_name}:{e}:{side}" for e in range(info.num_experts)]
            hot = [k for k in keys if res.rows[k] > 0]
            if not hot:
                continue
            total = res.diag[hot[0]].clone()
            for k in hot[1:]:  # expert order, elementwise: the same bits everywhere
                total = total + res.diag[k]
            mean = total / len(hot)
            for k in keys:
                if res.rows[k] == 0:
                    res.diag[k] = mean.clone()
                    cold.append(k)
    return cold


def _errors(model, instr, mesh: Mesh, candidates, mine, skip, key_of, res: Sensitivity) -> None:
    """Step 4: E of every (weight, candidate), computed by its owner, MAX over the data group."""
    names = sorted(res.shapes)
    k = len(candidates)
    flat = torch.zeros(len(names) * k + 1, dtype=torch.float64)
    at = {n: i * k for i, n in enumerate(names)}
    failure: BaseException | None = None
    try:
        with torch.no_grad():
            for src in instr.weights:
                q = src.quantizer
                if not q.local or (mine is not None and q.name not in mine):
                    continue
                w = src.take(model.get_parameter(src.param)).detach().to(torch.float32)
                d = res.diag[key_of[id(q)]].to(w.device)
                for c, scheme in enumerate(candidates):
                    if scheme.quantized and (q.name, c) not in skip:
                        flat[at[q.name] + c] = weight_error(w, scheme, d)
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the exchange
        failure = exc
    flat[-1] = 1.0 if failure is not None else 0.0
    res.collectives += hdiag.reduce(flat, dist.ReduceOp.MAX, mesh, "the search's errors")
    hdiag.raise_any(failure, flat[-1], "qckpt search")
    for n in names:
        res.errors[n] = flat[at[n] : at[n] + k].tolist()


def weight_error(w: torch.Tensor, scheme, diag: torch.Tensor) -> float:
    """``sum_j diag_j |w[:, j] - Q(w)[:, j]|^2`` (float64; ``Q``: the export's max-rule
    round-to-nearest of ``scheme``): the proxy of the module doc, for one weight."""
    q = fake_quant(w, scheme)
    d = (w.to(torch.float64) - q.to(torch.float64)) ** 2
    return float(tree_sum(tree_sum(d, 0) * diag.to(torch.float64)))
