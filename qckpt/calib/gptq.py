"""GPTQ for one linear: its weight quantized column by column, each column's rounding error
spread over the columns not yet quantized through the inverse Hessian of its inputs (Frantar
et al., 2022), in blocks of :data:`BLOCK` columns, with dampening and optional act-order.

Hessians are exact by construction: the inputs are put on a fixed-point grid
(:func:`fixed_point`: integers of at most ``bits`` bits, from a synced amax and the total token
count) and ``X^T X`` is taken in float64, where every product and every partial sum of such
integers is an integer below 2**53: exact in any order of summation, on any device, for any
split of the rows over batches and ranks. A float64 all-reduce of them is exact too.

The quantizer of a column is the export's: FP8 with the scale the export derives from the
calibrated amax (per tensor / row / block), or NVFP4 with the global scale from the amax and
each 16-column group's E4M3 scale by the max rule from the group's current values (the group's
scales are returned: the export takes them as they are, since the final values of a group
need not reproduce them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qckpt.formats.intq import int_asym_qparams, int_round, int_scale
from qckpt.formats.mx_codes import E8M0_BIAS, MX_EMAX, mx_exponents, mx_round
from qckpt.formats.numerics import div_f32, f64_const
from qckpt.formats.nvfp4 import E2M1_MAX, e2m1_round, max_block_scales
from qckpt.formats.scheme import FP8_MAX, Scheme

BLOCK = 128


def grid_bits(tokens: int) -> int:
    """Bits per fixed-point input so that a sum of ``tokens`` products stays below 2**52."""
    return max(1, (52 - math.ceil(math.log2(max(tokens, 2)))) // 2)


def fixed_point(x: torch.Tensor, amax: float, bits: int) -> torch.Tensor:
    """float64 integers ``round(x / amax * 2**bits)``, saturated at ``+-2**bits``: rows of the
    inputs on the Hessian's grid (the same value for the same input anywhere)."""
    top = float(2**bits)
    g = top / amax if amax > 0 else 0.0
    x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    return torch.round(x * g).clamp_(-top, top)


def hessian_add(h: torch.Tensor | None, x: torch.Tensor, amax: float, bits: int) -> torch.Tensor:
    """``h + X^T X`` of the rows ``x`` on the grid (float64, exact: see the module doc)."""
    xi = fixed_point(x, amax, bits)
    part = xi.t() @ xi
    return part if h is None else h.add_(part)


def quantized_add(h, c, x: torch.Tensor, xq: torch.Tensor, amax: float, bits: int):
    """``(h + Xq^T Xq, c + X^T Xq)`` of the rows ``x`` and their quantized values ``xq``, both
    on the one grid of ``amax`` (which bounds both): ``c[i, j] = sum_t x[t, i] * xq[t, j]``.
    Exact as :func:`hessian_add`'s sums (``h`` / ``c`` None: start them)."""
    qi = fixed_point(xq, amax, bits)
    hp, cp = qi.t() @ qi, fixed_point(x, amax, bits).t() @ qi
    return (hp if h is None else h.add_(hp)), (cp if c is None else c.add_(cp))


def input_aware_target(w: torch.Tensor, h: torch.Tensor, c: torch.Tensor, percdamp: float):
    """The weight that quantized inputs ``Xq`` need to give the source's outputs ``W X`` in
    least squares, dampened as GPTQ dampens (``H + damp I``, ``H = Xq^T Xq``, ``C = X^T Xq``):
    ``W* = W (C + damp I) (H + damp I)^-1`` (float32 ``w.shape``). It minimises
    ``|W X - V Xq|^2 + damp |V - W|^2`` over ``V``, and for any ``V`` that objective is
    ``(V - W*) (H + damp I) (V - W*)^T`` plus a constant: GPTQ of ``W*`` with ``H`` minimises
    the output error under quantized inputs. ``Xq = X`` gives ``W`` back."""
    hd, damp = _dampened(h.to(torch.float64), percdamp)
    wt = w.detach().to(torch.float64).t()
    # (C + damp I)^T W^T; dampening towards 0 instead (W C (H + damp I)^-1) shrinks the weak
    # directions: on the shared Llama NVFP4 W4A4 +2.70 % against +1.09 % (docs/QUALITY.md)
    rhs = c.to(torch.float64).t() @ wt
    rhs += damp * wt
    lower = torch.linalg.cholesky(hd)
    return torch.cholesky_solve(rhs, lower).t().to(torch.float32).contiguous()


