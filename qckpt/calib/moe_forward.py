"""Instrumented forwards of transformers' fused MoE experts, and their per-expert input amaxes.

Both forwards group the (slot, token) pairs by expert with one stable sort of the routing, so
each expert's tokens come in the order transformers' eager loop takes them (``torch.where`` over
the ``[k, T]`` mask: slot, then token), and take the input amaxes of every expert of a role as
one segmented max (``scatter_reduce`` amax over the sorted expert ids) into a device tensor:
no hook call per expert, no host sync. The accumulated amaxes are folded into the quantizers
once, when the store is settled (:meth:`qckpt.calib.quantizer.AmaxStore.settle`). A max is
exact, so the amaxes equal per-expert ``collect`` calls on the same tensors bit for bit.

* ``eager``: one ``linear`` per expert on that expert's rows, as transformers' eager loop does
  (the same GEMMs on the same rows, so the same values bit for bit), combined with
  ``index_add_`` in ascending expert order. One host sync per call (the group sizes).
* ``grouped``: two grouped GEMMs over all experts (``torch._grouped_mm`` on CUDA, the grouped
  ``mm`` of ``torch.nn.functional`` elsewhere), no host sync and no Python loop over experts
  on CUDA (a GPU forward of it is bound by kernel launches: ``python -m bench.calibrate_speed
  ops`` counts what the instrumentation adds per layer, and a unit test bounds it). The combine
  adds each token's slots in ascending expert order, the additions the eager loop makes. On
  the CPU the activation runs per expert, on the very views the eager loop gives it: a CPU
  elementwise kernel's vector and scalar tails and its threads' split of the elements depend
  on the tensor's length, and ``silu``'s vector ``exp`` is not the scalar one, so one call over
  all experts' rows would differ from eager in the last bits (float32: a few values in 10^5).
* ``auto`` (the default): ``grouped`` where it gives ``eager``'s bits, else ``eager``. The
  grouped GEMM kernel is not the per-expert one (CUTLASS against cuBLAS on CUDA), so nothing
  promises their sums round alike; the first experts call of the process checks it on that
  call's own tokens (:meth:`MoeChoice.decide`: both forwards' down_proj inputs and expert
  outputs compared bit for bit, once per device, dtype and experts shape) and keeps the answer
  for the process. Experts held quantized (``calibrate.weights_resident``) always take eager.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from qckpt.calib.moe_combine import combine
from qckpt.calib.quantizer import DTYPE_CODE, TensorQuantizer
from qckpt.errors import CalibrationError
from qckpt.formats.tensor import is_quantized, select_dequantized

MOE_FORWARDS = ("auto", "eager", "grouped")
QUANTIZED_WHY = (
    "the experts are held quantized (calibrate.weights_resident): the grouped GEMMs take whole "
    "expert weights in the model's dtype"
)
# device types whose elementwise kernels compute each element alike whatever the tensor's length
# and offset (one functor per element): the grouped forward's activation runs once over all rows
ELEMENTWISE_ALIKE = {"cuda"}
# auto's verdicts in this process: (device, dtype, experts shape, activation) -> (used, why)
_VERDICTS: dict[tuple, tuple[str, str]] = {}


class SegmentedAmax:
    """Per-local-expert input amaxes of one role (gate_up's shared input, or down's input).

    ``quantizers[row]``: the quantizers fed by local expert ``row``'s rows (gate and up share
    their input). Rows are reduced to one amax per row (per tensor) or per row and block
    (per-block inputs), then maxed per expert into ``acc`` ``[n_local + 1, *amax_shape]``
    (the last row takes tokens routed to no local expert and is never folded). ``acc`` keeps
    the rows' own dtype: a max of bf16 values is a bf16 value, so no conversion kernel.
    """

    def __init__(self, quantizers: list[list[TensorQuantizer]]) -> None:
        first = quantizers[0][0]
        self.quantizers = quantizers
        self.enabled = first.enabled
        self.block = None if first.is_scalar else first.block_size[-1]
        self.shape = first.amax_shape
        self.acc: torch.Tensor | None = None
        # tap(rows, ids): sees the rows themselves and their local experts (the mse
        # histograms, the gptq Hessians); ``keep`` of :meth:`rows` drops rows of no local
        # expert first
        self.tap = None

    def rows(self, x: torch.Tensor, keep=None, ids=None) -> torch.Tensor:
        """``|x|`` maxed over each row (and block of the row): one fused kernel, exact.
        ``ids``: the rows' local experts (a tensor, or one int for all), for :attr:`tap`."""
        if x.requires_grad:
            x = x.detach()
        if self.tap is not None:
            if isinstance(ids, int):
                ids = torch.full((x.shape[0],), ids, dtype=torch.int64, device=x.device)
            self.tap(x if keep is None else x[keep], ids if keep is None else ids[keep])
        if self.block is not None:
            n, b = self.shape[0], self.block
            pad = n * b - x.shape[-1]
            if pad:
                x = F.pad(x, (0, pad))
            x = x.reshape(x.shape[0], n, b)
        return torch.linalg.vector_norm(x, float("inf"), dim=-1)

    def add(self, red: torch.Tensor, ids: torch.Tensor) -> None:
        """Max row amaxes ``red`` (from :meth:`rows`) into their experts ``ids``."""
        acc = self.acc
        if acc is None:
            n = len(self.quantizers) + 1
            acc = self.acc = red.new_zeros((n, *self.shape))  # |x| >= 0: zero is max's identity
        elif acc.dtype != red.dtype:  # a wider dtype holds both exactly
            dtype = torch.promote_types(acc.dtype, red.dtype)
            acc = self.acc = acc.to(dtype)
            red = red.to(dtype)
        index = ids if not self.shape else ids.view(-1, *([1] * len(self.shape))).expand(red.shape)
        acc.scatter_reduce_(0, index, red, "amax", include_self=True)

    def settle(self, hot: list[int]) -> None:
        """Fold the experts ``hot`` (local rows that got tokens) into their quantizers."""
        acc, self.acc = self.acc, None
        if acc is None or not hot:
            return
        qs = [q for r in hot for q in self.quantizers[r]]
        rows = torch.tensor([r for r in hot for _ in self.quantizers[r]], device=acc.device)
        first = qs[0]
        vals = acc.index_select(0, rows).to(first.calib_dtype)
        # the store's check after the folds names the first non-finite module in model order
        first.store.unchecked = True
        bank = first.bank
        if bank is None or any(q.bank is not bank for q in qs):
            for q, v in zip(qs, vals, strict=True):
                q.fold(v, check=False)
            return
        # per tensor: one gather and one scatter on the bank for all of them
        bank.fold_max([q.slot for q in qs], vals, DTYPE_CODE[first.calib_dtype])


