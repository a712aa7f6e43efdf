"""``qckpt check``'s reading of a ModelOpt export's config (torch-free): ``config.json``'s
``quantization_config`` against ``hf_quant_config.json``, and the scheme of each module: one
``quant_algo`` for all, or ``MIXED_PRECISION`` with a ``quantized_layers`` map (module ->
``{"quant_algo": "FP8"}`` / ``{"quant_algo": "NVFP4", "group_size": 16}``), which vLLM's
``ModelOptMixedPrecisionConfig`` reads."""

from __future__ import annotations

import json
from pathlib import Path

from qckpt.layouts.check_common import Scheme, SchemeMap, one
from qckpt.layouts.names import (
    MO_FP8,
    MO_FP8_PCPT,
    MO_MIXED,
    MO_NVFP4,
    MODELOPT_FILE,
    NVFP4_GROUP,
)


def _hf_quant(root: Path, problems: list[str]) -> dict | None:
    path = root / MODELOPT_FILE
    if not path.is_file():
        problems.append(f"{MODELOPT_FILE}: missing (ModelOpt exports carry it; clients read it)")
        return None
    try:
        q = json.loads(path.read_text())["quantization"]
    except (ValueError, KeyError, TypeError):
        problems.append(f"{MODELOPT_FILE}: no 'quantization' section")
        return None
    return q if isinstance(q, dict) else None


def _agree(q: dict, qc: dict, algo: str, kv_cfg: bool, problems: list[str]) -> None:
    if str(q.get("quant_algo", "")).upper() != algo:
        problems.append(
            f"{MODELOPT_FILE}: quant_algo {q.get('quant_algo')!r} but config.json "
            f"says {qc.get('quant_algo')!r}"
        )
    if "ignore" in qc and sorted(q.get("exclude_modules") or []) != sorted(qc["ignore"]):
        problems.append(f"{MODELOPT_FILE}: exclude_modules differs from config ignore")
    if (q.get("kv_cache_quant_algo") is not None) != kv_cfg:
        problems.append(
            f"{MODELOPT_FILE}: kv_cache_quant_algo {q.get('kv_cache_quant_algo')!r} "
            f"disagrees with config.json's kv_cache_scheme {qc.get('kv_cache_scheme')!r}"
        )
    if algo == MO_NVFP4 and q.get("group_size") != NVFP4_GROUP:
        problems.append(f"{MODELOPT_FILE}: NVFP4 without group_size {NVFP4_GROUP}")
    if (
        algo == MO_MIXED
        and "quantized_layers" in qc
        and q.get("quantized_layers") != qc.get("quantized_layers")
    ):
        problems.append(f"{MODELOPT_FILE}: quantized_layers differs from config.json's")


def _algo_scheme(algo: str, kv_cfg: bool) -> Scheme | None:
    common = dict(scale_dtypes=("F32",), kv=kv_cfg, kv_names="modelopt")
    if algo == MO_FP8:
        return Scheme(name=algo, weight="tensor", static_input=True, **common)
    if algo == MO_FP8_PCPT:
        return Scheme(name=algo, weight="channel", static_input=False, **common)
    if algo == MO_NVFP4:
        return Scheme(name=algo, weight="group", packed=True, static_input=True, **common)
    return None


def modelopt_schemes(root: Path, qc: dict, problems: list[str]) -> SchemeMap | None:
    algo = str(qc.get("quant_algo", "")).upper()
    if "ignore" not in qc:
        problems.append(
            "config.json: quantization_config has no 'ignore' (vLLM reads the ignore list from "
            "config.json, not exclude_modules: it would quantize lm_head and the routers)"
        )
    kv_cfg = isinstance(qc.get("kv_cache_scheme"), dict)
    q = _hf_quant(root, problems)
    if q is not None:
        _agree(q, qc, algo, kv_cfg, problems)
    if algo == MO_MIXED:
        layers = qc.get("quantized_layers") or (q or {}).get("quantized_layers")
        return _mixed(layers, kv_cfg, problems)
    scheme = _algo_scheme(algo, kv_cfg)
    if scheme is None:
        problems.append(f"config.json: ModelOpt quant_algo {qc.get('quant_algo')!r} is not checked")
        return None
    return one(scheme)


def _mixed(layers: object, kv_cfg: bool, problems: list[str]) -> SchemeMap | None:
    if not isinstance(layers, dict) or not layers:
        problems.append("config.json: MIXED_PRECISION without a quantized_layers map")
        return None
    by_algo: dict[str, set[str]] = {}
    for module, entry in layers.items():
        algo = str((entry or {}).get("quant_algo", "")).upper() if isinstance(entry, dict) else ""
        if algo not in (MO_FP8, MO_NVFP4):
            problems.append(
                f"quantized_layers.{module}: quant_algo {algo or None!r} (MIXED_PRECISION layers "
                "are checked as FP8 or NVFP4)"
            )
            return None
        if algo == MO_NVFP4 and entry.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
            problems.append(f"quantized_layers.{module}: NVFP4 without group_size {NVFP4_GROUP}")
        by_algo.setdefault(algo, set()).add(module)
    out = SchemeMap()
    for algo, modules in by_algo.items():
        out.rules.append((_algo_scheme(algo, kv_cfg), modules.__contains__))  # type: ignore[arg-type]
    return out
