"""The ``gptq`` algorithm's pass inside :func:`qckpt.calib.calibrate.calibrate_model`, after the
max calibration and its sync (so every weight amax, hence every scale, is final everywhere).

Layer by layer (the model resident; each decoder layer's inputs are the outputs of the layers
before it, already GPTQ'd): one forward per batch records layer 0's input and every layer's
other arguments (the model's own forward builds them); then for each layer:

1. its batches once, taking each linear's input amax (per expert, over its routed rows);
   MAX over the data group (a failure flag rides in the same buffer, so a rank that failed
   ends the run on every rank);
2. its batches again, each linear's Hessian ``X^T X`` on the fixed-point grid of that amax
   (:func:`qckpt.calib.gptq.hessian_add`, exact in float64); dense linears' summed over the
   data group, experts' over the DP group (the ranks that hold the same experts: an expert
   sees the tokens of its EP group's batches through the EP exchange). Integer-valued float64
   sums are exact in any order: the Hessians are those of one process, bit for bit;
3. GPTQ of every linear of the layer (:func:`qckpt.calib.gptq.gptq`): gate and up of an
   expert share its input's Hessian; an expert that got no token anywhere is rounded to
   nearest; the weights in the model become the dequantized GPTQ values;
4. its batches a third time with those weights: the next layer's inputs.

Every rank runs the same forwards in the same order (EP's exchanges meet), and the GPTQ of a
module runs on every rank that holds it, on identical inputs: DP replicas agree bit for bit.
The weights leave through :func:`tensors_to_write` (this rank's share of the sidecar).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qckpt.calib import gptq, gptq_hessians, gptq_inputs
from qckpt.calib.instrument import Instrumentation, WeightSource
from qckpt.calib.layerwise import capture_layer_inputs, decoder_layers
from qckpt.errors import SyncError
from qckpt.parallel.deadline import Deadline, deadline_of
from qckpt.parallel.mesh import Mesh, group_device
from qckpt.term import trace


@dataclass
class GptqOptions:
    percdamp: float = 0.01
    act_order: bool = False
    block: int = gptq.BLOCK
    block_search: bool = False  # NVFP4: group scales searched (mse) instead of the max rule
    block_weighted: bool = False  # the search's errors weighted by GPTQ's 1 / U_jj**2
    # calibrate.gptq_inputs: source (the Hessians of the inputs as they are) or quantized (of
    # the inputs as the export's clients quantize them, each module's by its own input scheme:
    # qckpt.calib.gptq_inputs; ``input_dtype``: the dtype static FP8 input scales are stored in)
    inputs: str = gptq_inputs.SOURCE
    input_dtype: torch.dtype = torch.float32
    # calibrate.offload: names -> a writer whose add(name, tensor) takes this rank's share of
    # the sidecar layer by layer (:func:`streamed_sidecar`); else the share is held in memory
    sidecar: Any = None
    # which per-linear steps run batched over a layer's experts (None: gptq.BATCHING); the
    # same bits either way (gptq.REFERENCE: one call per linear / expert, as the reference)
    batching: gptq.Batching | None = None


@dataclass
class GptqResult:
    block_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # NVFP4, by module
    zero_points: dict[str, torch.Tensor] = field(default_factory=dict)  # asymmetric INT4's
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # the report's rows
    parts: dict[str, float] = field(default_factory=dict)
    collectives: int = 0
    done: set[str] = field(default_factory=set)  # the modules GPTQ'd here
    # the largest layer's Hessians on this rank: held (linears that got tokens) and at most
    # (every linear of the layer: what ``qckpt plan`` predicts)
    hessian_bytes: int = 0
    hessian_bytes_bound: int = 0
    stack_bytes: int = 0  # the largest batch of GPTQ's working copies (gptq.gptq_batch)
    inputs: str = gptq_inputs.SOURCE  # calibrate.gptq_inputs it ran with
    # calibrate.offload: the sidecar's tensors, taken layer by layer before each layer left
    written: dict[str, torch.Tensor] | None = None


@dataclass
class _Linear:
    """One weight GPTQ runs on: its quantizer's source, and which input Hessian it takes."""

    src: WeightSource
    hkey: str  # dense: the module; experts: "{experts}:{e}:gate_up" / ":down"
    amax: torch.Tensor  # what the export makes the scales from (see _layer_linears)


