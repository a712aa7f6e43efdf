"""Calibration algorithms as registered objects: ``max``, ``mse``, ``gptq``, ``awq``.

Each is a ``@dataclass(kw_only=True)`` of its own options, with what it needs stated once
(:attr:`Algorithm.offload`: the ``calibrate.offload`` modes it runs with; :attr:`Algorithm.tp`:
whether it runs with ``parallel.tp > 1``) and its steps inside
:func:`qckpt.calib.calibrate.calibrate_model`: :meth:`~Algorithm.before` the max calibration
(awq folds its scales first), :meth:`~Algorithm.after` the amax sync (mse's search, gptq's
pass) and :meth:`~Algorithm.apply`, what it found into the file's state and the report.
``calibrate_model`` dispatches through the object; adding an algorithm is a class here,
registered with :func:`register`. :func:`algorithm_from` builds one from a recipe's
``calibrate`` section (``qckpt.recipe`` sits below calib and cannot).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from qckpt import phases
from qckpt.errors import CalibrationError, SchemeError

ALGORITHMS: dict[str, type[Algorithm]] = {}
# calibrate.mse_weighting: what a searched scale's squared errors are weighted with
WEIGHTINGS = ("none", "hessian")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` the algorithm ``cls.name``."""
    ALGORITHMS[cls.name] = cls
    return cls


@dataclass(kw_only=True)
class Algorithm:
    name: ClassVar[str] = ""
    # the calibrate.offload modes it runs with, and whether it runs with TP shards
    offload: ClassVar[tuple[str, ...]] = ("none", "layer", "host")
    tp: ClassVar[bool] = False
    # the weights it writes beside the calibration file (its sidecar's suffix; "" for none)
    sidecar: ClassVar[str] = ""

    @classmethod
    def from_config(cls, c: Any, input_dtype: torch.dtype) -> Algorithm:  # noqa: ARG003
        """This algorithm with the options of a recipe's ``calibrate`` section."""
        return cls()

    def check(self, mesh: Any, runner: Any) -> None:
        """A config this algorithm cannot run, in one line (the same on every rank)."""
        # a TP shard is part of a weight whose error is the whole tensor's; mse's and awq's
        # searches read every weight of the model at once (gptq's runs one layer at a time)
        if not self.tp and mesh.tp > 1:
            raise CalibrationError(
                f"calibrate.algorithm: {self.name} runs with parallel.tp: 1 (got tp {mesh.tp})"
            )
        if runner is not None and "layer" not in self.offload:
            raise CalibrationError(
                f"calibrate.algorithm: {self.name} runs with calibrate.offload: none "
                "(max and gptq run one layer at a time)"
            )

    def refuses(self, scheme: Any) -> str | None:
        """Why this algorithm cannot quantize weights of ``scheme`` (None: it can)."""
        return None

    def check_schemes(self, schemes: list[Any]) -> None:
        """A weight scheme this algorithm cannot quantize, in one line, before any work."""
        for s in schemes:
            why = self.refuses(s) if s.quantized else None
            if why:
                raise SchemeError(f"calibrate.algorithm: {self.name} {why}")

    def before(self, model, instr, batches, mesh, parts: dict) -> tuple[Any, float]:  # noqa: ANN001
        """Its pass before the max calibration: (its result or None, its seconds)."""
        return None, 0.0

    def after(self, model, instr, batches, mesh, mine, parts: dict, runner) -> Any:  # noqa: ANN001
        """Its pass after the amax sync (None: nothing)."""
        return None

    def apply(self, res, state, report: dict, model, instr, mesh) -> None:  # noqa: ANN001
        """What it found, into the file's state and the report's layers."""
        state.algorithm = report["algorithm"] = self.name


@register
@dataclass(kw_only=True)
class Max(Algorithm):
    """amax = max |x|: the forwards and the sync, nothing after."""

    name: ClassVar[str] = "max"
    tp: ClassVar[bool] = True


@register
@dataclass(kw_only=True)
class Mse(Algorithm):
    """Weight and static-input scales searched for the least quantization error
    (:mod:`qckpt.calib.mse_pass`); the forwards unchanged."""

    name: ClassVar[str] = "mse"
    offload: ClassVar[tuple[str, ...]] = ("none",)
    # integer scales as the export stores them (compressed-tensors: the model dtype)
    scale_dtype: torch.dtype = torch.float32
    # none: each weight error is sum (w - q)**2; hessian: sum_j H_jj (w_j - q_j)**2 with the
    # input's H_jj (qckpt.calib.hdiag), two more forwards
    weighting: str = "none"

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise CalibrationError(
                f"calibrate.mse_weighting: {self.weighting!r} is not one of {', '.join(WEIGHTINGS)}"
            )

    def refuses(self, scheme: Any) -> str | None:
        # the clip search is over symmetric scales: a zero point moves both ends of a group
        if not scheme.symmetric:
            return f"does not search {scheme.describe()} (its clips are symmetric)"
        return None

    @classmethod
    def from_config(cls, c: Any, input_dtype: torch.dtype) -> Algorithm:
        return cls(scale_dtype=input_dtype, weighting=c.mse_weighting)

    def after(self, model, instr, batches, mesh, mine, parts, runner):  # noqa: ANN001
        from qckpt.calib.mse_pass import run_mse

        weights = None
        if self.weighting == "hessian":
            from qckpt.calib.hdiag import input_weights

            t0 = time.perf_counter()
            with paused(instr):  # its forwards fold nothing into the amaxes
                weights = input_weights(model, instr, batches, mesh)
            parts["mse_hessian"] = time.perf_counter() - t0
        res = run_mse(model, instr, batches, mesh, mine, self.scale_dtype, weights)
        parts.update(res.parts)
        return res

    def apply(self, res, state, report, model, instr, mesh) -> None:  # noqa: ANN001

        super().apply(res, state, report, model, instr, mesh)
        add_search(state, report, res)