def makes_group_scales(scheme: Scheme) -> bool:
    """Whether GPTQ makes this scheme's scales group by group as it reaches each group (NVFP4's
    block scales, INT4's group scales), which the sidecar then carries to the export."""
    return scheme.block_scaled or scheme.mx or (scheme.integer and scheme.granularity == "group")


class ColumnQuantizer:
    """Fake quantization of columns of a ``[rows, cols]`` weight as the export quantizes."""

    def __init__(
        self,
        scheme: Scheme,
        amax: torch.Tensor,
        shape,
        search: bool = False,
        scale_dtype: torch.dtype = torch.float32,
        weighted: bool = False,
    ):
        rows, cols = shape
        self.scheme, self.granularity, self.block = scheme, scheme.granularity, scheme.block
        # integer codes (INT4, INT8): round-to-nearest under a scale in the dtype the export
        # stores (``scale_dtype``), per tensor, per row, or per group made as GPTQ reaches it
        self.int_codes = scheme.integer
        self.int_groups = self.int_codes and scheme.granularity == "group"
        # block scales made group by group (under a global scale for NVFP4), else fixed ones
        self.grouped = makes_group_scales(scheme)
        self.group = scheme.block[1] if self.int_groups else scheme.group
        self.search = search  # NVFP4: each group's scale searched (mse) instead of the max rule
        # the search's squared errors weighted per column by GPTQ's loss weight 1 / U_jj**2
        # (calibrate.mse_weighting: hessian): what the sweep adds to its loss for the column
        self.weighted = weighted and search
        # MXFP4: each 32-group's E8M0 exponent from the group's current columns (stored biased)
        self.mx = scheme.mx
        self.mx_bits = scheme.code_bits
        # asymmetric INT4 groups: each group's int8 zero points beside its scale (kept for the
        # export as the scales are); act-order on INT4 groups: every group's scale (and zero
        # point) fixed from the weight before the sweep (:meth:`fix_groups`)
        self.asym = not scheme.symmetric
        self.zero_points: torch.Tensor | None = None
        self.static = False
        a = amax.detach().to(torch.float32)
        if self.mx:
            self.block_scales = torch.empty((rows, -(-cols // self.group)), dtype=torch.uint8)
            self._e: torch.Tensor | None = None
            return
        if self.int_codes:
            self.code_range = scheme.code_range
            self.scale_dtype, self.qmax = scale_dtype, scheme.qmax
            if self.int_groups:
                groups = -(-cols // self.group)
                self.block_scales = torch.empty((rows, groups), dtype=scale_dtype)
                if self.asym:
                    self.zero_points = torch.empty((rows, groups), dtype=torch.int8)
                self._sb = self._zp = None
                return
            s = int_scale(a, scheme.qmax, scale_dtype).to(torch.float32)
            per_row = self.granularity == "channel"
            self.scale = s.reshape(rows if per_row else 1, 1).expand(rows, cols)
            return
        if self.grouped:
            from qckpt.formats.numerics import float_scale

            gs = float_scale(a.reshape(()).clamp_min(1e-12), scheme.qmax)
            self.gs, self.gs64 = gs, gs.to(torch.float64)
            self.inv_gs = (1.0 / self.gs64).to(torch.float32)
            self.block_scales = torch.empty(
                (rows, -(-cols // self.group)), dtype=torch.float8_e4m3fn
            )
            self._sb: torch.Tensor | None = None
            return
        s = div_f32(a.clamp_min(1e-12), f64_const(FP8_MAX, a.device))
        if self.granularity == "tensor":
            self.scale = s.reshape(1, 1).expand(rows, cols)
        elif self.granularity == "channel":
            self.scale = s.reshape(rows, 1).expand(rows, cols)
        else:
            b0, b1 = self.block
            full = s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
            self.scale = full[:rows, :cols]

    def start_group(self, w: torch.Tensor, col: int, h: torch.Tensor | None = None) -> None:
        """NVFP4: the group starting at ``col`` takes its scale from ``w`` (its current
        columns, ``[rows, <=16]``) by the max rule, or searched (:attr:`search`: the E4M3
        scale of least squared error over the group's current values, ``qckpt.calib.mse``;
        ``h``: the columns' weights of the squares, or None)."""
        if self.mx:
            self._e = mx_exponents(w.abs().amax(dim=-1), MX_EMAX[self.mx_bits])
            self.block_scales[:, col // self.group] = (self._e + E8M0_BIAS).to(torch.uint8)
            return
        if self.int_groups:
            self._sb, self._zp = self.group_qparams(w)
            self.block_scales[:, col // self.group] = self._sb
            if self._zp is not None:
                self.zero_points[:, col // self.group] = self._zp
            return
        if self.search:
            from qckpt.formats.nvfp4_search import nvfp4_chunk

            sb, *_ = nvfp4_chunk(w.to(torch.float32), self.gs, self.gs64, self.inv_gs, h)
            self._sb = sb[:, 0]
            self.block_scales[:, col // self.group] = self._sb
            return
        bmax = w.abs().amax(dim=1).to(torch.float32)
        six64 = f64_const(E2M1_MAX, w.device)
        self._sb = max_block_scales(bmax, six64, self.gs64).to(torch.float8_e4m3fn)
        self.block_scales[:, col // self.group] = self._sb

    def group_qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales as the export stores them, int8 zero points or None) of integer groups whose
        values run along the last dim of ``w``: ``amax / qmax``, or asymmetric from min / max."""
        if self.asym:
            return int_asym_qparams(w.amin(dim=-1), w.amax(dim=-1), self.code_range,
                                    self.scale_dtype)  # fmt: skip
        return int_scale(w.abs().amax(dim=-1), self.qmax, self.scale_dtype), None

    def fix_groups(self, w: torch.Tensor) -> None:
        """Act-order on integer groups (compressed-tensors' ``actorder: weight``): every
        group's scale (and zero point) from the columns of ``w`` (``[rows, cols]``, in their
        own order) before the sweep, one per column after (:attr:`scale`, :attr:`zero`), so
        each column keeps its group's wherever the permutation takes it."""
        from qckpt.formats.rowblock import padded_blocks

        sb, zp = self.group_qparams(padded_blocks(w, self.group))
        self.block_scales.copy_(sb)
        cols = w.shape[1]
        self.scale = sb.to(torch.float32).repeat_interleave(self.group, 1)[:, :cols]
        self.zero = None
        if zp is not None:
            self.zero_points.copy_(zp)
            self.zero = zp.to(torch.float32).repeat_interleave(self.group, 1)[:, :cols]
        self.static = True

    def __call__(self, w: torch.Tensor, col: int) -> torch.Tensor:
        """The dequantized column ``col`` (``w``: its current values, float32 ``[rows]``)."""
        if self.mx:
            return mx_round(w, self._e, self.mx_bits)
        if self.int_codes:
            if self.static:
                z = None if self.zero is None else self.zero[:, col]
                return int_round(w, self.scale[:, col], self.code_range, z)
            if self.int_groups:
                z = None if self._zp is None else self._zp.to(torch.float32)
                return int_round(w, self._sb.to(torch.float32), self.code_range, z)
            return int_round(w, self.scale[:, col], self.code_range)
        if self.grouped:
            sbf = self._sb.to(torch.float32)
            y = (w * (self.inv_gs / sbf)).clamp_(-E2M1_MAX, E2M1_MAX)
            return e2m1_round(y) * (self.gs * sbf)
        s = self.scale[:, col]
        return (w / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s


def _dampened(h: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, float]:
    """(a copy of ``h`` dampened, the dampening added to its diagonal)."""
    d = h.shape[0]
    diag = torch.diagonal(h)
    dead = diag == 0
    h = h.clone()
    h[dead, dead] = 1.0  # an input column never seen: its weights are rounded, nothing spread
    damp = percdamp * float(torch.diagonal(h).mean())
    h += damp * torch.eye(d, dtype=h.dtype, device=h.device)
    return h, damp


def _inverse_factor(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """The upper Cholesky factor of the dampened Hessian's inverse (float64)."""
    h, _ = _dampened(h, percdamp)
    lower = torch.linalg.cholesky(h)
    hinv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(hinv, upper=True)


def _inverse_factors(hs: list[torch.Tensor], percdamp: float, batched: bool) -> list[torch.Tensor]:
    """:func:`_inverse_factor` of each Hessian, float32. ``batched``: the Hessians stacked
    (at most :data:`FACTOR_BYTES` of float64 working copies a call) and each step one call
    on ``[m, n, n]``; each matrix's bits are its own (see :data:`FACTOR_DEVICES`)."""
    if not batched:
        return [_inverse_factor(h.to(torch.float64), percdamp).to(torch.float32) for h in hs]
    n = hs[0].shape[0]
    # the stacked copy and one result live at once, and the float32 factors beside them
    step = max(1, batch_bytes(hs[0].device, FACTOR_BYTES) // (20 * n * n))
    out: list[torch.Tensor] = []
    for at in range(0, len(hs), step):
        h = torch.stack([x.to(torch.float64) for x in hs[at : at + step]])
        diag = torch.diagonal(h, dim1=-2, dim2=-1)
        diag.masked_fill_(diag == 0, 1.0)  # as _dampened: a column never seen
        del diag
        # each mean the reference's own reduction (a batched one may sum in another order)
        damp = percdamp * torch.stack([torch.diagonal(x).mean() for x in h])
        # the whole identity added, as _dampened adds it (-0.0 + 0.0 is +0.0 off the diagonal)
        h += damp[:, None, None] * torch.eye(n, dtype=h.dtype, device=h.device)
        lower = torch.linalg.cholesky(h)
        del h
        hinv = torch.cholesky_inverse(lower)
        del lower
        out += list(torch.linalg.cholesky(hinv, upper=True).to(torch.float32))
    return out


@dataclass(kw_only=True, frozen=True)
class Batching:
    """Which of GPTQ's per-linear steps run as one batched op over a stack of linears (an MoE
    layer's experts), each only where the batched op gives every linear the bits it gets
    alone; all False: the per-linear reference (one call per linear, as before batching).

    * ``factor``: dampening, Cholesky, ``cholesky_inverse`` and the inverse's Cholesky of the
      stack's Hessians, one call each for the stack, on :data:`FACTOR_DEVICES`;
    * ``update``: each block's update of the columns after it, one batched GEMM for the stack
      (in parts of :data:`UPDATE_BYTES`), on :data:`UPDATE_DEVICES`;
    * ``hessian``: an experts module's Hessians, one GEMM per group of experts per batch
      (:mod:`qckpt.calib.gptq_hessians`): exact integer sums, so on every device."""

    factor: bool = True
    update: bool = True
    hessian: bool = True

    def __post_init__(self) -> None:
        for name in ("factor", "update", "hessian"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"gptq Batching.{name} must be a bool")

    def factor_on(self, device: torch.device) -> bool:
        return self.factor and device.type in FACTOR_DEVICES

    def update_on(self, device: torch.device) -> bool:
        return self.update and device.type in UPDATE_DEVICES


# where a batched op gives each matrix the bits of one call on it alone. CPU: torch runs a
# batch of Cholesky / cholesky_inverse as a loop of the same LAPACK call per matrix, and MKL's
# batched GEMM gave the per-matrix bits on every shape tried (tests/unit/test_gptq_batched.py).
# CUDA: a batch of Cholesky goes to cuSOLVER's potrfBatched, another algorithm than the
# potrf of one matrix, so the factors stay per matrix there; the GEMMs are batched
# (tests/gpu/test_gptq_batched_gpu.py checks both; ``python -m bench.gptq_batched --probe``
# tells whether the batched factor would be exact too)
FACTOR_DEVICES = ("cpu",)
UPDATE_DEVICES = ("cpu", "cuda")
FACTOR_BYTES = 1 << 30  # float64 working copies of one batched factorization
UPDATE_BYTES = 1 << 27  # the product of one batched block update
# a CPU's batches stay about cache-sized: there a batched op saves no kernel launches, and a
# batch streamed through memory op by op costs more than each matrix's chain in cache (128
# factors of 256 x 256 took 0.46 s batched whole, 0.27 s in parts of 4 MiB, 0.30 s one by one)
CPU_BATCH_BYTES = 1 << 22
REFERENCE = Batching(factor=False, update=False, hessian=False)
BATCHING = Batching()  # what the gptq pass runs with (the bench sets REFERENCE to compare)


# the stacked working copies of one batch of linears (weights, results, inverse factors) stay
# under this many bytes; how the linears are batched never changes a value (see gptq_batch)
STACK_BYTES = 1 << 30


def gptq(
    w: torch.Tensor,
    h: torch.Tensor | None,
    quantizer: ColumnQuantizer,
    *,
    percdamp: float = 0.01,
    act_order: bool = False,
    block: int = BLOCK,
) -> tuple[torch.Tensor, float]:
    """The GPTQ'd weight (dequantized values, float32 ``w.shape``) and the Hessian-weighted
    error proxy ``sum(err**2)`` of the spread; ``h`` None or all zero (no token reached this
    linear, a cold expert): plain rounding to nearest."""
    opts = {"percdamp": percdamp, "act_order": act_order, "block": block}
    return gptq_batch([w], [h], [quantizer], **opts)[0]


def gptq_batch(
    ws: list[torch.Tensor],
    hs: list[torch.Tensor | None],
    quantizers: list[ColumnQuantizer],
    *,
    percdamp: float = 0.01,
    act_order: bool = False,
    block: int = BLOCK,
    stats: dict | None = None,
    batching: Batching | None = None,
) -> list[tuple[torch.Tensor, float]]:
    """:func:`gptq` of each ``(ws[k], hs[k], quantizers[k])``, the weights of one shape and
    one quantizer kind run side by side: one column loop for all (an MoE layer's experts:
    hundreds of linears, each thousands of columns of small steps).

    Each linear gets the values it gets alone: everything across the batch is elementwise
    (the same IEEE operations on the same operands, only more of them at once), and the
    matrix products (the block updates) and the Cholesky factors are batched only where a
    batched call gives each matrix its own call's bits (:class:`Batching`). So the result
    does not depend on which linears share a batch (an EP rank holds half the experts) or
    on :data:`STACK_BYTES`. ``stats["stack_bytes"]``: the largest batch's working
    copies (what ``qckpt plan`` predicts with :func:`stack_bytes`). ``batching``: which
    per-linear steps run batched (:class:`Batching`; None: :data:`BATCHING`), the same bits
    either way."""
    batching = BATCHING if batching is None else batching
    out: list[tuple[torch.Tensor, float] | None] = [None] * len(ws)
    live = []
    for k, (w, h, q) in enumerate(zip(ws, hs, quantizers, strict=True)):
        if h is None or not bool(h.any()):
            out[k] = (round_to_nearest(w.detach().to(torch.float32).clone(), q), 0.0)
        else:
            live.append(k)
    if live:
        # linears that share a Hessian (an expert's gate and up, attention's q, k, v) side by
        # side, so that each Hessian's inverse factor is made once (``last`` keeps one)
        first: dict[int, int] = {}
        for k in live:
            first.setdefault(id(hs[k]), k)
        live.sort(key=lambda k: (first[id(hs[k])], k))
        last: dict[str, torch.Tensor] = {}
        rows, cols = ws[live[0]].shape
        per = linear_stack_bytes(rows, cols)
        step = max(1, STACK_BYTES // per)
        if stats is not None:
            took = per * min(step, len(live))
            stats["stack_bytes"] = max(stats.get("stack_bytes", 0), took)
        for at in range(0, len(live), step):
            part = live[at : at + step]
            got = _gptq_stack(
                [ws[k] for k in part], [hs[k] for k in part], [quantizers[k] for k in part],
                percdamp, act_order, block, last, batching,
            )  # fmt: skip
            for k, r in zip(part, got, strict=True):
                out[k] = r
    return out  # type: ignore[return-value]


def linear_stack_bytes(rows: int, cols: int) -> int:
    """One linear's share of a batch: its weight, its result and its FP8 scales (float32
    ``rows x cols`` each; NVFP4 holds less) and its inverse factor (float32 ``cols x cols``)."""
    return 4 * (3 * rows * cols + cols * cols)


def stack_bytes(shapes: list[tuple[int, int]], targets: bool = False) -> int:
    """The largest batch :func:`gptq_batch` makes of linears of these ``(rows, cols)``;
    ``targets``: with the input-aware targets of all the linears of its shape beside it
    (float32, made for one shape at a time: ``calibrate.gptq_inputs: quantized``)."""
    top = 0
    for shape in set(shapes):
        per, n = linear_stack_bytes(*shape), shapes.count(shape)
        aims = 4 * shape[0] * shape[1] * n if targets else 0
        top = max(top, per * min(max(1, STACK_BYTES // per), n) + aims)
    return top


def _gptq_stack(ws, hs, qs, percdamp: float, act_order: bool, block: int, last: dict, how):
    """GPTQ of linears that all got tokens, stacked on a leading dim (see :func:`gptq_batch`;
    ``how``: its :class:`Batching`)."""
    W = torch.stack([w.detach().to(torch.float32) for w in ws])  # [N, rows, cols], a copy
    n, rows, cols = W.shape
    perms, pairs = [], []
    for k, (h, q) in enumerate(zip(hs, qs, strict=True)):
        given, perm = h, None
        if act_order:
            if q.grouped and not q.int_groups:
                raise ValueError(
                    f"act_order with {q.scheme.name}: its {q.group}-column groups must run in order"
                )
            if q.int_groups:  # the groups' scales from the weight as it is, before the sweep
                q.fix_groups(W[k])
            perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
            W[k] = W[k][:, perm]
            h = h[perm][:, perm]
            q.scale = q.scale[:, perm]  # the scale of a column follows it
            if getattr(q, "zero", None) is not None:
                q.zero = q.zero[:, perm]
        perms.append(perm)
        pairs.append((given, h))
    U = _stack_factors(pairs, percdamp, last, how.factor_on(W.device))
    bq = _StackedQuantizer(qs)
    Q = torch.zeros_like(W)
    loss = W.new_zeros(n)  # on the device: no host wait per column
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1 = W[:, :, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if bq.grouped and col % bq.group == 0:
                h = None
                if bq.weighted:  # the columns' loss weights in the sweep: 1 / U_jj**2
                    u = torch.diagonal(U1[:, i : i + bq.group, i : i + bq.group], dim1=1, dim2=2)
                    h = 1.0 / u.to(torch.float64) ** 2  # [N, <=group]
                bq.start_group(W1[:, :, i : i + bq.group], col, h)
            q = bq(W1[:, :, i], col)  # bq reads its column, never writes it
            Q[:, :, col] = q
            err = (W1[:, :, i] - q) / U1[:, i, i].unsqueeze(1)
            W1[:, :, i:] -= err.unsqueeze(2) * U1[:, i, i:].unsqueeze(1)
            E1[:, :, i] = err
            loss += (err * err).sum(dim=1)
        if i2 < cols:
            _update(W, E1, U, i1, i2, how.update_on(W.device))
    bq.finish()
    out = []
    for k, perm in enumerate(perms):
        qk = Q[k] if perm is None else Q[k][:, torch.argsort(perm)]
        out.append((qk, float(loss[k])))
    return out


def batch_bytes(device: torch.device, budget: int) -> int:
    """The bytes a batched op's batch may take on ``device`` (:data:`CPU_BATCH_BYTES`)."""
    return min(budget, CPU_BATCH_BYTES) if device.type == "cpu" else budget


def _stack_factors(pairs, percdamp: float, last: dict, batched: bool) -> torch.Tensor:
    """``[N, n, n]``: the float32 inverse factor of each linear's Hessian (``pairs``: (the
    Hessian given, as GPTQ takes it: permuted under act-order)), made once per Hessian (the
    linears sharing one are side by side); ``last``: the previous stack's last, reused."""
    made: dict[int, torch.Tensor] = {}
    if "h" in last:
        made[id(last["h"])] = last["u"]
    todo = {}
    for given, h in pairs:
        if id(given) not in made:
            todo.setdefault(id(given), h)
    made.update(zip(todo, _inverse_factors(list(todo.values()), percdamp, batched), strict=True))
    U = torch.stack([made[id(given)] for given, _ in pairs])
    last["h"] = pairs[-1][0]
    last["u"] = U[-1].clone()  # not a view: it would hold the whole batch
    return U


def _update(W, E1, U, i1: int, i2: int, batched: bool) -> None:
    """The columns after block ``i1:i2`` take its errors ``E1`` through the factors."""
    n, rows, cols = W.shape
    if not batched:
        for k in range(n):
            W[k, :, i2:] -= E1[k] @ U[k, i1:i2, i2:]
        return
    step = max(1, batch_bytes(W.device, UPDATE_BYTES) // (4 * rows * (cols - i2)))
    for a in range(0, n, step):
        W[a : a + step, :, i2:] -= torch.bmm(E1[a : a + step], U[a : a + step, i1:i2, i2:])


class _StackedQuantizer:
    """The column quantizers of a batch of linears as one: each one's scales stacked on a
    leading dim, the same elementwise operations as :class:`ColumnQuantizer`'s."""

    def __init__(self, qs: list[ColumnQuantizer]):
        # act-order's fixed integer groups: per-column scales, no group started in the sweep
        self.static = qs[0].static
        self.qs, self.grouped, self.group = qs, qs[0].grouped and not self.static, qs[0].group
        self.weighted = getattr(qs[0], "weighted", False)
        self.int_codes, self.int_groups = qs[0].int_codes, qs[0].int_groups
        self.zero: torch.Tensor | None = None
        self.mx, self.mx_bits = qs[0].mx, qs[0].mx_bits
        if self.mx:
            self.block_scales = torch.stack([q.block_scales for q in qs])
            self._e = None
            return
        if self.int_codes:
            q0 = qs[0]
            self.code_range, self.qmax, self.scale_dtype = q0.code_range, q0.qmax, q0.scale_dtype
            if self.int_groups and not self.static:
                self.block_scales = torch.stack([q.block_scales for q in qs])
                self.zero_points = None
                if q0.asym:
                    self.zero_points = torch.stack([q.zero_points for q in qs])
                self._sb = self._zstep = None
                return
            self.scale = torch.stack([q.scale for q in qs])
            if self.static and q0.zero is not None:
                self.zero = torch.stack([q.zero for q in qs])
            return
        if self.grouped:
            self.search = qs[0].search

            def col(name):
                return torch.stack([getattr(q, name).reshape(1) for q in qs])  # [N, 1]

            self.gs, self.gs64, self.inv_gs = col("gs"), col("gs64"), col("inv_gs")
            self.block_scales = torch.stack([q.block_scales for q in qs])
            self._sb: torch.Tensor | None = None
            self._rows: tuple | None = None
            return
        self.scale = torch.stack([q.scale for q in qs])  # [N, rows, cols]

    def start_group(self, w: torch.Tensor, col: int, h: torch.Tensor | None = None) -> None:
        """:meth:`ColumnQuantizer.start_group` of each linear (``w``: ``[N, rows, <=16]``;
        ``h``: each linear's column weights ``[N, <=16]``, or None)."""
        n, r, k = w.shape
        if self.mx:
            self._e = mx_exponents(w.abs().amax(dim=2), MX_EMAX[self.mx_bits])
            self.block_scales[:, :, col // self.group] = (self._e + E8M0_BIAS).to(torch.uint8)
            return
        if self.int_groups:
            self._sb, zp = self.qs[0].group_qparams(w)
            self.block_scales[:, :, col // self.group] = self._sb
            self._step = self._sb.to(torch.float32)
            if zp is not None:
                self.zero_points[:, :, col // self.group] = zp
                self._zstep = zp.to(torch.float32)
            return
        if self.search:
            from qckpt.formats.nvfp4_search import nvfp4_chunk

            if self._rows is None:  # each row takes its linear's global scale
                self._rows = tuple(
                    t.repeat_interleave(r, 0) for t in (self.gs, self.gs64, self.inv_gs)
                )
            hr = None if h is None else h.repeat_interleave(r, 0)  # each row its linear's
            sb, *_ = nvfp4_chunk(w.reshape(n * r, k).to(torch.float32), *self._rows, hr)
            self._sb = sb[:, 0].reshape(n, r)
        else:
            bmax = w.abs().amax(dim=2).to(torch.float32)
            six64 = f64_const(E2M1_MAX, w.device)
            self._sb = max_block_scales(bmax, six64, self.gs64).to(torch.float8_e4m3fn)
        self.block_scales[:, :, col // self.group] = self._sb
        sbf = self._sb.to(torch.float32)
        self._rec, self._step = self.inv_gs / sbf, self.gs * sbf

    def __call__(self, w: torch.Tensor, col: int) -> torch.Tensor:
        """The dequantized column ``col`` of each linear (``w``: ``[N, rows]`` float32)."""
        if self.mx:
            return mx_round(w, self._e, self.mx_bits)
        if self.int_codes:
            if self.int_groups and not self.static:
                return int_round(w, self._step, self.code_range, self._zstep)
            z = None if self.zero is None else self.zero[:, :, col]
            return int_round(w, self.scale[:, :, col], self.code_range, z)
        if self.grouped:  # the group's two factors made once, at start_group
            y = (w * self._rec).clamp_(-E2M1_MAX, E2M1_MAX)
            return e2m1_round(y) * self._step
        s = self.scale[:, :, col]
        return (w / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s

    def finish(self) -> None:
        """Each linear's NVFP4 block scales back into its own quantizer (the export's)."""
        if self.grouped:
            for q, sb in zip(self.qs, self.block_scales, strict=True):
                q.block_scales.copy_(sb)
            if self.int_codes and self.zero_points is not None:
                for q, zp in zip(self.qs, self.zero_points, strict=True):
                    q.zero_points.copy_(zp)


def round_to_nearest(W: torch.Tensor, quantizer: ColumnQuantizer) -> torch.Tensor:
    """Every column rounded to nearest with ``quantizer``'s scales, at once (what GPTQ's
    column loop gives with nothing spread); NVFP4's block scales by the max rule, kept."""
    rows, cols = W.shape
    if quantizer.int_codes:
        return _int_round_to_nearest(W, quantizer)
    if quantizer.mx:
        from qckpt.formats.rowblock import padded_blocks

        blocks = padded_blocks(W, quantizer.group)  # [rows, nb, 32]
        e = mx_exponents(blocks.abs().amax(dim=-1), MX_EMAX[quantizer.mx_bits])
        quantizer.block_scales.copy_((e + E8M0_BIAS).to(torch.uint8))
        q = mx_round(blocks, e.unsqueeze(-1), quantizer.mx_bits)
        return q.reshape(rows, -1)[:, :cols]
    if not quantizer.grouped:
        s = quantizer.scale
        return (W / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s
    from qckpt.formats.rowblock import padded_blocks

    blocks = padded_blocks(W, quantizer.group)  # [rows, nb, group]
    bmax = blocks.abs().amax(dim=-1)
    six64 = f64_const(E2M1_MAX, W.device)
    sb = max_block_scales(bmax, six64, quantizer.gs64).to(torch.float8_e4m3fn)
    quantizer.block_scales.copy_(sb)
    sbf = sb.to(torch.float32).unsqueeze(-1)
    y = (blocks * (quantizer.inv_gs / sbf)).clamp_(-E2M1_MAX, E2M1_MAX)
    return (e2m1_round(y) * (quantizer.gs * sbf)).reshape(rows, -1)[:, :cols]


def _int_round_to_nearest(W: torch.Tensor, q: ColumnQuantizer) -> torch.Tensor:
    """:func:`round_to_nearest` of integer codes: per row, or per group with each group's
    scale by the max rule from its values (kept, as GPTQ's are)."""
    rows, cols = W.shape
    if not q.int_groups:
        return int_round(W, q.scale, q.code_range)
    from qckpt.formats.rowblock import padded_blocks

    blocks = padded_blocks(W, q.group)  # [rows, nb, group]
    sb, zp = q.group_qparams(blocks)
    q.block_scales.copy_(sb)
    s = sb.to(torch.float32).unsqueeze(-1)
    z = None
    if zp is not None:
        q.zero_points.copy_(zp)
        z = zp.to(torch.float32).unsqueeze(-1)
    return int_round(blocks, s, q.code_range, z).reshape(rows, -1)[:, :cols]