def _batches(batches) -> list[torch.Tensor]:
    taken = getattr(batches, "taken", None)
    return [batches.batches[i] for i in taken] if taken is not None else list(batches)


def run_gptq(
    model: nn.Module,
    instr: Instrumentation,
    batches: Sequence[torch.Tensor],
    mesh: Mesh,
    opts: GptqOptions,
    on: set[int] | None = None,
    runner: Any = None,
) -> GptqResult:
    """The pass of the module doc; raises :class:`SyncError` on every rank if any rank failed.
    ``on``: ids of the enabled quantizers (the caller pauses them all while this runs).
    ``runner`` (``calibrate.offload``: a :class:`qckpt.calib.layerwise.LayerwiseRunner`): the
    model is on meta and each layer's weights come onto the device for its turn (the next
    one's read meanwhile); its GPTQ'd weights go to the sidecar file (``opts.sidecar``), or
    else to host memory, before it leaves."""
    res = GptqResult(inputs=opts.inputs)
    on = on if on is not None else {id(q) for q in instr.quantizers.values() if q.enabled}
    t0 = time.perf_counter()
    todo = _batches(batches)
    tokens = _total_tokens(todo, mesh, res)
    bits = gptq.grid_bits(tokens)
    layers_name, layers = decoder_layers(model)
    sink = None  # offload: this rank's sidecar file, written layer by layer
    if runner is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        io = LayerIo(device, lambda x, slot: x)
        hidden, calls = capture_layer_inputs(
            model, layers, todo, device, what="calibrate.algorithm gptq"
        )
    else:
        io = LayerIo(runner.device, runner.keep)
        res.written = {}
        names = _share_names(instr, mesh, on, layers_name + ".")
        sink = opts.sidecar(names) if opts.sidecar is not None else None
        with runner.outer(model):
            hidden, calls = capture_layer_inputs(
                model, layers, todo, runner.device, what="calibrate.algorithm gptq",
                keep=runner.keep,
            )  # fmt: skip
    res.parts["gptq_capture"] = time.perf_counter() - t0

    def one(i: int) -> None:
        layer = layers[i]
        prefix = f"{layers_name}.{i}"
        lin, experts = _layer_linears(instr, prefix, on)
        t1 = time.perf_counter()
        run = partial(io.run, layer, hidden, calls, i)
        qa = _input_quants(instr, lin, experts, opts)
        amax = _layer_amax(model, lin, experts, run, mesh, res, qa)
        hs, cs = _layer_hessians(model, lin, experts, run, amax, bits, mesh, res, qa, opts)
        held = sum(h.numel() * h.element_size() for h in [*hs.values(), *cs.values()])
        dims = {x.hkey: x.src.quantizer.shape[1] for x in lin}
        res.hessian_bytes = max(res.hessian_bytes, held)
        per = 8 * (2 if qa else 1)  # float64; with quantized inputs C beside H
        res.hessian_bytes_bound = max(
            res.hessian_bytes_bound, sum(per * d * d for d in dims.values())
        )
        unit = {k: (a / 2.0**bits) ** 2 for k, a in amax.items()}  # grid units -> squared values
        row = _quantize_layer(model, lin, hs, cs, unit, opts, res)
        del hs, cs
        io.outputs(layer, hidden, calls, i)
        if res.written is not None:  # the layer's weights leave the device after this
            mine = tensors_to_write(model, instr, mesh, res, within=prefix + ".")
            if sink is None:
                res.written.update(mine)
            else:
                for name, t in mine.items():
                    sink.add(name, t)
        row["seconds"] = round(time.perf_counter() - t1, 4)
        res.layers[prefix] = row
        trace(f"gptq {prefix}: {row['seconds']:.2f} s ({i + 1}/{len(layers)} layers)")

    if runner is None:
        for i in range(len(layers)):
            one(i)
    else:
        runner.walk(layers_name, layers, one)
    res.parts["gptq_layers"] = time.perf_counter() - t0 - res.parts["gptq_capture"]
    return res