class ExpertsObserver:
    """The per-expert input amaxes and token counts of one experts module, on the device.

    ``tokens`` has one entry per global expert, ``ids`` the local experts' global ids: fewer
    means expert parallelism, whose router sends the other experts' pairs to row ``n_local``.
    """

    def __init__(
        self, input_q: list[dict[str, TensorQuantizer]], tokens: list[int], ids: list[int]
    ):
        self.gate_up = SegmentedAmax([[q["gate"], q["up"]] for q in input_q])
        self.down = SegmentedAmax([[q["down"]] for q in input_q])
        self.tokens, self.ids = tokens, ids
        self.partial = len(ids) < len(tokens)
        self.ends: list[torch.Tensor] = []  # each forward's group ends (cumulative counts)
        self.store = input_q[0]["gate"].store
        self._bounds: torch.Tensor | None = None

    def bounds(self, device: torch.device) -> torch.Tensor:
        """``arange(n_local)`` on ``device``, made once (a kernel per forward otherwise)."""
        b = self._bounds
        if b is None or b.device != device:
            b = self._bounds = torch.arange(len(self.ids), device=device)
        return b

    def count(self, ends: torch.Tensor) -> None:
        """Keep a forward's group ends: summed when settled, not an addition per forward."""
        if not self.ends:
            self.store.defer(self.settle)
        self.ends.append(ends)
        if len(self.ends) >= 1024:  # bounds the memory of a long run: one tensor kept
            self.ends = [self._summed()]

    def _summed(self) -> torch.Tensor:
        # group ends are cumulative counts; their sum is the cumulative sum of the counts
        return torch.stack(self.ends).sum(dim=0, dtype=torch.int64)

    def settle(self) -> None:
        if not self.ends:
            return
        cum = self._summed().tolist()
        self.ends = []
        per_row = _sizes(cum)
        hot = [r for r, n in enumerate(per_row) if n]
        for r in hot:
            self.tokens[self.ids[r]] += int(per_row[r])
        for seg in (self.gate_up, self.down):
            if seg.enabled:
                seg.settle(hot)
            else:
                seg.acc = None


