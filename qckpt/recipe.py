"""The YAML recipe: one small dataclass per section, validated where it is built.

Every validation error is a :class:`RecipeError` whose message starts with the YAML path of the
offending key (``parallel.ep: must divide the world size 3``), so a user can find it at once.
``--set a.b=c`` overrides are applied to the raw mapping before validation, with the value parsed
as YAML (``--set load.stream=false`` gives a bool).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from qckpt.errors import RecipeError
from qckpt.recipe_yaml import read_yaml_file, safe_parse, show

# numeric bounds every recipe value is checked against (a value past them is a typo or an attack,
# never a setting: it would overflow a C integer, a timedelta or the memory of the machine)
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
FLOAT_MAX = 1e300
SEED_MAX = 2**64 - 1  # torch.manual_seed takes a uint64 (or a negative int64, which we refuse)
TIMEOUT_RANGE_S = (1.0, 7 * 86400.0)
MAX_SHARD_BYTES = 2**40
MAX_SAMPLES = 10**7
MAX_SEQ_LEN = 2**20
MAX_INFLIGHT = 64  # scratches live at once on the fast reader; past this it is memory, not speed
MAX_CALIB_TOKENS = 2**31  # num_samples * seq_len: the synthetic set is allocated whole


@dataclass(kw_only=True)
class ModelConfig:
    source: str = "tiny-moe"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0

    def validate(self, path: str) -> None:
        _in_range(f"{_join(path, 'seed')}", self.seed, 0, SEED_MAX, "0 .. 2**64-1")


@dataclass(kw_only=True)
class CheckpointConfig:
    path: str = "runs/tiny/dcp"
    # megatron / torchtitan: a training framework's DCP dir, mapped onto model.source's HF names
    format: Literal["auto", "dcp", "safetensors", "megatron", "torchtitan"] = "auto"


@dataclass(kw_only=True)
class LoadConfig:
    params: Literal["none", "fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"] = "fp8"
    backend: Literal["native", "te"] = "native"
    stream: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    main_params: Literal["none", "fp32"] = "none"
    # the storage reader: fast (parallel reads overlapped with the quantize) or plain (DCP's
    # per-item reader, the fallback and the A/B baseline); both give the same values
    reader: Literal["fast", "plain"] = "fast"
    # quantized destinations whose scratch may be live at once on the fast reader: the load's
    # transient is at most max_inflight x 2*max(numel) (BF16). Default 1: the whole command then
    # stays within the FP8 model + one scratch + 64 MiB (measured on the H200: 2 read 23 % faster,
    # one scratch over that bound)
    max_inflight: int = 1

    def validate(self, path: str) -> None:
        _in_range(
            f"{_join(path, 'max_inflight')}",
            self.max_inflight,
            1,
            MAX_INFLIGHT,
            f"1 .. {MAX_INFLIGHT}",
        )


@dataclass(kw_only=True)
class TensorQuantConfig:
    # the registered schemes (qckpt.formats.scheme); none: left in the model dtype (inputs: a
    # weight-only linear)
    format: Literal["fp8", "nvfp4", "mxfp4", "mxfp8", "int4", "int8", "none"] = "fp8"
    # group: int4's scale per block_size[-1] columns of a row
    granularity: Literal["tensor", "channel", "block", "group"] = "tensor"
    block_size: list[int] = field(default_factory=lambda: [128, 128])
    dynamic: bool = False
    # false: a zero point per group beside its scale (int4 group weights; compressed-tensors'
    # asymmetric quantization args)
    symmetric: bool = True

    def validate(self, path: str) -> None:
        if len(self.block_size) not in (1, 2) or any(b <= 0 for b in self.block_size):
            raise RecipeError(f"{path}.block_size: must be one or two positive integers")
        # the one place a short spelling is read: ``[b]`` is a b x b block, what the export
        # layouts and serving stacks assume; everything downstream sees two numbers
        if len(self.block_size) == 1:
            self.block_size = [self.block_size[0], self.block_size[0]]


@dataclass(kw_only=True)
class SchemeConfig:
    """One entry of ``quant.schemes``: the linears it quantizes (fnmatch globs of module names,
    as ``save_pretrained`` names them: per-expert names for MoE) and how."""

    targets: list[str] = field(default_factory=list)
    weights: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    inputs: TensorQuantConfig = field(default_factory=TensorQuantConfig)

    def validate(self, path: str) -> None:
        if not self.targets:
            raise RecipeError(f"{path}.targets: name at least one module glob")
        for i, t in enumerate(self.targets):
            if not t.strip():
                raise RecipeError(f"{path}.targets[{i}]: an empty glob")
        self.weights.validate(f"{path}.weights")
        self.inputs.validate(f"{path}.inputs")
        _check_inputs(self.inputs, f"{path}.inputs")


def _check_inputs(inputs: TensorQuantConfig, path: str) -> None:
    if inputs.granularity in ("channel", "group"):
        raise RecipeError(
            f"{path}.granularity: inputs take tensor or block, not {inputs.granularity}"
        )


@dataclass(kw_only=True)
class QuantConfig:
    weights: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    inputs: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    ignore: list[str] = field(default_factory=lambda: ["lm_head", "*.mlp.gate"])
    kv_cache: bool = False
    # several schemes in one export, instead of weights / inputs: the first entry whose targets
    # match a linear quantizes it, a linear no entry matches stays in the model dtype (as one
    # that ``ignore`` matches does; ``ignore`` still applies first)
    schemes: list[SchemeConfig] = field(default_factory=list)

    @staticmethod
    def validate_raw(raw: dict, path: str) -> None:
        if raw.get("schemes") and ({"weights", "inputs"} & set(raw)):
            both = "weights" if "weights" in raw else "inputs"
            raise RecipeError(
                f"{path}.{both}: give either {path}.schemes or {path}.weights / {path}.inputs, "
                "not both"
            )

    def validate(self, path: str) -> None:
        self.weights.validate(f"{path}.weights")
        self.inputs.validate(f"{path}.inputs")
        _check_inputs(self.inputs, f"{path}.inputs")
        for i, sc in enumerate(self.schemes):
            # built (and validated) by the loader already; a library caller's list is checked too
            sc.validate(f"{path}.schemes[{i}]")

    @property
    def mixed(self) -> bool:
        """Whether this recipe says several schemes (``quant.schemes``)."""
        return bool(self.schemes)

    def entries(self) -> list[SchemeConfig]:
        """The schemes in match order; the one-scheme shorthand is one entry matching all."""
        if self.schemes:
            return list(self.schemes)
        return [SchemeConfig(targets=["*"], weights=self.weights, inputs=self.inputs)]

    def entry_index(self, module: str) -> int | None:
        """The index into :meth:`entries` of the scheme that quantizes ``module`` (a module
        name as the checkpoint names it), or None: left in the model dtype."""
        if any(fnmatch.fnmatchcase(module, p) for p in self.ignore):
            return None
        for i, sc in enumerate(self.entries()):
            if any(fnmatch.fnmatchcase(module, p) for p in sc.targets):
                return i
        return None

    def single(self, entry: SchemeConfig) -> QuantConfig:
        """A one-scheme QuantConfig of ``entry`` (no ignore list: the caller matched already)."""
        return QuantConfig(
            weights=entry.weights, inputs=entry.inputs, ignore=[], kv_cache=self.kv_cache
        )

    def for_module(self, module: str) -> QuantConfig | None:
        """The one-scheme QuantConfig quantizing ``module``, or None (model dtype)."""
        i = self.entry_index(module)
        return None if i is None else self.single(self.entries()[i])

    def record(self) -> dict:
        """What a calibration file records of this config (``schemes`` only when given, so a
        one-scheme recipe's record is what it was before schemes existed)."""
        d = dataclasses.asdict(self)
        if not self.schemes:
            d.pop("schemes")
        # symmetric sides record what they did before zero points existed
        sides = [d["weights"], d["inputs"]]
        sides += [x for sc in d.get("schemes", []) for x in (sc["weights"], sc["inputs"])]
        for side in sides:
            if side.get("symmetric", True):
                side.pop("symmetric", None)
        return d


@dataclass(kw_only=True)
class DataConfig:
    source: Literal["synthetic", "text", "tokens", "dataset"] = "synthetic"
    path: str | None = None
    # source: dataset (local only): a ``datasets`` save_to_disk dir, or JSONL / Parquet / Arrow
    # files (a file or a dir of them). column: "text" (plain text) or "messages" (chat turns,
    # rendered with the model's chat template); unset: whichever of the two the data has
    column: str | None = None
    split: str = "train"  # of a save_to_disk DatasetDict
    shuffle_seed: int | None = None  # rows shuffled with this seed before use; unset: in order
    # true: the samples' tokens concatenated and cut into seq_len pieces; false: each sample
    # truncated to seq_len (samples shorter than seq_len are skipped)
    pack: bool = True
    num_samples: int = 64
    seq_len: int = 128
    batch_size: int = 4
    # a path holding fewer than num_samples samples: calibrate on what it holds and say so in
    # the report (false), or refuse (true)
    strict: bool = False

    def validate(self, path: str) -> None:
        for name, hi in (
            ("num_samples", MAX_SAMPLES),
            ("seq_len", MAX_SEQ_LEN),
            ("batch_size", MAX_SAMPLES),
        ):
            value = getattr(self, name)
            if value <= 0:
                raise RecipeError(f"{path}.{name}: must be positive, got {value}")
            _in_range(f"{path}.{name}", value, 1, hi, f"1 .. {hi}")
        if self.num_samples * self.seq_len > MAX_CALIB_TOKENS:
            raise RecipeError(
                f"{path}.num_samples: num_samples * seq_len is {self.num_samples * self.seq_len}"
                f" tokens, more than {MAX_CALIB_TOKENS}"
            )
        if self.source != "synthetic" and not self.path:
            raise RecipeError(f"{path}.path: required when source is {self.source!r}")


@dataclass(kw_only=True)
class CalibrateConfig:
    data: DataConfig = field(default_factory=DataConfig)
    # max: amax = max |x|; mse: weight and static-input scales searched to minimise the
    # quantization error (qckpt/calib/mse.py), the forwards unchanged
    # gptq: weights quantized layer by layer with GPTQ's error compensation (gptq_* below)
    # awq: per-input-channel scales searched per layer group and folded into the norms / the
    # linears before them (awq_* below); the export is a plain quantized model
    algorithm: Literal["max", "mse", "gptq", "awq"] = "max"
    gptq_percdamp: float = 0.01  # dampening, a fraction of the Hessian's mean diagonal
    # columns in order of decreasing Hessian diagonal (FP8; INT4 groups: compressed-tensors'
    # actorder "weight", each group's scale (and zero point) from its columns before the sweep)
    gptq_act_order: bool = False
    gptq_block: int = 128  # columns per block of the error compensation
    # NVFP4 weights: each 16-column group's E4M3 scale by the max rule (max) or searched for
    # the least squared error of the group's current values (mse), as GPTQ reaches it
    gptq_block_scales: Literal["max", "mse"] = "max"
    # what a searched scale minimises (algorithm mse; gptq with gptq_block_scales: mse): the
    # plain squared weight error (none) or the output error's diagonal proxy (hessian):
    # sum_j H_jj (w_j - q_j)**2, H_jj the mean of x_j**2 over the linear's calibration inputs
    # (gptq: its own loss weight per column, 1 / [chol(H^-1)]_jj**2)
    mse_weighting: Literal["none", "hessian"] = "none"
    # the Hessians of each linear's inputs as they are (source), or as the export's clients
    # quantize them (quantized: GPTQ minimises |W X - Q Qa(X)|^2, W4A4's output error)
    gptq_inputs: Literal["source", "quantized"] = "source"
    awq_grid: int = 20  # exponents alpha searched: 0, 1/grid, ..., (grid - 1)/grid
    # the scales as they come (float: the folded weights rounded to BF16 once) or as powers of
    # two (pow2: the fold exact in BF16, the folded model computes the original's values; a
    # coarser search: on the shared Llama's NVFP4 weights it takes back less, QUALITY_ALGORITHMS)
    awq_scales: Literal["float", "pow2"] = "float"
    output: str = "runs/tiny/calib.safetensors"
    share_expert_inputs: bool = True
    # the format the weights are held in while calibrating: bf16 = the model's dtype; a quantized
    # one halves the parameter memory (weights dequantized one linear / expert at a time in the
    # forward; weight amax still taken from the checkpoint's values as they stream in)
    weights_resident: Literal["bf16", "fp8", "fp8_block", "mxfp8"] = "bf16"
    # where the weights wait while calibration runs: all on the device (none), on disk and
    # read one decoder layer at a time (layer), or in host memory (host, pinned under CUDA)
    offload: Literal["none", "layer", "host"] = "none"
    # with offload: where a layer's outputs (the next layer's inputs) are kept between layers
    activations: Literal["device", "host"] = "device"
    # the fused MoE experts' forward while calibrating: eager (one GEMM per expert, the values
    # of transformers' eager loop bit for bit), grouped (grouped GEMMs, several times faster
    # on a GPU; a GEMM kernel of its own may round differently: see docs/BENCHMARKS.md) or
    # auto: grouped where it gives eager's bits (checked once per process), else eager
    moe_forward: Literal["auto", "eager", "grouped"] = "auto"

    def validate(self, path: str) -> None:
        self.data.validate(f"{path}.data")
        if self.algorithm != "max" and self.weights_resident != "bf16":
            # the algorithms read each weight's own values, in the model's dtype
            raise RecipeError(
                f"{path}.algorithm: {self.algorithm} needs {path}.weights_resident: bf16 "
                f"(got {self.weights_resident})"
            )
        if self.algorithm in ("mse", "awq") and self.offload != "none":
            # their searches hold every weight of the model; gptq's goes one layer at a time
            raise RecipeError(
                f"{path}.algorithm: {self.algorithm} needs {path}.offload: none (got "
                f"{self.offload}; max and gptq run with offload)"
            )
        if self.mse_weighting != "none" and not (
            self.algorithm == "mse"
            or (self.algorithm == "gptq" and self.gptq_block_scales == "mse")
        ):
            # only a searched scale has errors to weigh
            raise RecipeError(
                f"{path}.mse_weighting: {self.mse_weighting} needs {path}.algorithm: mse, or gptq "
                f"with {path}.gptq_block_scales: mse (got {self.algorithm}"
                + (
                    f", gptq_block_scales {self.gptq_block_scales})"
                    if self.algorithm == "gptq"
                    else ")"
                )
            )
        if not 0.0 <= self.gptq_percdamp <= 1.0:
            raise RecipeError(f"{path}.gptq_percdamp: 0 .. 1, got {self.gptq_percdamp}")
        if not 1 <= self.gptq_block <= 1 << 16:
            raise RecipeError(f"{path}.gptq_block: 1 .. 65536, got {self.gptq_block}")
        if not 1 <= self.awq_grid <= 1000:
            raise RecipeError(f"{path}.awq_grid: 1 .. 1000, got {self.awq_grid}")
        if self.moe_forward == "grouped" and self.weights_resident != "bf16":
            raise RecipeError(
                f"{path}.moe_forward: grouped needs {path}.weights_resident: bf16 "
                f"(got {self.weights_resident}; the grouped GEMMs take whole expert weights)"
            )
        if self.activations == "host" and self.offload == "none":
            raise RecipeError(
                f"{path}.activations: host needs {path}.offload: layer or host "
                "(a resident calibration keeps no activations between layers)"
            )
        if self.offload != "none" and self.weights_resident != "bf16":
            # a layer streamed from disk is read in the model's dtype; holding it quantized
            # would save nothing that one layer at a time does not already save
            raise RecipeError(
                f"{path}.offload: {self.offload} does not combine with {path}.weights_resident: "
                f"{self.weights_resident}; use one of them"
            )


@dataclass(kw_only=True)
class ParallelConfig:
    ep: int = 1
    tp: int = 1
    timeout_s: float = 600.0

    def validate(self, path: str) -> None:
        for name in ("ep", "tp"):
            if getattr(self, name) < 1:
                raise RecipeError(f"{path}.{name}: must be >= 1, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise RecipeError(f"{path}.timeout_s: must be positive, got {self.timeout_s}")
        lo, hi = TIMEOUT_RANGE_S
        _in_range(f"{path}.timeout_s", self.timeout_s, lo, hi, f"{lo:g} .. {hi:g} seconds")

    def check_world(self, world_size: int) -> int:
        """Return dp for this world, or raise naming the key that does not fit."""
        if world_size % self.ep:
            raise RecipeError(f"parallel.ep: must divide the world size {world_size}")
        if world_size % (self.ep * self.tp):
            raise RecipeError(f"parallel.tp: ep * tp must divide the world size {world_size}")
        return world_size // (self.ep * self.tp)


@dataclass(kw_only=True)
class ExportConfig:
    format: Literal["compressed-tensors", "modelopt"] = "compressed-tensors"
    output: str = "runs/tiny/fp8"
    max_shard_size: str = "5GB"
    overwrite: bool = False
    # MoE experts: "shared" = one weight scale for gate and up, one input scale per layer (what
    # vLLM and ModelOpt use); "per_expert" = every expert linear its own calibrated scales
    moe_scales: Literal["shared", "per_expert"] = "shared"
    # where the weights are quantized: auto = this rank's GPU when there is one, else the CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    writers: int = 4  # threads writing shard files (and tensors of one file) at once, per rank

    def validate(self, path: str) -> None:
        try:
            parse_size(self.max_shard_size)
        except ValueError as exc:
            raise RecipeError(f"{path}.max_shard_size: {exc}") from None
        _in_range(f"{path}.writers", self.writers, 1, 64, "1 .. 64")

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)


@dataclass(kw_only=True)
class EvalConfig:
    """``qckpt eval``'s held-out data: text (its bytes are the token ids of a byte-vocabulary
    model; else the source's tokenizer reads it) or token ids (``.npy`` / ``.pt``). The window
    defaults are the shared quality set's protocol (64 windows of 512 + 1, seed 7)."""

    path: str | None = None
    windows: int = 64
    seq_len: int = 512
    seed: int = 7
    batch_size: int = 16
    device: Literal["auto", "cpu", "cuda"] = "auto"
    top_layers: int = 3  # how many of the layers whose outputs moved most the report names
    # none: source and export resident at once | layer: one decoder layer at a time on the
    # device (models larger than it; the same figures)
    offload: Literal["none", "layer"] = "none"
    # fused linears (q/k/v, gate/up): vllm = one scale per fused weight, as vLLM makes it at
    # load | as-stored = each shard with its own scales, as the files mean them
    fused: Literal["vllm", "as-stored"] = "vllm"
    # as-exported: inputs quantized as the export says | unquantized: the export's weights with
    # inputs in the model dtype (a weight-only kernel) | hopper: as an H100 / H200 client
    # runs it: the inputs it has no GEMM for (NVFP4's: vLLM serves it W4A16) left alone, FP8's
    # quantized as exported
    inputs: Literal["as-exported", "unquantized", "hopper"] = "as-exported"
    # as-exported: weights dequantized from the export | unquantized: the source's weights, the
    # export's input quantization (what the inputs alone cost; both unquantized: the source)
    weights: Literal["as-exported", "unquantized"] = "as-exported"

    def validate(self, path: str) -> None:
        for name, hi in (
            ("windows", MAX_SAMPLES),
            ("seq_len", MAX_SEQ_LEN),
            ("batch_size", MAX_SAMPLES),
            ("top_layers", 10**6),
        ):
            _in_range(f"{path}.{name}", getattr(self, name), 1, hi, f"1 .. {hi}")
        _in_range(f"{path}.seed", self.seed, 0, SEED_MAX, "0 .. 2**64-1")
        if self.path is not None and not self.path.strip():
            raise RecipeError(f"{path}.path: empty; name the held-out data file")


@dataclass(kw_only=True)
class CandidateConfig:
    """One of ``search.candidates``: a scheme as a ``quant.schemes`` entry gives it, without
    targets (the search gives those); weights ``{format: none}`` is the model dtype."""

    weights: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    inputs: TensorQuantConfig = field(default_factory=TensorQuantConfig)

    def validate(self, path: str) -> None:
        self.weights.validate(f"{path}.weights")
        self.inputs.validate(f"{path}.inputs")
        _check_inputs(self.inputs, f"{path}.inputs")


@dataclass(kw_only=True)
class SearchConfig:
    """``qckpt search``: one candidate scheme per linear that ``targets`` names (and
    ``quant.ignore`` leaves), under ``budget`` (``4.5bpw`` or an export size, ``18GB``; the
    command's ``--budget`` overrides it). Read by ``qckpt search`` only; the recipe it writes
    has ``quant.schemes`` instead."""

    candidates: list[CandidateConfig] = field(default_factory=list)
    targets: list[str] = field(default_factory=lambda: ["*"])
    budget: str | None = None

    def validate(self, path: str) -> None:
        if not self.candidates:
            raise RecipeError(f"{path}.candidates: name at least one candidate scheme")
        if not self.targets or any(not t.strip() for t in self.targets):
            raise RecipeError(f"{path}.targets: name at least one module glob, none empty")


@dataclass(kw_only=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig | None = None

    def validate(self, path: str) -> None:
        held, calib = self.eval.path, self.calibrate.data.path
        if (
            held
            and calib
            and Path(held).expanduser().resolve() == Path(calib).expanduser().resolve()
        ):
            raise RecipeError(
                "eval.path: is the calibration file (calibrate.data.path); evaluate on data "
                "the calibration never saw"
            )


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.I)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(s: str | int) -> int:
    """'5GB' -> 5_000_000_000; '512MiB' -> 536870912; plain ints are bytes."""
    if isinstance(s, int):
        if not 0 < s <= MAX_SHARD_BYTES:
            raise ValueError(f"must be between 1 and 2**40 bytes, got {show(s)}")
        return s
    m = _SIZE_RE.match(str(s))
    if not m:
        raise ValueError(f"not a size like '5GB' or '512MiB': {show(s)}")
    n = float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]
    if not n >= 1:
        raise ValueError(f"must be positive, got {show(s)}")
    if n > MAX_SHARD_BYTES:
        raise ValueError(f"at most 1TiB, got {show(s)}")
    return int(n)