def _input_quants(instr, lin, experts, opts: GptqOptions) -> gptq_inputs.LayerInputs:
    """hkey -> the quantization of its inputs (``calibrate.gptq_inputs: quantized``; else
    none)."""
    if opts.inputs != gptq_inputs.QUANTIZED:
        return gptq_inputs.LayerInputs()
    return gptq_inputs.layer_input_quants(instr, lin, experts, opts.input_dtype)


def _total_tokens(todo, mesh: Mesh, res: GptqResult) -> int:
    """Tokens of the whole calibration set (every rank's): the bound of the grid's sums."""
    n = torch.tensor([sum(int(b.numel()) for b in todo)], dtype=torch.int64)
    group = mesh.data_group
    if group is not None:
        n = n.to(group_device(group))
        _reduce(n, dist.ReduceOp.SUM, group, "the gptq token count")
        res.collectives += 1
    return int(n.item())


def _reduce(t: torch.Tensor, op, group, what: str) -> None:
    dl = deadline_of(group) or Deadline(None)
    dl.run(what, dist.all_reduce, t, op=op, group=group, error=SyncError)


@dataclass(frozen=True)
class LayerIo:
    """How a layer's batches run: each input brought to ``device`` (it may wait in host
    memory under ``calibrate.activations: host``), each output kept by ``keep(y, slot)`` in
    its input's place (a batch's input is not needed once its output is made)."""

    device: torch.device
    keep: Any

    def run(self, layer, hidden, calls, i) -> None:
        with torch.no_grad():
            for b, h in enumerate(hidden):
                args, kwargs = calls[b][i]
                layer(h.to(self.device), *args, **kwargs)

    def outputs(self, layer, hidden, calls, i) -> None:
        with torch.no_grad():
            for b, h in enumerate(hidden):
                args, kwargs = calls[b][i]
                y = layer(h.to(self.device), *args, **kwargs)
                y = y[0] if isinstance(y, tuple) else y
                hidden[b] = self.keep(y, h if h.device != y.device else None)


def _layer_linears(instr: Instrumentation, prefix: str, on: set[int]):
    """(the layer's GPTQ weights this rank holds, its experts modules with their observers)."""
    inside = prefix + "."
    downs = {
        id(roles["down"]) for info in instr.experts for roles in info.weight_q.values()
        if "down" in roles
    }  # fmt: skip
    # an expert's gate and up share one per-tensor weight scale in the export (moe_scales
    # shared, what vLLM loads): the larger amax of the two, which GPTQ must quantize with
    pair: dict[int, torch.Tensor] = {}
    for info in instr.experts:
        for roles in info.weight_q.values():
            g, u = roles.get("gate"), roles.get("up")
            if g is not None and u is not None and g.is_scalar and g.amax is not None:
                top = torch.maximum(g.amax, u.amax) if u.amax is not None else g.amax
                pair[id(g)] = pair[id(u)] = top
    _share_fused_nvfp4(instr, on, inside, pair)
    lin: list[_Linear] = []
    for src in instr.weights:
        q = src.quantizer
        if id(q) not in on or not q.name.startswith(inside):
            continue
        amax = pair.get(id(q), q.amax)
        if q.expert_layer is None:
            lin.append(_Linear(src, q.name, amax))
        else:
            side = "down" if id(q) in downs else "gate_up"
            lin.append(_Linear(src, f"{q.expert_layer}:{q.expert}:{side}", amax))
    experts = [
        (info, mod.forward.observer)
        for info, mod in zip(instr.experts, instr.patched, strict=True)
        if info.module_name.startswith(inside)
    ]
    return lin, experts


def _dense_modules(model, lin: list[_Linear]) -> dict[str, nn.Module]:
    names = {x.hkey for x in lin if ":" not in x.hkey}
    return {n: m for n, m in model.named_modules() if n in names}


def _hook_all(model, lin, experts, dense_fn, expert_fn) -> list:
    """Pre-hooks on the dense linears (``dense_fn(key, x)``) and taps on the experts
    (``expert_fn(key_prefix, local_ids, x, ids)``); returns what to undo."""
    undo = []
    for name, mod in _dense_modules(model, lin).items():

        def hook(_m, args, name=name):
            if args:
                dense_fn(name, args[0])

        undo.append(mod.register_forward_pre_hook(hook))
    for info, obs in experts:
        for side, seg in (("gate_up", obs.gate_up), ("down", obs.down)):

            def tap(x, ids, info=info, side=side):
                expert_fn(info, side, x, ids)

            seg.tap = tap
            undo.append(seg)
    return undo