def _sizes(ends: list[int]) -> list[int]:
    """Group sizes from cumulative group ends."""
    return [c - p for c, p in zip(ends, [0, *ends[:-1]], strict=True)]


def _route(top_k_index: torch.Tensor, bounds: torch.Tensor):
    """(slot, token) pairs sorted by expert: their expert ids, the sort's permutation, and each
    local expert's group end (int32, as the grouped GEMM takes them). ``searchsorted`` on the
    sorted ids, not ``bincount``: CUDA's bincount reads its input's max on the host (a sync)."""
    flat = top_k_index.t().reshape(-1)  # slot-major: position j * T + t
    ids, perm = torch.sort(flat, stable=True)
    ends = torch.searchsorted(ids, bounds, right=True, out_int32=True)
    return ids, perm, ends


@dataclass(kw_only=True)
class MoeChoice:
    """``calibrate.moe_forward`` as asked and as run, shared by every experts module of one
    instrumented model. ``used`` is None while ``auto`` has not decided (it decides on the first
    experts call that routes a token to this rank's experts); ``why`` says why auto took eager."""

    asked: str
    used: str | None = None
    why: str = ""
    check_seconds: float = 0.0  # auto's check, when this process made it here
    first_call_seconds: float | None = None  # the first experts call: check, kernel compiles

    def __post_init__(self) -> None:
        if self.asked not in MOE_FORWARDS:
            raise CalibrationError(
                f"calibrate.moe_forward: {self.asked!r} is not one of {', '.join(MOE_FORWARDS)}"
            )
        if self.asked != "auto":
            self.used = self.asked

    def held_quantized(self) -> None:
        """The experts are held quantized: auto takes eager (grouped fails in its forward)."""
        if self.asked == "auto":
            self.used, self.why = "eager", QUANTIZED_WHY

    def decide(self, mod: nn.Module, n_local: int, hidden, weights, perm, ends) -> str:
        """auto: the forward for this call, deciding for the process when it can (see the module
        doc). A call whose tokens reach none of this rank's experts has nothing to compare:
        eager for it, and the next call decides."""
        if is_quantized(mod.gate_up_proj) or is_quantized(mod.down_proj):
            self.held_quantized()
            return "eager"
        key = (
            str(hidden.device), hidden.dtype, str(mod.gate_up_proj.dtype),
            tuple(mod.gate_up_proj.shape[1:]), tuple(mod.down_proj.shape[1:]),
            type(mod.act_fn).__qualname__,
        )  # fmt: skip
        got = _VERDICTS.get(key)
        if got is None:
            t0 = time.perf_counter()
            differs = grouped_differs(mod, n_local, hidden, weights, perm, ends)
            if differs is None:
                return "eager"
            self.check_seconds = time.perf_counter() - t0
            got = _VERDICTS[key] = ("eager", differs) if differs else ("grouped", "")
        self.used, self.why = got
        return self.used

    def report(self, has_experts: bool) -> dict:
        used, why = self.used, self.why
        if used is None and self.asked == "auto":
            why = "no fused experts" if not has_experts else "no token reached this rank's experts"
        return {
            "asked": self.asked, "used": used, "why": why,
            "check_seconds": round(self.check_seconds, 4),
            "first_call_seconds": None if self.first_call_seconds is None
            else round(self.first_call_seconds, 4),
        }  # fmt: skip


