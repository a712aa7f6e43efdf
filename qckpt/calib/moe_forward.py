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
  ``mm`` of ``torch.nn.functional`` elsewhere), no host sync. The combine adds each token's
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

from qckpt.calib.quantizer import DTYPE_CODE, TensorQuantizer
from qckpt.errors import CalibrationError
from qckpt.formats.tensor import is_quantized, select_dequantized

MOE_FORWARDS = ("eager", "grouped")


class SegmentedAmax:
    """Per-local-expert input amaxes of one role (gate_up's shared input, or down's input).

    ``quantizers[row]``: the quantizers fed by local expert ``row``'s rows (gate and up share
    their input). Rows are reduced to one amax per row (per tensor) or per row and block
    (per-block inputs), then maxed per expert into ``acc`` ``[n_local + 1, *amax_shape]``
    (the last row takes tokens routed to no local expert and is never folded).
    """

    def __init__(self, quantizers: list[list[TensorQuantizer]]) -> None:
        first = quantizers[0][0]
        self.quantizers = quantizers
        self.enabled = first.enabled
        self.block = None if first.is_scalar else first.block_size[-1]
        self.shape = first.amax_shape
        self.acc: torch.Tensor | None = None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``|x|`` maxed over each row (and block of the row): exact in x's own dtype."""
        x = x.detach()
        if self.block is None:
            return x.abs().amax(dim=-1)
        n, b = self.shape[0], self.block
        pad = n * b - x.shape[-1]
        if pad:
            x = F.pad(x, (0, pad))
        return x.abs().reshape(x.shape[0], n, b).amax(dim=-1)

    def add(self, red: torch.Tensor, ids: torch.Tensor) -> None:
        """Max row amaxes ``red`` (from :meth:`rows`) into their experts ``ids``."""
        if self.acc is None:
            dtype = torch.promote_types(red.dtype, torch.float32)  # exact for any float input
            n = len(self.quantizers) + 1
            self.acc = torch.zeros((n, *self.shape), dtype=dtype, device=red.device)
        index = ids.view(-1, *([1] * len(self.shape))).expand(red.shape)
        self.acc.scatter_reduce_(0, index, red.to(self.acc.dtype), "amax", include_self=True)

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
        slots = torch.tensor([q.slot for q in qs], device=bank.device)
        present = torch.tensor([bank.present[q.slot] for q in qs], dtype=torch.bool)
        new = vals.to(device=bank.device, dtype=torch.float32)
        cur = bank.values.index_select(0, slots)
        new = torch.where(present.to(bank.device), torch.maximum(cur, new), new)
        bank.values.index_copy_(0, slots, new)
        code = DTYPE_CODE[first.calib_dtype]
        for q, p in zip(qs, present.tolist(), strict=True):
            if not p:
                bank.codes[q.slot] = code
                bank.present[q.slot] = 1


class ExpertsObserver:
    """The per-expert input amaxes and token counts of one experts module, on the device."""

    def __init__(
        self, input_q: list[dict[str, TensorQuantizer]], tokens: list[int], ids: list[int]
    ):
        self.gate_up = SegmentedAmax([[q["gate"], q["up"]] for q in input_q])
        self.down = SegmentedAmax([[q["down"]] for q in input_q])
        self.tokens, self.ids = tokens, ids
        self.counts: torch.Tensor | None = None
        self.store = input_q[0]["gate"].store

    def count(self, counts: torch.Tensor) -> None:
        if self.counts is None:
            self.counts = torch.zeros_like(counts)
            self.store.defer(self.settle)
        self.counts += counts

    def settle(self) -> None:
        counts, self.counts = self.counts, None
        if counts is None:
            return
        per_row = counts.tolist()[: len(self.ids)]
        hot = [r for r, n in enumerate(per_row) if n]
        for r in hot:
            self.tokens[self.ids[r]] += int(per_row[r])
        for seg in (self.gate_up, self.down):
            if seg.enabled:
                seg.settle(hot)
            else:
                seg.acc = None


def _route(top_k_index: torch.Tensor, n_local: int):
    """(slot, token) pairs sorted by expert: ids, token and slot of each, counts per expert."""
    t = top_k_index.shape[0]
    flat = top_k_index.t().reshape(-1)  # slot-major: position j * T + t
    ids, perm = torch.sort(flat, stable=True)
    counts = torch.bincount(ids, minlength=n_local + 1)
    return ids, perm % t, perm // t, perm, counts


def experts_forward(mod: nn.Module, obs: ExpertsObserver, mode: str) -> Callable:
    """The instrumented forward for ``mod`` (a fused experts module), ``mode`` eager|grouped."""
    n_local = len(obs.ids)
    if mode not in MOE_FORWARDS:
        raise CalibrationError(f"calibrate.moe_forward: {mode!r} is not one of {MOE_FORWARDS}")

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        with torch.no_grad():
            ids, token, slot, perm, counts = _route(top_k_index, n_local)
        obs.count(counts)
        if mode == "grouped":
            return _grouped(mod, obs, hidden, top_k_index, top_k_weights, ids, perm, counts)
        return _eager(mod, obs, hidden, top_k_weights, ids, token, slot, counts)

    return forward


def _eager(mod, obs, hidden, top_k_weights, ids, token, slot, counts) -> torch.Tensor:
    n_local = len(obs.ids)
    final = torch.zeros_like(hidden)
    sizes = counts.tolist()  # the one host sync: the group sizes
    m = sum(sizes[:n_local])
    x_all = hidden[token[:m]]
    if obs.gate_up.enabled:
        obs.gate_up.add(obs.gate_up.rows(x_all), ids[:m])
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
        if obs.down.enabled:
            downs.append(obs.down.rows(h))
        h = F.linear(h, select_dequantized(mod.down_proj, row))
        h = h * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, h.to(final.dtype))
        start += n
    if downs:
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


def _grouped(mod, obs, hidden, top_k_index, top_k_weights, ids, perm, counts) -> torch.Tensor:
    n_local = len(obs.ids)
    t, k = top_k_index.shape
    if is_quantized(mod.gate_up_proj) or is_quantized(mod.down_proj):
        raise CalibrationError(
            "calibrate.moe_forward: grouped needs the experts in the model's dtype "
            "(calibrate.weights_resident: bf16)"
        )
    token, slot = perm % t, perm // t
    offs = torch.cumsum(counts[:n_local], 0, dtype=torch.int32)
    x_all = hidden[token]
    if obs.gate_up.enabled:
        obs.gate_up.add(obs.gate_up.rows(x_all), ids)
    gate, up = _grouped_linear(x_all, mod.gate_up_proj, offs).chunk(2, dim=-1)
    h = mod.act_fn(gate) * up
    dropped = (ids >= n_local).unsqueeze(1)  # routed to no local expert: rows the GEMM skips
    if obs.down.enabled:  # rows of no local expert (uninitialized) go to the unused last row
        obs.down.add(obs.down.rows(h), ids)
    out = _grouped_linear(h, mod.down_proj, offs)
    out = (out * top_k_weights[token, slot, None]).masked_fill(dropped, 0).to(hidden.dtype)
    # each token's slots added in ascending expert order, as the eager loop's index_add_ calls
    place = torch.empty_like(perm)
    place[perm] = torch.arange(perm.numel(), device=perm.device)
    place = place.view(k, t)
    order = top_k_index.argsort(dim=1, stable=True)
    tok = torch.arange(t, device=hidden.device)
    final = torch.zeros_like(hidden)
    for j in range(k):
        final.add_(out[place[order[:, j], tok]])
    return final