def _unhook(undo) -> None:
    for u in undo:
        if hasattr(u, "remove"):
            u.remove()
        else:
            u.tap = None


def per_expert(x: torch.Tensor, ids: torch.Tensor):
    """(local row, its rows of ``x``) for each local expert in ``ids`` (sorted by expert)."""
    if x.shape[0] == 0:
        return
    uniq, counts = torch.unique_consecutive(ids, return_counts=True)
    start = 0
    for r, n in zip(uniq.tolist(), counts.tolist(), strict=True):
        yield r, x[start : start + n]
        start += n


def _share_fused_nvfp4(instr, on, inside: str, pair: dict[int, torch.Tensor]) -> None:
    """NVFP4: the linears vLLM fuses (q/k/v, gate/up) get one global scale in the export, the
    largest amax of the group (qckpt.export.shared_scales.share_fused_amax), so GPTQ quantizes with it."""
    from qckpt.models.fused import fused_parts

    dense = {
        q.name: q
        for src in instr.weights
        if (q := src.quantizer).expert_layer is None
        and id(q) in on
        and q.name.startswith(inside)
        and q.scheme.fused_global
        and q.amax is not None
    }
    for group in fused_parts(list(dense)):
        top = torch.stack([dense[n].amax.float().reshape(()) for n in group]).max()
        for n in group:
            pair[id(dense[n])] = top.reshape(dense[n].amax.shape).to(dense[n].amax.dtype)


def _amax_keys(lin: list[_Linear], experts) -> list[str]:
    """Every input amax of the layer in one order on every rank: dense, then every global
    expert's two sides (remote ones included)."""
    keys = sorted({x.hkey for x in lin if ":" not in x.hkey})
    for info, _ in experts:
        for e in range(info.num_experts):
            keys += [f"{info.module_name}:{e}:gate_up", f"{info.module_name}:{e}:down"]
    return keys


def _layer_amax(model, lin, experts, run, mesh: Mesh, res: GptqResult, qa) -> dict[str, float]:
    """Step 1: every input amax of the layer, MAX over the data group (+ a failure flag); with
    quantized inputs (``qa``: hkey -> their quantization) the max of both, the inputs and their
    quantized values, which go on one grid."""
    got: dict[str, torch.Tensor] = {}

    def put(key: str, x: torch.Tensor) -> None:
        if not x.numel():
            return
        a = torch.linalg.vector_norm(x.detach().float(), float("inf"))
        if key in qa:
            a = torch.maximum(a, torch.linalg.vector_norm(qa.quantized(key, x), float("inf")))
        got[key] = a if key not in got else torch.maximum(got[key], a)

    def dense(name, x):
        put(name, x)

    def expert(info, side, x, ids):
        for r, rows in per_expert(x, ids):
            put(f"{info.module_name}:{info.local_ids[r]}:{side}", rows)

    keys = _amax_keys(lin, experts)
    failure = None
    undo = _hook_all(model, lin, experts, dense, expert)
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - told to the others through the flag below
        failure = exc
    finally:
        _unhook(undo)
        qa.forget()
    buf = torch.zeros(len(keys) + 1, dtype=torch.float32)
    for j, k in enumerate(keys):
        if k in got:
            buf[j] = got[k].cpu()
    buf[-1] = 1.0 if failure is not None else 0.0
    group = mesh.data_group
    if group is not None:
        buf = buf.to(group_device(group))
        _reduce(buf, dist.ReduceOp.MAX, group, "the gptq input amaxes over the data group")
        res.collectives += 1
        buf = buf.cpu()
    if failure is not None:
        raise failure
    if float(buf[-1]):
        raise SyncError("calibrate.algorithm gptq: another rank failed (see its log); giving up")
    return dict(zip(keys, buf[:-1].tolist(), strict=True))