def forget_verdicts() -> None:
    """Forget auto's verdicts of this process (a benchmark that times the check again)."""
    _VERDICTS.clear()


def experts_forward(mod: nn.Module, obs: ExpertsObserver, mode: str | MoeChoice) -> Callable:
    """The instrumented forward for ``mod`` (a fused experts module): ``mode`` auto | eager |
    grouped, or the :class:`MoeChoice` every experts module of the model shares."""
    choice = mode if isinstance(mode, MoeChoice) else MoeChoice(asked=mode)
    n_local = len(obs.ids)

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        first = choice.first_call_seconds is None
        t0 = time.perf_counter() if first else 0.0
        with torch.no_grad():
            ids, perm, ends = _route(top_k_index, obs.bounds(top_k_index.device))
        used = choice.used
        if used is None:
            with torch.no_grad():
                used = choice.decide(mod, n_local, hidden, top_k_weights, perm, ends)
        obs.count(ends)
        run = _grouped if used == "grouped" else _eager
        out = run(mod, obs, hidden, top_k_index, top_k_weights, ids, perm, ends)
        if first:  # once: what the first call pays (auto's check, a kernel's compile)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            choice.first_call_seconds = time.perf_counter() - t0
        return out

    forward.observer = obs  # what the mse algorithm's histogram pass taps
    forward.choice = choice
    return forward


def grouped_differs(mod: nn.Module, n_local: int, hidden, weights, perm, ends) -> str | None:
    """Whether the grouped forward gives other bits than the eager one on this call's tokens:
    "" when the down_proj inputs and the weighted expert outputs of every local expert are the
    same bit for bit, else what differed; None when no token reached a local expert."""
    t = hidden.shape[0]
    cum = ends.tolist()
    m = cum[-1]
    if m == 0:
        return None
    token, slot = perm[:m] % t, perm[:m] // t
    x = hidden[token]
    w = weights[token, slot, None]
    h = _gate_up_act(mod, x, ends)
    out = _grouped_linear(h, mod.down_proj, ends) * w
    ref_h, ref_out, start = [], [], 0
    for row, end in enumerate(cum[:n_local]):
        if end > start:  # the eager loop's ops on this expert's rows
            gate, up = F.linear(x[start:end], mod.gate_up_proj[row]).chunk(2, dim=-1)
            ref_h.append(mod.act_fn(gate) * up)
            ref_out.append(F.linear(ref_h[-1], mod.down_proj[row]) * w[start:end])
        start = end
    for what, got, ref in (("down_proj inputs", h, ref_h), ("expert outputs", out, ref_out)):
        n = _bits_differ(got, torch.cat(ref))
        if n:
            return (
                f"the grouped forward's {what} differ from eager's on {hidden.device} "
                f"({n} of {got.numel()} on the first MoE call)"
            )
    return ""


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of ``a`` and ``b`` differ in their bits (a NaN equals its own bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), 1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum())


