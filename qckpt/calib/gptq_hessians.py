"""The Hessians of an experts module's linears from one tap (one batch's rows, sorted by local
expert), for the gptq pass (:mod:`qckpt.calib.gptq_pass`): one GEMM per group of experts
instead of one per expert.

The experts of a group have their rows put on the grid (:func:`qckpt.calib.gptq.fixed_point`,
each expert's own amax) and zero-padded to the group's most rows, ``[G, rows, d]``, and one
batched ``P^T P`` gives the group's ``X^T X``. Every product and partial sum is an integer
below 2**53 (the grid's bound) and a padded row adds exact zeros, so each expert's Hessian is
the one :func:`qckpt.calib.gptq.hessian_add` makes of its rows alone, bit for bit, in any
GEMM's order and on any device. Experts of similar row counts share a group (sorted by rows,
a group's least at least 7/8 of its most), so the padding costs little.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qckpt.calib import gptq

# a group's padded rows (float64, with their quantized twins) and its products stay under this
GROUP_BYTES = 1 << 29


def _spans(x: torch.Tensor, ids: torch.Tensor, keys: list[str], amax: dict[str, float]):
    """(key, first row, rows) of each local expert in ``ids`` that takes a Hessian here."""
    if x.shape[0] == 0 or x.shape[-1] == 0:
        return []
    uniq, counts = torch.unique_consecutive(ids, return_counts=True)
    out, start = [], 0
    for r, n in zip(uniq.tolist(), counts.tolist(), strict=True):
        if amax.get(keys[r], 0.0) > 0:  # never reached by a token anywhere: no Hessian
            out.append((keys[r], start, n))
        start += n
    return out


def _groups(spans: list[tuple[str, int, int]], d: int, twins: bool, budget: int) -> list[list]:
    """``spans`` in groups of similar row counts, each under ``budget`` bytes."""
    order = sorted(spans, key=lambda s: (-s[2], s[1]))
    per_row = 8 * d * (2 if twins else 1)
    prods = 8 * d * d * (2 if twins else 1)
    out: list[list] = []
    for span in order:
        g = out[-1] if out else None
        if g is not None:
            top = g[0][2]
            fits = (len(g) + 1) * (top * per_row + prods) <= budget
            if fits and 8 * span[2] >= 7 * top:
                g.append(span)
                continue
        out.append([span])
    return out


def _padded(x: torch.Tensor, group, amax: dict[str, float], bits: int) -> torch.Tensor:
    """``[G, most rows, d]``: each expert's rows of ``x`` on its grid, zero rows after (a zero
    stays zero: ``0 * gain``, rounded and clamped)."""
    top = group[0][2]
    out = torch.zeros((len(group), top, x.shape[-1]), dtype=torch.float64, device=x.device)
    rows = x.detach().reshape(-1, x.shape[-1])
    for j, (_, s, n) in enumerate(group):
        out[j, :n].copy_(rows[s : s + n])
    lim = float(2**bits)
    # fixed_point's gain of each expert: the same float64 products as its scalar one
    gain = torch.tensor([lim / amax[k] for k, _, _ in group], dtype=torch.float64)
    out.mul_(gain.to(x.device)[:, None, None])
    return torch.round_(out).clamp_(-lim, lim)


def _put(m: dict, key: str, part: torch.Tensor) -> None:
    m[key] = part if key not in m else m[key].add_(part)


def add_experts(
    hs: dict[str, torch.Tensor],
    cs: dict[str, torch.Tensor],
    x: torch.Tensor,
    ids: torch.Tensor,
    keys: list[str],
    amax: dict[str, float],
    bits: int,
    quantized: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Add the rows ``x`` (sorted by their local experts ``ids``) to the Hessians ``hs`` of
    their experts (``keys[r]``: local expert ``r``'s key; ``amax``: each key's grid amax, 0 or
    absent: none); ``quantized`` (the experts' inputs quantized as their clients quantize
    them, row by row): ``H = Xq^T Xq`` and ``C = X^T Xq`` into ``cs``, as
    :func:`qckpt.calib.gptq.quantized_add`. The same bits as one expert at a time."""
    spans = _spans(x, ids, keys, amax)
    if not spans:
        return
    xq = quantized(x) if quantized is not None else None
    if len(spans) == 1:  # nothing to batch (eager's down side: one expert a call)
        key, s, n = spans[0]
        rows = x[s : s + n]
        if xq is None:
            hs[key] = gptq.hessian_add(hs.get(key), rows, amax[key], bits)
        else:
            args = (rows, xq[s : s + n], amax[key], bits)
            hs[key], cs[key] = gptq.quantized_add(hs.get(key), cs.get(key), *args)
        return
    budget = gptq.batch_bytes(x.device, GROUP_BYTES)
    for group in _groups(spans, x.shape[-1], xq is not None, budget):
        p = _padded(x, group, amax, bits)
        if xq is None:
            part = torch.bmm(p.transpose(1, 2), p)
            for j, (key, _, _) in enumerate(group):
                _put(hs, key, part[j])
            continue
        pq = _padded(xq, group, amax, bits)
        hp, cp = torch.bmm(pq.transpose(1, 2), pq), torch.bmm(p.transpose(1, 2), pq)
        for j, (key, _, _) in enumerate(group):
            _put(hs, key, hp[j])
            _put(cs, key, cp[j])