def _layer_hessians(model, lin, experts, run, amax, bits, mesh: Mesh, res: GptqResult, qa, opts):
    """Step 2: the layer's Hessians on the grid, summed over the ranks that share them: (H, C)
    by hkey. Inputs as they are: ``H = X^T X``, no C. Quantized (``qa[hkey]``): ``H = Xq^T Xq``
    and ``C = X^T Xq`` (:func:`qckpt.calib.gptq.quantized_add`), summed in the same all-reduce."""
    hs: dict[str, torch.Tensor] = {}
    cs: dict[str, torch.Tensor] = {}

    def add(key: str, x: torch.Tensor) -> None:
        if not x.numel() or amax.get(key, 0.0) <= 0:
            return
        if key not in qa:
            hs[key] = gptq.hessian_add(hs.get(key), x, amax[key], bits)
            return
        xq = qa.quantized(key, x)
        hs[key], cs[key] = gptq.quantized_add(hs.get(key), cs.get(key), x, xq, amax[key], bits)

    def dense(name, x):
        add(name, x)

    batched = (opts.batching or gptq.BATCHING).hessian
    keys = {
        (info.module_name, side): [f"{info.module_name}:{e}:{side}" for e in info.local_ids]
        for info, _ in experts for side in ("gate_up", "down")
    }  # fmt: skip

    def expert(info, side, x, ids):
        if not batched:
            for r, rows in per_expert(x, ids):
                add(f"{info.module_name}:{info.local_ids[r]}:{side}", rows)
            return
        mine = keys[(info.module_name, side)]
        quant = partial(qa.quantized, mine[0]) if mine and mine[0] in qa else None
        gptq_hessians.add_experts(hs, cs, x, ids, mine, amax, bits, quant)

    undo = _hook_all(model, lin, experts, dense, expert)
    try:
        run()
    finally:
        _unhook(undo)
        qa.forget()
    dense_keys = sorted({x.hkey for x in lin if ":" not in x.hkey})
    expert_keys = sorted({x.hkey for x in lin if ":" in x.hkey})
    mats = [hs, cs] if qa else [hs]
    _sum(mats, dense_keys, lin, mesh.data_group, res)
    _sum(mats, expert_keys, lin, mesh.dp_group if mesh.ep > 1 else mesh.data_group, res)
    return hs, cs


def _sum(mats: list[dict], keys, lin, group, res: GptqResult) -> None:
    """Sum the matrices ``keys`` of each dict of ``mats`` (the Hessians, and C beside them)
    over ``group`` in one float64 all-reduce (zeros for none)."""
    if group is None or dist.get_world_size(group) == 1 or not keys:
        return
    dims = {x.hkey: x.src.quantizer.shape[1] for x in lin}
    slots = [(m, k, dims[k] ** 2) for m in mats for k in keys]
    flat = torch.zeros(sum(n for *_, n in slots), dtype=torch.float64)
    at = 0
    for m, k, n in slots:
        if k in m:
            flat[at : at + n] = m[k].reshape(-1).cpu()
        at += n
    flat = flat.to(group_device(group))
    _reduce(flat, dist.ReduceOp.SUM, group, "the gptq Hessians")
    res.collectives += 1
    flat = flat.cpu()
    at = 0
    for m, k, n in slots:
        part = flat[at : at + n]
        if bool(part.any()):
            m[k] = part.view(dims[k], dims[k])
        at += n


