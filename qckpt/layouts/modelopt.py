"""ModelOpt (``hf_quant_config.json`` + ``quant_method: modelopt``): both directions.

Written field for field as ModelOpt 0.47's own ``export_hf_checkpoint`` writes for the same
model (the producer aside; fixtures and the script that made them in ``tests/fixtures/modelopt/``;
the fields are in :mod:`qckpt.layouts.names`):

* ``FP8``: per-tensor weights and static per-tensor inputs; ``weight_scale`` and ``input_scale``
  are float32 scalars ``amax / 448``.
* ``FP8_PER_CHANNEL_PER_TOKEN``: per-channel weights (``weight_scale`` float32 ``[out]``) and
  dynamic per-token inputs (no ``input_scale``); the recipe's ``granularity: channel`` weights
  with ``dynamic: true`` per-tensor inputs.
* ``NVFP4``: (quantized by :mod:`qckpt.formats`, whose nvfp4 layout is ModelOpt's)
  ``weight`` uint8 ``[out, in/2]`` (two E2M1 codes a byte, the even column in the low
  nibble), ``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_scale_2`` float32 scalar
  ``amax / (6 * 448)``, ``input_scale`` float32 scalar ``input_amax / (6 * 448)``. Unverified on
  a GPU: Hopper cannot run NVFP4 (see docs/CLIENTS.md).

KV-cache scales: ``{attn}.k_proj.k_scale`` / ``v_proj.v_scale`` (scalars) = amax / 448.

Read (a source dir): ``FP8`` and ``FP8_PER_CHANNEL_PER_TOKEN`` (``code * weight_scale``) and
``NVFP4`` (``e2m1 * (weight_scale_2 * scale)``); other algorithms are refused with one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import qckpt
from qckpt.errors import CheckpointError, ExportError, SchemeError
from qckpt.formats.scheme import FP4_MAX, FP8_MAX, NVFP4_GROUP, Fp8Scheme, Nvfp4Scheme, scheme_of
from qckpt.layouts.export_layout import (
    EXPERT,
    MIN_AMAX,
    BlockScales,
    ExportLayout,
    OutSpec,
    amax_over,
    amax_scalar,
    fp8_quantize,
    fp8_quantize_stack,
    stack_f32,
)
from qckpt.layouts.mixed import MixedLayout, build_parts, entry_path
from qckpt.layouts.names import (
    INPUT_SCALE,
    MO_FP8,
    MO_FP8_PCPT,
    MO_MIXED,
    MO_NVFP4,
    MODELOPT_FILE,
    MODELOPT_KV_SCHEME,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    modelopt_config_groups,
)
from qckpt.layouts.source_layout import FP8, SourceLayout, fp8_weights, nvfp4_weights
from qckpt.recipe import QuantConfig
from qckpt.storage.slices import Index


def read_layout(index: Index, qc: dict[str, Any] | None, hq: dict[str, Any] | None) -> SourceLayout:
    q = (hq or {}).get("quantization") or {}
    algo = q.get("quant_algo") or (qc or {}).get("quant_algo")
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):  # per-tensor / per-channel weight_scale
        weights = fp8_weights(index, "_scale", [("tensor", None), ("channel", None)])
    elif algo == "NVFP4":
        group = q.get("group_size") or (qc or {}).get("group_size") or NVFP4_GROUP
        if group != NVFP4_GROUP:
            raise CheckpointError(f"modelopt NVFP4 with group_size {group}: only 16 is read")
        weights = nvfp4_weights(index, "weight", "weight_scale_2", False)
    elif algo == MO_MIXED:
        # per layer FP8 (per-tensor) or NVFP4: the stored dtypes tell them apart (F8 codes,
        # uint8 packed codes), as the quantized_layers map says
        weights = fp8_weights(index, "_scale", [("tensor", None)])
        weights.update(nvfp4_weights(index, "weight", "weight_scale_2", False))
    else:
        raise CheckpointError(
            f"modelopt quant_algo {algo!r}: not a source layout qckpt reads (FP8, "
            "FP8_PER_CHANNEL_PER_TOKEN, NVFP4, MIXED_PRECISION)"
        )
    return SourceLayout(name="modelopt", detail=str(algo), weights=weights)


class ModelOptLayout(ExportLayout):
    name = "modelopt"

    def __init__(
        self, quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
    ) -> None:
        super().__init__(quant, model_dtype, block_scales)
        w, i = quant.weights, quant.inputs
        ws, ins = scheme_of(w, "weight"), scheme_of(i, "input")
        fp8 = isinstance(ws, Fp8Scheme) and isinstance(ins, Fp8Scheme) and i.granularity == "tensor"
        if fp8 and w.granularity == "tensor" and not i.dynamic:
            self.algo = MO_FP8
        elif fp8 and w.granularity == "channel" and i.dynamic:
            self.algo = MO_FP8_PCPT
        elif isinstance(ws, Nvfp4Scheme) and isinstance(ins, Nvfp4Scheme) and not i.dynamic:
            self.algo = MO_NVFP4
        else:
            raise SchemeError(
                "export.format modelopt writes FP8 (per-tensor weights, static per-tensor inputs), "
                "FP8_PER_CHANNEL_PER_TOKEN (per-channel weights, dynamic per-tensor inputs) or "
                f"NVFP4 (weights and static inputs nvfp4); got weights {w.format}/{w.granularity}, "
                f"inputs {i.format}/{i.granularity}{' dynamic' if i.dynamic else ''}"
            )

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        f32 = torch.float32
        if self.algo == MO_FP8:
            return [
                OutSpec(f"{module}.weight", FP8, shape),
                OutSpec(f"{module}.{WEIGHT_SCALE}", f32, ()),
                OutSpec(f"{module}.{INPUT_SCALE}", f32, ()),
            ]
        if self.algo == MO_FP8_PCPT:
            return [
                OutSpec(f"{module}.weight", FP8, shape),
                OutSpec(f"{module}.{WEIGHT_SCALE}", f32, (shape[0],)),
            ]
        if shape[1] % NVFP4_GROUP:
            raise ExportError(
                f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}, got {shape[1]}"
            )
        return [
            OutSpec(f"{module}.weight", torch.uint8, (shape[0], shape[1] // 2)),
            OutSpec(f"{module}.{WEIGHT_SCALE}", FP8, (shape[0], shape[1] // NVFP4_GROUP)),
            OutSpec(f"{module}.{WEIGHT_SCALE_2}", f32, ()),
            OutSpec(f"{module}.{INPUT_SCALE}", f32, ()),
        ]

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # ModelOpt's scales are float32 and derived from the amax exactly as qckpt.formats
        # derives them (amax / 448, amax / (6 * 448)), so the formats layer does the math
        from qckpt.formats import quantize

        if self.algo == MO_FP8_PCPT:
            wa = amax[f"{module}.weight_amax"].detach().to(torch.float32).clamp_min(MIN_AMAX)
            scale = amax_over(wa, FP8_MAX).reshape(-1)
            yield f"{module}.weight", fp8_quantize(w, scale, "channel")
            yield f"{module}.{WEIGHT_SCALE}", scale
            return
        wa = amax_scalar(amax[f"{module}.weight_amax"])
        ia = amax_scalar(amax[f"{module}.input_amax"])
        if self.algo == MO_FP8:
            q = quantize(w, "fp8", granularity="tensor", amax=wa)
            yield f"{module}.weight", q.qdata
            yield f"{module}.{WEIGHT_SCALE}", q.scale.to(torch.float32).reshape(())
            yield f"{module}.{INPUT_SCALE}", amax_over(ia, FP8_MAX)
            return
        if w.shape[1] % NVFP4_GROUP:
            raise ExportError(f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}")
        qdata, scale, gs = self.nvfp4(w, wa, module)
        yield f"{module}.weight", qdata
        yield f"{module}.{WEIGHT_SCALE}", scale
        yield f"{module}.{WEIGHT_SCALE_2}", gs.to(torch.float32).reshape(())
        yield f"{module}.{INPUT_SCALE}", amax_over(ia, FP4_MAX * FP8_MAX)

    def stacks(self) -> bool:
        return self.algo == MO_FP8_PCPT

    def quantize_stack(
        self, modules: list[str], w: torch.Tensor, amax: dict[str, torch.Tensor], chunk_elems: int
    ) -> list[torch.Tensor]:
        k = w.shape[0]
        wa = stack_f32([amax[f"{m}.weight_amax"] for m in modules]).clamp_min(MIN_AMAX)
        scale = amax_over(wa, FP8_MAX).reshape(k, -1)
        return [fp8_quantize_stack(w, scale, chunk_elems), scale]

    def kv_specs(self, attn: str) -> list[OutSpec]:
        return [OutSpec(f"{attn}.{kv}_proj.{kv}_scale", torch.float32, ()) for kv in ("k", "v")]

    def kv_tensors(
        self, attn: str, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for kv in ("k", "v"):
            yield (
                f"{attn}.{kv}_proj.{kv}_scale",
                amax_over(amax_scalar(amax[f"{attn}.{kv}_proj.output_amax"]), FP8_MAX),
            )

    def warnings(self, modules: list[str]) -> list[str]:
        if self.algo == MO_FP8_PCPT and any(EXPERT.match(m) for m in modules):
            return [
                "vLLM 0.26 cannot load FP8_PER_CHANNEL_PER_TOKEN MoE experts (its ModelOpt MoE "
                "method takes per-tensor scales; ModelOpt's own export fails the same way): use "
                "export.format compressed-tensors for per-channel MoE weights"
            ]
        return []

    def ignore_entries(self, ignored: list[str], embeddings: list[str]) -> list[str]:
        # ModelOpt lists the embeddings with the modules it left unquantized
        return sorted(set(ignored) | set(embeddings))

    def _producer(self) -> dict:
        return {"name": "qckpt", "version": qckpt.__version__}

    def quantization_config(self, ignored: list[str]) -> dict:
        # config.json is what vLLM reads (it prefers it to hf_quant_config.json): "ignore", and
        # the KV-cache scheme as a dict; a flat "exclude_modules" there is not read at all
        cfg: dict = {}
        groups = modelopt_config_groups(self.algo)
        if groups is not None:
            cfg["config_groups"] = groups
        cfg["ignore"] = list(ignored)
        if self.quant.kv_cache:
            cfg["kv_cache_scheme"] = dict(MODELOPT_KV_SCHEME)
        cfg["producer"] = self._producer()
        cfg["quant_algo"] = self.algo
        cfg["quant_method"] = "modelopt"
        return cfg

    def extra_files(self, ignored: list[str]) -> dict[str, dict]:
        q: dict = {"exclude_modules": list(ignored)}
        if self.algo == MO_NVFP4:
            q["group_size"] = NVFP4_GROUP
        q["kv_cache_quant_algo"] = "FP8" if self.quant.kv_cache else None
        q["quant_algo"] = self.algo
        return {MODELOPT_FILE: {"producer": self._producer(), "quantization": q}}

    def layer_entry(self) -> dict:
        """This scheme's entry in a MIXED_PRECISION ``quantized_layers`` map."""
        if self.algo == MO_NVFP4:
            return {"quant_algo": MO_NVFP4, "group_size": NVFP4_GROUP}
        return {"quant_algo": self.algo}

    def shard_metadata(self) -> dict[str, str]:
        return {"format": "pt", "qckpt_layout": "modelopt", "quant_format": self.algo}