def _eager(mod, obs, hidden, top_k_index, top_k_weights, ids, perm, ends) -> torch.Tensor:
    n_local, t = len(obs.ids), hidden.shape[0]
    token, slot = perm % t, perm // t
    final = torch.zeros_like(hidden)
    cum = ends.tolist()  # the one host sync: the group sizes
    sizes = _sizes(cum)
    m = cum[-1]
    x_all = hidden[token[:m]]
    if obs.gate_up.enabled or obs.gate_up.tap is not None:
        red = obs.gate_up.rows(x_all, ids=ids[:m])
        if obs.gate_up.enabled:
            obs.gate_up.add(red, ids[:m])
    downs, start = [], 0
    for row in range(n_local):
        n = sizes[row]
        if n == 0:
            continue
        tok, pos = token[start : start + n], slot[start : start + n]
        x = x_all[start : start + n]
        # quantized-resident weights: only this expert is dequantized, for its matmul
        gate, up = F.linear(x, select_dequantized(mod.gate_up_proj, row)).chunk(2, dim=-1)
        h = mod.act_fn(gate) * up
        if obs.down.enabled or obs.down.tap is not None:
            downs.append(obs.down.rows(h, ids=row))
        h = F.linear(h, select_dequantized(mod.down_proj, row))
        h = h * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, h.to(final.dtype))
        start += n
    if downs and obs.down.enabled:
        obs.down.add(torch.cat(downs), ids[:m])
    return final


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` rows (grouped by expert, group ends ``offs``) times each expert's ``w[e].T``."""
    wt = w.transpose(-2, -1)
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, wt, offs=offs)
    if not x.is_cuda and hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, wt, offs=offs)
    out = x.new_zeros((x.shape[0], wt.shape[-1]))
    start = 0
    for e, end in enumerate(offs.tolist()):  # other dtypes on CUDA: one GEMM per expert
        if end > start:
            torch.mm(x[start:end], wt[e], out=out[start:end])
        start = end
    return out


def _gate_up_act(mod: nn.Module, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of the grouped gate/up GEMM. On CUDA an elementwise kernel computes
    each element alike, whatever the tensor; on the CPU the activation runs per expert, on the
    ``[n, I]`` views of ``[n, 2I]`` rows the eager loop hands it (see the module doc). Rows past
    the last group (pairs of no local expert) are zeros on the CPU."""
    gate_up = _grouped_linear(x, mod.gate_up_proj, ends)
    if x.device.type in ELEMENTWISE_ALIKE:
        gate, up = gate_up.chunk(2, dim=-1)
        return mod.act_fn(gate) * up
    h = gate_up.new_zeros((x.shape[0], gate_up.shape[1] // 2))
    start = 0
    for end in ends.tolist():
        if end > start:
            gate, up = gate_up[start:end].chunk(2, dim=-1)
            torch.mul(mod.act_fn(gate), up, out=h[start:end])
        start = end
    return h


def _grouped(mod, obs, hidden, top_k_index, top_k_weights, ids, perm, ends) -> torch.Tensor:
    t, k = top_k_index.shape
    if is_quantized(mod.gate_up_proj) or is_quantized(mod.down_proj):
        raise CalibrationError(
            "calibrate.moe_forward: grouped needs the experts in the model's dtype "
            "(calibrate.weights_resident: bf16)"
        )
    token, slot = perm % t, perm // t
    x_all = hidden[token]
    local = (ids < len(obs.ids)) if obs.partial else None
    if obs.gate_up.enabled or obs.gate_up.tap is not None:
        red = obs.gate_up.rows(x_all, local, ids)
        if obs.gate_up.enabled:
            obs.gate_up.add(red, ids)
    h = _gate_up_act(mod, x_all, ends)
    if obs.down.enabled or obs.down.tap is not None:
        red = obs.down.rows(h, local, ids)
        if obs.down.enabled:  # rows of no local expert (uninitialized) go to the unused last row
            obs.down.add(red, ids)
    out = _grouped_linear(h, mod.down_proj, ends) * top_k_weights[token, slot, None]
    if obs.partial:  # pairs routed to no local expert: rows the GEMMs skipped, uninitialized
        out = out.masked_fill((ids >= len(obs.ids)).unsqueeze(1), 0)
    out = out.to(hidden.dtype)
    # each token's slots added in ascending expert order, as the eager loop's index_add_ calls
    # (moe_combine: one rounding per addition). The rows are sorted by expert, so a stable sort
    # by token lists each token's rows in that order (pairs of no local expert last, by slot,
    # as the eager loop's sentinel ids tie)
    _, rows = torch.sort(token, stable=True)
    return combine(out, rows, k)