def _quantize_layer(model, lin: list[_Linear], hs, cs, unit, opts: GptqOptions, res):
    """Step 3: GPTQ of every weight of the layer; the weights in the model replaced. Linears of
    one shape and quantizer kind run as one batch (:func:`qckpt.calib.gptq.gptq_batch`: an MoE
    layer's experts at once; the same values as one by one). With C (quantized inputs) GPTQ
    runs on the input-aware target (:func:`qckpt.calib.gptq.input_aware_target`), made for
    one batch at a time. The row for the report: the output error over the calibration
    tokens (sum of squares; quantized inputs: against the target, i.e. the output error with
    quantized inputs less a constant), rounded to nearest vs GPTQ'd, over the linears some
    token reached."""
    row = {"linears": 0, "rounded": 0, "loss_rtn": 0.0, "loss_gptq": 0.0}
    with torch.no_grad():
        jobs = [_job(model, x, opts) for x in lin]
        groups: dict[tuple, list[int]] = {}
        for k, (_, w, _, _) in enumerate(jobs):
            q = lin[k].src.quantizer
            key = (tuple(w.shape), q.scheme, str(w.device))
            groups.setdefault(key, []).append(k)
        new: dict[int, tuple[torch.Tensor, tuple[float, float] | None]] = {}
        for ks in groups.values():
            stats: dict[str, int] = {}
            hk = [lin[k].hkey for k in ks]
            aim = {
                k: gptq.input_aware_target(jobs[k][1], hs[h], cs[h], opts.percdamp)
                for k, h in zip(ks, hk, strict=True)
                if h in cs and h in hs
            }
            got = gptq.gptq_batch(
                [aim.get(k, jobs[k][1]) for k in ks], [hs.get(h) for h in hk],
                [jobs[k][3] for k in ks], percdamp=opts.percdamp, act_order=opts.act_order,
                block=opts.block, stats=stats, batching=opts.batching,
            )  # fmt: skip
            for k, h, (q, _) in zip(ks, hk, got, strict=True):
                new[k] = (q, _losses(jobs[k], q, hs.get(h), aim.get(k)))
            # the targets of the group are held beside its batches' working copies
            took = stats.get("stack_bytes", 0) + sum(4 * a.numel() for a in aim.values())
            res.stack_bytes = max(res.stack_bytes, took)
            del aim
        for k, x in enumerate(lin):  # in the layer's order: the report's sums, the sidecar's
            _finish_one(x, jobs[k], *new.pop(k), unit.get(x.hkey, 0.0), res, row)
    return row


def _job(model, x: _Linear, opts: GptqOptions):
    """(its quantizer, its weight (a view into the model), a quantizer maker, the quantizer
    GPTQ runs with)."""
    q = x.src.quantizer
    w = x.src.take(model.get_parameter(x.src.param))
    # integer scales rounded to the dtype the export stores them in (the static input scales')
    make = partial(
        gptq.ColumnQuantizer, q.scheme, x.amax, tuple(w.shape), scale_dtype=opts.input_dtype
    )
    return q, w, make, make(search=opts.block_search, weighted=opts.block_weighted)


def _losses(job, new: torch.Tensor, h, aim) -> tuple[float, float] | None:
    """The output error on the calibration tokens (grid units) of the weight rounded to
    nearest and of the GPTQ'd one, against the target (``aim``, or the weight itself); None
    without a Hessian (no token reached the linear)."""
    if h is None:
        return None
    _, w, make, _ = job
    rtn = gptq.round_to_nearest(w.detach().float().clone(), make())
    ref = w.float() if aim is None else aim
    return _out_err(rtn - ref, h), _out_err(new - ref, h)


def _finish_one(x: _Linear, job, new, losses, unit: float, res: GptqResult, row) -> None:
    q, w, _, cq = job
    if losses is not None:
        row["loss_rtn"] += unit * losses[0]
        row["loss_gptq"] += unit * losses[1]
    else:
        row["rounded"] += 1
    w.copy_(new.to(w.dtype))
    if cq.grouped:
        res.block_scales[q.name] = cq.block_scales.clone()
        if cq.zero_points is not None:
            res.zero_points[q.name] = cq.zero_points.clone()
    res.done.add(q.name)
    row["linears"] += 1


def _out_err(d: torch.Tensor, h: torch.Tensor) -> float:
    """``sum((X dW^T)**2)`` on the grid: the output error over the calibration tokens."""
    d = d.to(torch.float64)
    return float(((d @ h.to(d.device)) * d).sum())


def tensors_to_write(model, instr: Instrumentation, mesh: Mesh, res: GptqResult, within=""):
    """This rank's share of the GPTQ sidecar: the first DP rank of each EP rank writes its
    experts, the first of all (EP rank 0 too) the dense linears; name -> host tensor. Those of
    the modules named ``within...`` only; under ``calibrate.offload`` (``res.written`` kept
    layer by layer, the model on meta now) what was kept."""
    if res.written is not None and not within:
        return res.written
    out: dict[str, torch.Tensor] = {}
    for src in instr.weights:
        q = src.quantizer
        if q.name not in res.done or not q.name.startswith(within) or not _writes(q, mesh):
            continue
        w = src.take(model.get_parameter(src.param))
        out[f"{q.name}.weight"] = w.detach().cpu().contiguous().clone()
        if q.name in res.block_scales:
            out[f"{q.name}.weight_block_scale"] = res.block_scales[q.name]
        if q.name in res.zero_points:
            out[f"{q.name}.weight_zero_point"] = res.zero_points[q.name]
    return out