@register
@dataclass(kw_only=True)
class Gptq(Algorithm):
    """Weights quantized layer by layer with GPTQ's error compensation
    (:mod:`qckpt.calib.gptq_pass`); their values go to the ``.gptq`` sidecar."""

    name: ClassVar[str] = "gptq"
    sidecar: ClassVar[str] = ".gptq"
    percdamp: float = 0.01
    act_order: bool = False
    block: int = 128
    block_scales: str = "max"  # NVFP4 group scales: max rule or searched (mse)
    # the searched group scales' errors unweighted (none) or weighted per column by GPTQ's own
    # loss weight 1 / U_jj**2 (hessian; U the upper Cholesky factor of H^-1)
    block_weighting: str = "none"
    inputs: str = "source"  # source | quantized (each module's input scheme)
    input_dtype: torch.dtype = torch.float32  # static FP8 input scales as stored
    stream: Any = None  # calibrate.offload: the sidecar writer (gptq_pass.streamed_sidecar)

    def refuses(self, scheme: Any) -> str | None:
        if not (scheme.mx or (scheme.integer and scheme.granularity == "group")):
            return None
        # each group's scale is made from the group's current columns as the sweep reaches it
        g = scheme.group if scheme.mx else scheme.block[1]
        if self.block % g:
            return (
                f"with {scheme.name} groups of {g}: calibrate.gptq_block ({self.block}) must be a "
                "multiple"
            )
        if self.act_order and scheme.mx:
            return (
                f"act-order with {scheme.name} groups of {g} is not written yet (groups run in "
                "order)"
            )
        return None

    @classmethod
    def from_config(cls, c: Any, input_dtype: torch.dtype) -> Algorithm:
        return cls(
            percdamp=c.gptq_percdamp, act_order=c.gptq_act_order, block=c.gptq_block,
            block_scales=c.gptq_block_scales, inputs=c.gptq_inputs, input_dtype=input_dtype,
            block_weighting=c.mse_weighting,
        )  # fmt: skip

    def options(self):  # noqa: ANN201 - a gptq_pass.GptqOptions
        from qckpt.calib.gptq_pass import GptqOptions

        return GptqOptions(
            percdamp=self.percdamp, act_order=self.act_order, block=self.block,
            block_search=self.block_scales == "mse", inputs=self.inputs,
            block_weighted=self.block_weighting == "hessian",
            input_dtype=self.input_dtype, sidecar=self.stream,
        )  # fmt: skip

    def after(self, model, instr, batches, mesh, mine, parts, runner):  # noqa: ANN001
        from qckpt.calib.gptq_pass import run_gptq
        from qckpt.calib.instrument import settle

        with paused(instr) as on:
            res = run_gptq(model, instr, batches, mesh, self.options(), on, runner)
            settle(model)
        parts.update(res.parts)
        return res

    def apply(self, res, state, report, model, instr, mesh) -> None:  # noqa: ANN001
        from qckpt.calib.gptq_pass import tensors_to_write

        super().apply(res, state, report, model, instr, mesh)
        state.weights = tensors_to_write(model, instr, mesh, res)
        for layer, row in res.layers.items():
            report["layers"].setdefault(layer, {})["gptq"] = row
        report["gptq_hessian_bytes"] = res.hessian_bytes
        report["gptq_hessian_bytes_bound"] = res.hessian_bytes_bound
        report["gptq_stack_bytes"] = res.stack_bytes
        report["gptq_inputs"] = res.inputs


