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
  (a GPU forward of it is bound by kernel launches: ``python -m bench.calibrate_speed ops``
  counts what the instrumentation adds per layer, and a unit test bounds it). The combine adds each token's
  slots in ascending expert order, the additions the eager loop makes. The expert inputs of
  the first MoE layer are the same hidden states; but a grouped GEMM kernel may round its sums
  differently from a per-expert GEMM, so down_proj inputs and every later layer may differ in
  the last bits: opt-in (``calibrate.moe_forward: grouped``), see docs/BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from qckpt.calib.moe_combine import combine
from qckpt.calib.quantizer import DTYPE_CODE, TensorQuantizer
from qckpt.errors import CalibrationError
from qckpt.formats.tensor import is_quantized, select_dequantized

MOE_FORWARDS = ("eager", "grouped")


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


def experts_forward(mod: nn.Module, obs: ExpertsObserver, mode: str) -> Callable:
    """The instrumented forward for ``mod`` (a fused experts module), ``mode`` eager|grouped."""
    if mode not in MOE_FORWARDS:
        raise CalibrationError(f"calibrate.moe_forward: {mode!r} is not one of {MOE_FORWARDS}")
    run = _grouped if mode == "grouped" else _eager

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        with torch.no_grad():
            ids, perm, ends = _route(top_k_index, obs.bounds(top_k_index.device))
        obs.count(ends)
        return run(mod, obs, hidden, top_k_index, top_k_weights, ids, perm, ends)

    forward.observer = obs  # what the mse algorithm's histogram pass taps
    return forward


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
    gate, up = _grouped_linear(x_all, mod.gate_up_proj, ends).chunk(2, dim=-1)
    h = mod.act_fn(gate) * up
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
