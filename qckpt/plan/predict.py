"""Each command's figures for one rank, from the tensors it holds (:mod:`qckpt.plan.tensors`).

The rules are the commands' own documented bounds; where one says "about", so does this:

* ``load``: parameters are what the rank holds after the load (quantized parameters by their
  format's field shapes, the rest at the model dtype; FP32 main params with
  ``load.main_params: fp32``). Transient: the streaming planner's, the largest quantized
  destination's numel x nominal itemsize (``LoadReport.predicted_transient_bytes``), times
  ``load.max_inflight`` where the reader keeps several scratches live; the bulk baseline holds
  every quantized destination dequantized at once. Bytes read: :mod:`qckpt.plan.reads`.
* ``calibrate``: the weights resident as ``calibrate.weights_resident`` says (bf16: the model
  dtype; fp8 / fp8_block / mxfp8: quantized parameters, dequantized one linear at a time as the
  forward reaches it: that linear is the transient). ``calibrate.offload: layer | host`` keeps
  on the device only the weights outside the decoder layers plus two layers (the one running and
  the next one being read), and keeps the activations between layers: this rank's samples x
  seq_len x hidden x dtype bytes. The forward's own working set (one batch) is an estimate
  (:func:`forward_bytes`).
* ``calibrate.algorithm: gptq`` (``gptq_bytes``): the Hessians of one decoder layer at a time,
  this rank's linears only (a dense linear's ``in^2``, an expert's ``hidden^2`` for gate/up
  and ``inter^2`` for down; with ``calibrate.gptq_inputs: quantized`` each has a second matrix of
  that size beside it, ``C``), float64, twice (the sums and the all-reduce's buffer), plus the
  layer inputs and outputs of this rank's samples (``2 x samples x seq_len x hidden``), plus
  the largest batch of GPTQ's float32 working copies (weights, results, scales and inverse
  factors of linears of one shape, at most 1 GiB unless one linear alone is larger; with
  ``gptq_inputs: quantized`` plus the input-aware targets of every linear of that shape).
* ``calibrate.algorithm: awq`` (``awq_bytes``): one decoder layer at a time, the ``X^T X``
  of each quantized consumer's input (float64, twice: the sums and the all-reduce's buffer):
  q/k/v share the input norm's (``hidden^2``), a dense MLP's gate/up the MLP norm's, o_proj
  and every down_proj their own (``in^2``), an expert's gate/up one ``hidden^2`` and its down
  one ``inter^2`` (this rank's experts only); plus the layer inputs and outputs of this
  rank's samples (as gptq), one layer's quantized weights copied (the outputs pass quantizes
  them in place and puts them back), one candidate's error work for the largest weight
  (``2 x out x in`` float64) and the per-channel statistics (the sums of ``|x|``, and where
  inputs are quantized each candidate's input errors: ``grid x width`` int64 per site).
* ``export``: no model on the device; per rank, at most 2 x the largest tensor + 256 MiB of
  memory (the export's documented bound), and its share of the reads.

``peak_bytes`` adds parameters, transient, activations kept and the forward's working set
(``forward_bytes``, the one estimate here), plus ``SLACK_BYTES`` for what a
command allocates besides (allocator rounding, kernels' workspaces).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from qckpt.plan.reads import Reads
from qckpt.plan.tensors import Held

SLACK_BYTES = 64 << 20
EXPORT_SLACK_BYTES = 256 << 20
# The export's host memory, fitted to measured exports (anonymous RSS, torch 2.13 on Linux
# x86-64): on the CPU, tiny Qwen3-MoE dirs of 1,575 and 6,291 source tensors (176.3 and
# 227.1 MiB: 11.0 KiB per tensor over a 159 MiB process) and the tiny MoE's DCP (+44 MiB of
# torch.distributed.checkpoint); on the H200, the 48-layer Qwen3-30B-A3B shape (1.77 GiB, of
# which 2 x 594 MiB in flight and 18,867 tensors' plans: the rest, 188 MiB, is CUDA's host
# side, with transformers' modeling code then imported too: 74 MiB on the CPU).
EXPORT_BASE_ANON_BYTES = 159 << 20
EXPORT_DCP_ANON_BYTES = 44 << 20
EXPORT_TENSOR_ANON_BYTES = 11 << 10
EXPORT_CUDA_ANON_BYTES = 188 << 20


@dataclass(kw_only=True)
class RankFigures:
    """One command on one rank. Bytes; ``fits`` is None when no device memory was given."""

    command: str
    rank: int
    parameter_bytes: int  # on the device, for the whole command
    transient_bytes: int
    activation_bytes: int  # kept on the device between layers (offload)
    bytes_read: int
    forward_bytes: int = 0  # one batch's forward working set (an estimate, see forward_bytes)
    gptq_bytes: int = 0  # calibrate.algorithm gptq: one layer's Hessians and the layer I/O
    awq_bytes: int = 0  # calibrate.algorithm awq: the layer I/O, one layer's weights, its search
    host_bytes: int = 0  # host memory the command holds beyond the page cache
    peak_bytes: int = 0
    fits: bool | None = None
    slack_bytes: int = SLACK_BYTES  # what the command allocates besides (see the module doc)
    refused: str | None = None  # the command's own refusal of this layout (a split block)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def judge(self, device_bytes: int | None, host_share: int | None = None) -> RankFigures:
        """Peak and fit: ``device_bytes`` of one GPU; ``host_share`` (when given) the host
        memory one rank may take (a node's divided by its ranks)."""
        self.peak_bytes = (
            self.parameter_bytes
            + self.transient_bytes
            + self.activation_bytes
            + self.forward_bytes
            + self.gptq_bytes
            + self.awq_bytes
            + self.slack_bytes
        )
        self.fits = None if device_bytes is None else self.peak_bytes <= device_bytes
        if self.fits and host_share is not None:
            self.fits = self.host_bytes <= host_share
        if self.refused:
            self.fits = False
        return self


def _read(reads: Reads | None, tensors: list[Held]) -> int:
    return 0 if reads is None else sum(reads.bytes_for(t) for t in tensors)


def _quantized(tensors: list[Held]) -> list[Held]:
    return [t for t in tensors if t.fmt is not None]


def load_figures(
    tensors: list[Held],
    reads: Reads | None,
    *,
    rank: int,
    stream: bool = True,
    main_params: bool = False,
    max_inflight: int = 1,
) -> RankFigures:
    """``qckpt load`` on one rank (``tensors`` built with ``load.params``)."""
    q = _quantized(tensors)
    scratch = sorted((t.nominal_bytes for t in q), reverse=True)
    # streaming: the max_inflight largest scratches may be live at once (one on the plain
    # reader); the bulk baseline dequantizes every quantized destination at once
    transient = sum(scratch[: max(1, max_inflight)] if stream else scratch)
    params = sum(t.nbytes for t in tensors)
    if main_params:
        params += sum(t.numel * 4 for t in q)
    return RankFigures(
        command="load",
        rank=rank,
        parameter_bytes=params,
        transient_bytes=transient,
        activation_bytes=0,
        bytes_read=_read(reads, tensors),
    )


@dataclass(frozen=True, kw_only=True)
class CalibShape:
    """What the forward's memory depends on, from the model config and the recipe."""

    hidden: int
    vocab: int
    intermediate: int  # the widest MLP (dense, or top-k experts' together)
    attn_width: int  # q + k + v + o widths
    itemsize: int
    seq_len: int
    batch_size: int
    ep: int
    top_k: int
    head_dim: int = 0


def forward_bytes(s: CalibShape) -> int:
    """An estimate of one calibration batch's forward working set on a rank: the residual
    stream and a layer's widest activations (attention or MLP), or the logits at the end,
    whichever is larger; under EP the experts' exchange gathers every EP rank's tokens."""
    tokens = s.batch_size * s.seq_len
    layer = tokens * (4 * s.hidden + max(s.attn_width, 3 * s.intermediate))
    if s.ep > 1:
        layer += s.ep * tokens * s.hidden * (2 + s.top_k)
    return max(layer, tokens * s.vocab) * s.itemsize


@dataclass(frozen=True, kw_only=True)
class Offload:
    """``calibrate.offload`` and what goes with it: where activations wait between layers
    (``calibrate.activations``), and the module outside the layers left off the device (the
    output embedding, unless a quantizer lives there: ``calib.layerwise``'s ``tail``)."""

    mode: str = "none"  # none | layer | host
    activations: str = "device"  # device | host
    head: str | None = None  # the output embedding's module name when it stays off
    out_emb: str | None = None  # the output embedding's module name
    # calibrate.algorithm gptq: a second pass over the layers, each fetched again (from the
    # checkpoint, or from host memory), with the modules outside them but the output embedding
    second_pass: bool = False

    @property
    def active(self) -> bool:
        """Whether weights wait off the device (``calibrate.offload`` other than none)."""
        return self.mode != Offload.mode


def _in_head(t: Held, off: Offload) -> bool:
    return off.head is not None and t.name.startswith(off.head + ".")


def _offload_params(tensors: list[Held], off: Offload) -> tuple[int, int]:
    """(device bytes at most, host bytes) of layer-by-layer calibration: the weights outside the
    decoder layers, plus two adjacent layers (one running, the next one being fetched)."""
    per_layer: dict[int, int] = {}
    outside = 0
    for t in tensors:
        if t.layer is not None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + t.nbytes
        elif not _in_head(t, off):
            outside += t.nbytes
    sizes = [per_layer[i] for i in sorted(per_layer)]
    pair = max((a + b for a, b in zip(sizes, sizes[1:], strict=False)), default=0)
    peak = max([pair, *sizes]) if sizes else 0
    return outside + peak, (sum(sizes) if off.mode == "host" else 0)


def calibrate_figures(
    tensors: list[Held],
    reads: Reads | None,
    shape: CalibShape,
    *,
    rank: int,
    samples: int,
    offload: Offload | None = None,
    max_inflight: int = 1,
) -> RankFigures:
    """``qckpt calibrate`` on one rank (``tensors`` built with the resident format, or plain);
    ``samples``: this rank's share of the calibration samples."""
    off = offload or Offload()
    # quantized-resident: the load's scratches (the largest quantized destinations), then one
    # linear or expert dequantized at a time in the forward, never more than a scratch
    scratch = sorted((t.nominal_bytes for t in _quantized(tensors)), reverse=True)
    transient = sum(scratch[: max(1, max_inflight)])
    host = activations = 0
    read = tensors
    if not off.active:
        params = sum(t.nbytes for t in tensors)
        forward = forward_bytes(shape)
    else:
        params, host = _offload_params(tensors, off)
        # one batch through one layer (no logits: the head runs only when it is calibrated)
        # with the rotary tables the layers take; the layer outputs of this rank's samples
        forward = forward_bytes(replace(shape, vocab=shape.vocab if off.head is None else 0))
        forward += 2 * shape.batch_size * shape.seq_len * shape.head_dim * shape.itemsize
        kept = samples * shape.seq_len * shape.hidden * shape.itemsize
        if off.activations == "host":
            host += kept
        else:
            activations = kept
        read = [t for t in tensors if not _in_head(t, off)]  # the head is never fetched
        if off.second_pass:
            emb = replace(off, head=off.out_emb)
            again = [t for t in tensors if not _in_head(t, emb)]
            read = read + (again if off.mode == "layer" else [t for t in again if t.layer is None])
    return RankFigures(
        command="calibrate",
        rank=rank,
        parameter_bytes=params,
        transient_bytes=transient,
        activation_bytes=activations,
        forward_bytes=forward,
        bytes_read=_read(reads, read),
        host_bytes=host,
    )


def _quantized_linears(tensors: list[Held], ignored) -> Iterator[tuple[Held, str]]:
    """Each decoder layer's quantized linear weight on a rank and its module name: what the
    layer-by-layer algorithms keep statistics for (routers and anything ``ignored`` take none)."""
    for t in tensors:
        if t.layer is None or not t.name.endswith(("weight", "_proj")) or len(t.shape) < 2:
            continue
        module = t.name.rpartition(".")[0]
        if not ignored(module) and not module.endswith((".mlp.gate", ".router")):
            yield t, module


def gptq_hessian_bytes(tensors: list[Held], ignored=lambda name: False, cross=False) -> int:
    """The largest layer's Hessian bytes (float64) on a rank holding ``tensors``: one per
    quantized linear of the layer, ``in^2`` (experts: per local expert, gate and up sharing
    one); routers and anything ``ignored`` (its module name) take none. ``cross``
    (``calibrate.gptq_inputs: quantized``): a second ``in^2`` beside each, the sums ``C``."""
    per_layer: dict[int, int] = {}
    for t, _ in _quantized_linears(tensors, ignored):
        if len(t.shape) == 3:  # fused experts [E, out, in]: one Hessian of in^2 per expert
            n = t.shape[0] * t.shape[2] ** 2
        else:
            n = t.shape[1] ** 2
        per_layer[t.layer] = per_layer.get(t.layer, 0) + (16 if cross else 8) * n
    return max(per_layer.values(), default=0)


def gptq_stack_bytes(tensors: list[Held], ignored=lambda name: False, cross=False) -> int:
    """The largest batch of GPTQ's working copies on a rank (``qckpt.calib.gptq.stack_bytes``
    of each layer's linears: an expert's fused gate/up is two linears of half its rows);
    ``cross``: with the input-aware targets (``calibrate.gptq_inputs: quantized``)."""
    from qckpt.calib.gptq import stack_bytes

    per_layer: dict[int, list[tuple[int, int]]] = {}
    for t, _ in _quantized_linears(tensors, ignored):
        shapes = per_layer.setdefault(t.layer, [])
        if len(t.shape) == 3:
            e, rows, cols = t.shape
            fused = "gate_up" in t.name
            shapes += [(rows // 2 if fused else rows, cols)] * (e * (2 if fused else 1))
        else:
            shapes.append((t.shape[0], t.shape[1]))
    return max((stack_bytes(v, cross) for v in per_layer.values()), default=0)


def gptq_bytes(
    tensors: list[Held], shape: CalibShape, samples: int, ignored, cross: bool = False
) -> int:
    """What ``calibrate.algorithm: gptq`` adds on a rank (see the module doc); ``cross``:
    ``calibrate.gptq_inputs: quantized`` (``C`` beside each Hessian)."""
    io = 2 * samples * shape.seq_len * shape.hidden * shape.itemsize
    hess = gptq_hessian_bytes(tensors, ignored, cross)
    return 2 * hess + io + gptq_stack_bytes(tensors, ignored, cross)


def _awq_site(module: str) -> str:
    """The input whose ``X^T X`` a dense linear's AWQ loss takes (see the module doc)."""
    parent, _, leaf = module.rpartition(".")
    layer, _, block = parent.rpartition(".")
    if block == "self_attn" and leaf != "o_proj":
        return f"{layer}.input_layernorm"
    if block == "mlp" and leaf != "down_proj":
        return f"{layer}.post_attention_layernorm"
    return module


def _awq_layer_sites(tensors: list[Held], ignored) -> dict[int, dict[str, tuple[int, int]]]:
    """Per decoder layer, awq's input sites: name -> (how many: experts, width)."""
    per_layer: dict[int, dict[str, tuple[int, int]]] = {}
    for t, module in _quantized_linears(tensors, ignored):
        sites = per_layer.setdefault(t.layer, {})
        if len(t.shape) == 3:  # fused experts [E, out, in]: one per expert and side
            sites[t.name] = (t.shape[0], t.shape[2])
        else:
            sites[_awq_site(module)] = (1, t.shape[1])
    return per_layer


def awq_hessian_bytes(tensors: list[Held], ignored=lambda name: False) -> int:
    """The largest layer's ``X^T X`` bytes (float64) of ``calibrate.algorithm: awq`` on a rank
    holding ``tensors``; routers and anything ``ignored`` take none."""
    per_layer = _awq_layer_sites(tensors, ignored)
    return max((8 * sum(n * d * d for n, d in s.values()) for s in per_layer.values()), default=0)


def awq_bytes(tensors: list[Held], shape: CalibShape, samples: int, ignored, grid: int) -> int:
    """What ``calibrate.algorithm: awq`` adds on a rank (see the module doc)."""
    io = 2 * samples * shape.seq_len * shape.hidden * shape.itemsize
    layer_numel: dict[int, int] = {}
    largest = 0
    for t, _ in _quantized_linears(tensors, ignored):
        layer_numel[t.layer] = layer_numel.get(t.layer, 0) + t.numel
        largest = max(largest, t.shape[-2] * t.shape[-1])
    copies = max(layer_numel.values(), default=0) * shape.itemsize
    # per site and candidate, the input errors per channel (int64, and the exchange's buffer)
    per_layer = _awq_layer_sites(tensors, ignored)
    widths = max((sum(n * d for n, d in s.values()) for s in per_layer.values()), default=0)
    stats = 16 * widths + 2 * 8 * grid * widths
    return io + 2 * awq_hessian_bytes(tensors, ignored) + copies + 16 * largest + stats


def export_host_bytes(*, largest: int, tensors: int, dcp: bool, cuda: bool) -> int:
    """The export's whole-process peak of anonymous host memory (what ``host_peak_anon_bytes``
    measures, what a host is sized by): the process itself, its plan (per source tensor), and
    what its pipeline holds in flight, two of the largest tensor (``qckpt.export.stages``)."""
    return (
        EXPORT_BASE_ANON_BYTES
        + (EXPORT_DCP_ANON_BYTES if dcp else 0)
        + (EXPORT_CUDA_ANON_BYTES if cuda else 0)
        + tensors * EXPORT_TENSOR_ANON_BYTES
        + 2 * largest
    )


def export_figures(
    *,
    rank: int,
    largest: int,
    bytes_read: int,
    tensors: int = 0,
    dcp: bool = False,
    cuda: bool = False,
) -> RankFigures:
    """``qckpt export`` on one rank: ``largest`` is the largest source tensor's value bytes,
    ``tensors`` how many the source has. The export holds no model: on the host, the process
    and its plan and pipeline (:func:`export_host_bytes`); on a GPU, where it quantizes there,
    two tensors at a time (the transient)."""
    return RankFigures(
        command="export",
        rank=rank,
        parameter_bytes=0,
        transient_bytes=2 * largest,
        activation_bytes=0,
        bytes_read=bytes_read,
        host_bytes=export_host_bytes(largest=largest, tensors=tensors, dcp=dcp, cuda=cuda),
    )


def split_evenly(total: int, world: int, rank: int) -> int:
    """Rank ``rank``'s share of ``total`` bytes split over ``world`` ranks."""
    base = total // world
    return base + (1 if rank < total - base * world else 0)


def rank_samples(num_samples: int, batch_size: int, data_rank: int, data_world: int) -> int:
    """Samples a data rank calibrates on: batches dealt round-robin (``calib.data``)."""
    n_batches = math.ceil(num_samples / batch_size)
    total = 0
    for i in range(data_rank, n_batches, data_world):
        total += min(batch_size, num_samples - i * batch_size)
    return total