def _writes(q, mesh: Mesh) -> bool:
    """Whether this rank writes quantizer ``q``'s weight (:func:`tensors_to_write`'s rule)."""
    return mesh.dp_rank == 0 and (q.expert_layer is not None or mesh.ep_rank == 0)


def _share_names(instr: Instrumentation, mesh: Mesh, on: set[int], inside: str) -> list[str]:
    """Every name this rank's share of the sidecar may hold (a streamed file's header room)."""
    out = []
    for src in instr.weights:
        q = src.quantizer
        if id(q) in on and q.name.startswith(inside) and _writes(q, mesh):
            out.append(f"{q.name}.weight")
            if gptq.makes_group_scales(q.scheme):
                out.append(f"{q.name}.weight_block_scale")
                if not q.scheme.symmetric:
                    out.append(f"{q.name}.weight_zero_point")
    return out


def sidecar_file(out: str, mesh: Mesh, suffix: str) -> Path:
    """This rank's file of the sidecar (``<out><suffix>/ep{r:03d}.safetensors``)."""
    return Path(str(out) + suffix) / f"ep{mesh.ep_rank:03d}.safetensors"


@contextlib.contextmanager
def streamed_sidecar(out: str, mesh: Mesh, algo: Any) -> Iterator[bool]:
    """Inside the block GPTQ under ``calibrate.offload`` writes this rank's share of the
    sidecar as each layer is done (``algo``: the :class:`qckpt.calib.algorithms.Gptq`
    algorithm, whose ``stream`` becomes ``GptqOptions.sidecar``), so a model's GPTQ'd weights are never
    all in host memory; the file takes its name when the block ends without an error, and is
    gone after one. Yields whether this rank writes a share (the first DP rank of each EP
    rank); :func:`write_weights` is then told ``streamed``."""
    if mesh.dp_rank != 0:
        yield False
        return
    from qckpt.atomic import atomic_file
    from qckpt.storage.safetensors_stream import StreamWriter

    made: list[StreamWriter] = []
    with atomic_file(sidecar_file(out, mesh, ".gptq"), key="calibrate.output") as tmp:
        with open(tmp, "wb") as f:

            def start(names: list[str]) -> StreamWriter:
                made.append(StreamWriter(f, names))
                return made[-1]

            algo.stream = start
            try:
                yield True
                (made[-1] if made else StreamWriter(f, [])).finish({"format": "pt"})
            finally:
                algo.stream = None


def write_weights(
    state, out: str, mesh: Mesh, suffix: str = ".gptq", streamed: bool = False
) -> None:
    """The algorithm's weights (GPTQ'd, or AWQ's folded ones: ``suffix`` ``.awq``) beside the
    calibration file ``out`` (``<out>.gptq/``, one file per EP rank, written by its first DP
    rank; see qckpt/read/gptq_source.py); the file names go into ``state`` (the same on
    every rank); stale files of an earlier run removed. ``streamed``: this rank's file is
    written already (:func:`streamed_sidecar`)."""
    from safetensors.torch import save

    from qckpt.atomic import write_bytes

    root = sidecar_file(out, mesh, suffix).parent
    state.weights_dir = str(root)
    state.weights_files = [f"ep{r:03d}.safetensors" for r in range(mesh.ep)]
    root.mkdir(parents=True, exist_ok=True)
    if mesh.dp_rank == 0 and not streamed:  # streamed: in place already
        mine = root / state.weights_files[mesh.ep_rank]
        write_bytes(mine, save(state.weights, metadata={"format": "pt"}), key="calibrate.output")
    if mesh.is_main:  # an earlier run's files of more EP ranks (never a peer's temp file)
        for f in root.glob("ep[0-9][0-9][0-9].safetensors"):
            if f.name not in state.weights_files:
                f.unlink(missing_ok=True)