class ModelOptMixedLayout(MixedLayout):
    """ModelOpt ``MIXED_PRECISION``: what ModelOpt's export writes for a per-layer mix and
    vLLM's ``ModelOptMixedPrecisionConfig`` reads. ``quantized_layers`` maps every quantized
    linear (checkpoint names; vLLM resolves a fused ``qkv_proj`` / ``gate_up_proj`` from its
    parts and a ``FusedMoE`` from its experts' names) to ``{"quant_algo": "FP8"}`` or
    ``{"quant_algo": "NVFP4", "group_size": 16}``; it is in ``hf_quant_config.json``'s
    ``quantization`` and in ``config.json``'s ``quantization_config`` (with one ``config_groups``
    entry per distinct layer entry, its ``targets`` the sorted layer names, as ModelOpt's
    ``convert_hf_quant_config_format`` writes)."""

    def quantized_layers(self) -> dict[str, dict]:
        layers: dict[str, dict] = {}
        for m in sorted(m for m, i in self.assignment.items() if i is not None):
            layers[m] = self.part(m).layer_entry()  # type: ignore[attr-defined]
        return layers

    def quant_format(self) -> str:
        return MO_MIXED

    def quantization_config(self, ignored: list[str]) -> dict:
        layers = self.quantized_layers()
        by_entry: dict[tuple, list[str]] = {}
        for m, e in layers.items():
            by_entry.setdefault(tuple(sorted(e.items())), []).append(m)
        groups: dict[str, dict] = {}
        for n, (key, names) in enumerate(by_entry.items()):
            group = dict(modelopt_config_groups(dict(key)["quant_algo"])["group_0"])  # type: ignore[index]
            group["targets"] = sorted(names)
            groups[f"group_{n}"] = group
        cfg: dict = {"config_groups": groups, "ignore": list(ignored)}
        if self.quant.kv_cache:
            cfg["kv_cache_scheme"] = dict(MODELOPT_KV_SCHEME)
        cfg["producer"] = self.first._producer()  # type: ignore[attr-defined]
        cfg["quant_algo"] = MO_MIXED
        cfg["quant_method"] = "modelopt"
        cfg["quantized_layers"] = layers
        return cfg

    def extra_files(self, ignored: list[str]) -> dict[str, dict]:
        q: dict = {
            "exclude_modules": list(ignored),
            "kv_cache_quant_algo": "FP8" if self.quant.kv_cache else None,
            "quant_algo": MO_MIXED,
            "quantized_layers": self.quantized_layers(),
        }
        return {MODELOPT_FILE: {"producer": self.first._producer(), "quantization": q}}  # type: ignore[attr-defined]


def mixed_layout(
    quant: QuantConfig,
    model_dtype: torch.dtype,
    block_scales: BlockScales | None,
    assignment: dict[str, int | None],
) -> ExportLayout:
    """The ModelOpt layout of a ``quant.schemes`` recipe. vLLM's MIXED_PRECISION reader takes
    FP8 (per-tensor weights, static inputs) and NVFP4 per layer: any other entry is refused."""
    parts = build_parts(quant, ModelOptLayout, model_dtype, block_scales, assignment)
    for i, part in enumerate(parts):
        if part is not None and part.algo not in (MO_FP8, MO_NVFP4):  # type: ignore[attr-defined]
            raise SchemeError(
                f"{entry_path(quant, i)}: ModelOpt MIXED_PRECISION writes FP8 (per-tensor "
                "weights, static per-tensor inputs) or NVFP4 per layer, not "
                f"{part.algo}; use export.format compressed-tensors"  # type: ignore[attr-defined]
            )
    return ModelOptMixedLayout(quant, model_dtype, parts, assignment)