@register
@dataclass(kw_only=True)
class Awq(Algorithm):
    """Per-input-channel scales searched per layer group and folded into the norms / linears
    before them (:mod:`qckpt.calib.awq_pass`), before the max calibration; the folded weights
    go to the ``.awq`` sidecar."""

    name: ClassVar[str] = "awq"
    offload: ClassVar[tuple[str, ...]] = ("none",)
    sidecar: ClassVar[str] = ".awq"
    grid: int = 20
    scales: str = "float"  # float | pow2

    @classmethod
    def from_config(cls, c: Any, input_dtype: torch.dtype) -> Algorithm:  # noqa: ARG003
        return cls(grid=c.awq_grid, scales=c.awq_scales)

    def before(self, model, instr, batches, mesh, parts):  # noqa: ANN001
        from qckpt.calib.awq_pass import AwqOptions, run_awq
        from qckpt.calib.instrument import settle

        t0 = time.perf_counter()
        opts = AwqOptions(grid=self.grid, pow2=self.scales == "pow2")
        with phases.phase(phases.ALGORITHM), paused(instr) as on:
            res = run_awq(model, instr, batches, mesh, opts, on)
            settle(model)
        parts.update(res.parts)
        return res, time.perf_counter() - t0

    def apply(self, res, state, report, model, instr, mesh) -> None:  # noqa: ANN001
        from qckpt.calib.awq_pass import tensors_to_write

        super().apply(res, state, report, model, instr, mesh)
        state.weights = tensors_to_write(model, res, mesh)
        for layer, row in res.layers.items():
            report["layers"].setdefault(layer, {})["awq"] = row
        report["awq_stat_bytes"] = res.stat_bytes
        report["awq_hessian_bytes"] = res.hessian_bytes
        report["awq_hessian_bytes_bound"] = res.hessian_bytes_bound


@contextlib.contextmanager
def paused(instr):
    """The quantizers not observing while an algorithm's own forwards run (they see folded or
    quantized layers; the amaxes are the max pass's), the report's token counts put back after.
    Yields the ids of the enabled quantizers."""
    tokens = [list(info.tokens) for info in instr.experts]
    qs = list(instr.quantizers.values())
    was = [q.__dict__["_enabled"] for q in qs]
    on = {id(q) for q, w in zip(qs, was, strict=True) if w}
    segs = [s for mod in instr.patched for s in (mod.forward.observer.gate_up,
                                                  mod.forward.observer.down)]  # fmt: skip
    seg_was = [s.enabled for s in segs]
    for q in qs:
        q.__dict__["_enabled"] = False  # not the setter: the layout did not change
    for s in segs:
        s.enabled = False
    try:
        yield on
    finally:
        for q, w in zip(qs, was, strict=True):
            q.__dict__["_enabled"] = w
        for s, w in zip(segs, seg_was, strict=True):
            s.enabled = w
        for info, t in zip(instr.experts, tokens, strict=True):
            info.tokens[:] = t


def add_search(state: Any, report: dict[str, Any], searched) -> None:
    """The searched clips into the file (beside the amaxes) and, per layer, into the report:
    how many clips, their ratio to max calibration's amax (min / max), the weights searched
    without a clip (``searched_blocks``: MX), the summed loss at max and at the choice
    (weights: squared error; inputs: estimated from the histogram)."""
    from qckpt.calib.mse_pass import clip_state

    amax, desc = clip_state(searched)
    state.amax.update(amax)
    state.quantizers.update(desc)
    layers = report["layers"]
    for key in [*amax, *searched.blocks]:
        clip = amax.get(key)
        base = state.amax.get(key.replace("_clip_amax", "_amax"))
        row = layers.setdefault(layer_of(key), {}).setdefault(
            "mse", {"clips": 0, "ratio_min": None, "ratio_max": None, "loss_max": 0.0,
                    "loss_mse": 0.0},
        )  # fmt: skip
        if clip is None:  # MX: its blocks' exponents searched, nothing clipped
            row["searched_blocks"] = row.get("searched_blocks", 0) + 1
        else:
            row["clips"] += 1
        if clip is not None and base is not None and float(base.max()) > 0:
            ratio = clip.reshape(-1) / base.reshape(-1).clamp_min(1e-30)
            lo, hi = float(ratio.min()), float(ratio.max())
            row["ratio_min"] = lo if row["ratio_min"] is None else min(row["ratio_min"], lo)
            row["ratio_max"] = hi if row["ratio_max"] is None else max(row["ratio_max"], hi)
        before, after = searched.losses.get(key, (0.0, 0.0))
        row["loss_max"] += before
        row["loss_mse"] += after


_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def layer_of(name: str) -> str:
    """The decoder layer a module name is inside (the report's rows), or the name itself."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def algorithm_named(name: str | Algorithm, **options: Any) -> Algorithm:
    """The algorithm ``name`` with ``options`` (an :class:`Algorithm` is returned as it is)."""
    if isinstance(name, Algorithm):
        return name
    cls = ALGORITHMS.get(name)
    if cls is None:
        raise CalibrationError(
            f"calibrate.algorithm: {name!r} is not one of {', '.join(ALGORITHMS)}"
        )
    return cls(**options)


def algorithm_from(c: Any, input_dtype: torch.dtype = torch.float32) -> Algorithm:
    """The algorithm of a recipe's ``calibrate`` section (its YAML keys as they are);
    ``input_dtype``: the dtype static FP8 input scales are stored in (gptq's quantized inputs)."""
    algorithm_named(c.algorithm)  # an unknown name: the one-line error
    return ALGORITHMS[c.algorithm].from_config(c, input_dtype)