def _in_range(path: str, value: float, lo: float, hi: float, what: str) -> None:
    if not lo <= value <= hi:
        raise RecipeError(f"{path}: must be in {what}, got {show(value)}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise RecipeError(
                f"{path}: must be one of {', '.join(map(str, choices))}; got {show(value)}"
            )
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if len(sections) == 1 and isinstance(value, dict):  # an optional section: its own error
            return _build(sections[0], value, path)
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except RecipeError:
                continue
        raise RecipeError(f"{path}: expected {_type_name(tp)}, got {show(value)}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list, got {show(value)}")
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{path}: expected true or false, got {show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{path}: expected an integer, got {show(value)}")
        if not INT_MIN <= value <= INT_MAX:  # every int field ends up in a 64-bit C integer
            raise RecipeError(f"{path}: out of range (it must fit in 64 bits), got {show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{path}: expected a number, got {show(value)}")
        if not -FLOAT_MAX <= value <= FLOAT_MAX:  # also false for NaN
            raise RecipeError(f"{path}: expected a finite number (|x| <= 1e300), got {show(value)}")
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise RecipeError(f"{path}: expected a string, got {show(value)}")
        return value
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{path or 'recipe'}: expected a mapping, got {show(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if hasattr(cls, "validate_raw"):
        cls.validate_raw(raw, path)
    kwargs = {}
    for key, value in raw.items():
        # a key that is not printable text (a newline, a control char) is quoted, so the message
        # stays one line
        plain = isinstance(key, str) and len(key) <= 80 and key.isprintable()
        key_path = _join(path, key if plain else show(key))
        if key not in fields:
            close = difflib.get_close_matches(str(key)[:80], list(fields), n=1)
            hint = f"; did you mean {_join(path, close[0])!r}?" if close else ""
            known = ", ".join(fields)
            raise RecipeError(f"{key_path}: unknown key{hint} (known: {known})")
        kwargs[key] = _coerce(value, hints[key], key_path)
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(path)
    return obj


def _apply_override(raw: dict, override: str) -> None:
    if "=" not in override:
        raise RecipeError(f"--set {show(override)}: expected key.path=value")
    key, _, text = override.partition("=")
    parts = key.strip().split(".")
    try:
        value = safe_parse(text, f"--set {show(key)}") if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"{show('.'.join(parts[: i + 1]))}: not a section, cannot set it")
        node = nxt
    node[parts[-1]] = value


def _unshared(node: Any) -> Any:
    """A copy of the sections and lists in which nothing is shared (deepcopy keeps aliases)."""
    if isinstance(node, dict):
        return {k: _unshared(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshared(v) for v in node]
    return node


def recipe_from_dict(raw: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    # a copy: overrides must not write into the caller's mapping, nor into every place that an
    # alias shares a section with (the loader bounds the expanded size, so this stays small)
    raw = _unshared(dict(raw or {}))
    for ov in overrides:
        _apply_override(raw, ov)
    recipe = _build(Recipe, raw, "")
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read and validate a recipe; every failure is a one-line :class:`RecipeError`."""
    return recipe_from_dict(read_raw(path, overrides))


def read_raw(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The recipe file's mapping as written, ``overrides`` applied (not validated): what a
    command that writes a recipe (``qckpt search``) starts from."""
    raw = read_yaml_file(path)
    if raw is not None and not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    raw = _unshared(dict(raw or {}))
    for ov in overrides:
        _apply_override(raw, ov)
    return raw
