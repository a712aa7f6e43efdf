"""``qckpt check``'s reading of a compressed-tensors config (torch-free): each ``config_groups``
entry's scheme, and which group's ``targets`` a module falls under as vLLM matches them (an
exact module name, a ``re:`` pattern matched from the start, or a module class: ``Linear``)."""

from __future__ import annotations

import re
from collections.abc import Callable

from qckpt.layouts.check_common import FLOAT_DTYPES, Scheme, SchemeMap
from qckpt.layouts.names import (
    CT_INPUT_GLOBAL,
    CT_INT_FORMAT,
    CT_INT_PACKED_FORMAT,
    CT_MXFP4_FORMAT,
    CT_MXFP8_FORMAT,
    CT_NVFP4_FORMAT,
    CT_PACKED,
    CT_WEIGHT_GLOBAL,
    MX_GROUP,
    NVFP4_GROUP,
)

CT_MIXED_FORMAT = "mixed-precision"


def _matcher(targets: list) -> Callable[[str], bool]:
    names = {t for t in targets if isinstance(t, str) and not t.startswith("re:")}
    pats = [re.compile(t[3:]) for t in targets if isinstance(t, str) and t.startswith("re:")]
    if "Linear" in names:  # a class target: every linear
        return lambda _m: True
    return lambda m: m in names or any(p.match(m) for p in pats)


def ct_schemes(qc: dict, problems: list[str]) -> SchemeMap | None:
    """The schemes of a compressed-tensors ``quantization_config``, one per group."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        problems.append("config.json: compressed-tensors quantization_config has no config_groups")
        return None
    top = qc.get("format")
    fmts = {(g or {}).get("format") or top for g in groups.values() if isinstance(g, dict)}
    if len(fmts) > 1 and top != CT_MIXED_FORMAT:
        problems.append(
            f"config.json: groups of formats {sorted(map(str, fmts))} under top-level format "
            f"{top!r} (compressed-tensors writes {CT_MIXED_FORMAT!r})"
        )
    out = SchemeMap()
    for gname, g in groups.items():
        if not isinstance(g, dict):
            problems.append(f"config.json: config_groups.{gname} is not an object")
            return None
        scheme = _group_scheme(qc, g, g.get("format") or top, problems)
        if scheme is None:
            return None
        out.rules.append((scheme, _matcher(list(g.get("targets") or []))))
    return out


def _group_scheme(qc: dict, g: dict, fmt: str | None, problems: list[str]) -> Scheme | None:
    w, i = g.get("weights") or {}, g.get("input_activations")
    if fmt == CT_NVFP4_FORMAT:
        return _ct_nvfp4_scheme(qc, w, i, problems)
    if fmt == CT_INT_PACKED_FORMAT:
        return _ct_int_scheme(qc, w, i, problems)
    if fmt in (CT_MXFP4_FORMAT, CT_MXFP8_FORMAT):
        return _ct_mx_scheme(qc, w, i, fmt, problems)
    if fmt == CT_INT_FORMAT:
        return _ct_int8_scheme(qc, w, i, problems)
    if w.get("num_bits") != 8 or w.get("type") != "float":
        problems.append(f"config.json: weights {w.get('num_bits')}-bit {w.get('type')}: not FP8")
        return None
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        bs = w.get("block_structure") or []
        if len(bs) != 2:
            problems.append("config.json: block weights without a 2-number block_structure")
            return None
        block = (int(bs[0]), int(bs[1]))
    elif strategy not in ("tensor", "channel"):
        problems.append(f"config.json: weight strategy {strategy!r} is not checked")
        return None
    static = bool(i) and not i.get("dynamic", False)
    kv = qc.get("kv_cache_scheme") is not None
    return Scheme(
        name=f"FP8 {strategy}/{'static' if static else 'dynamic'}",
        weight=strategy,
        static_input=static,
        scale_dtypes=FLOAT_DTYPES,
        block=block,
        kv=kv,
    )


def _ct_nvfp4_scheme(qc: dict, w: dict, i: dict | None, problems: list[str]) -> Scheme | None:
    """compressed-tensors ``nvfp4-pack-quantized``: E2M1 weights in groups of 16."""
    if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", NVFP4_GROUP):
        problems.append(
            f"config.json: {CT_NVFP4_FORMAT} weights {w.get('num_bits')}-bit {w.get('type')} "
            f"group_size {w.get('group_size')}: not NVFP4 (4-bit float, groups of {NVFP4_GROUP})"
        )
        return None
    # "dynamic: local" (the NVFP4 preset) keeps a static global input scale; true keeps none
    static = bool(i) and i.get("dynamic", False) in (False, "local")
    return Scheme(
        name=f"NVFP4 {'static' if static else 'dynamic' if i else 'W4A16'}",
        weight="group",
        packed=True,
        static_input=static,
        scale_dtypes=("F32",),
        kv=qc.get("kv_cache_scheme") is not None,
        codes_leaf=CT_PACKED,
        global_leaf=CT_WEIGHT_GLOBAL,
        input_leaf=CT_INPUT_GLOBAL,
    )


def _ct_int_scheme(qc: dict, w: dict, i: dict | None, problems: list[str]) -> Scheme | None:
    """compressed-tensors ``pack-quantized``: INT4 weights per group or channel packed into
    int32 words (asymmetric groups: their zero points too, packed along the rows); weight-only
    (the inputs in the model dtype)."""
    bits, strategy, g = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if bits not in (4, 8) or w.get("type") != "int" or strategy not in ("group", "channel"):
        problems.append(
            f"config.json: {CT_INT_PACKED_FORMAT} weights {bits}-bit {w.get('type')} strategy "
            f"{strategy!r}: qckpt checks 4- or 8-bit int per group or channel"
        )
        return None
    asym = w.get("symmetric") is False
    if asym and (bits, strategy) != (4, "group"):
        problems.append(
            f"config.json: asymmetric int{bits} {strategy} weights (zero points) are not checked "
            "(int4 groups are)"
        )
        return None
    if strategy == "group" and not (isinstance(g, int) and g > 0):
        problems.append(
            f"config.json: int{bits} group weights need a positive group_size, got {g!r}"
        )
        return None
    if i:
        problems.append(
            f"config.json: {CT_INT_PACKED_FORMAT} int{bits} weights with quantized inputs are "
            "not checked (qckpt writes them weight-only)"
        )
        return None
    if w.get("actorder") not in (None, "weight", "static"):
        problems.append(
            f"config.json: actorder {w.get('actorder')!r} (a g_idx) is not checked: "
            "compressed-tensors 0.20 reads none"
        )
        return None
    return Scheme(
        name=f"INT{bits} W{bits}A16 {f'group {g}' if strategy == 'group' else 'channel'}"
        f"{' asymmetric' if asym else ''}",
        weight=strategy,
        static_input=False,
        scale_dtypes=FLOAT_DTYPES,
        block=(1, g) if strategy == "group" else None,
        kv=qc.get("kv_cache_scheme") is not None,
        codes_leaf=CT_PACKED,
        codes_dtype="I32",
        int_bits=int(bits),
        zero_points=asym,
    )


def _ct_int8_scheme(qc: dict, w: dict, i: dict | None, problems: list[str]) -> Scheme | None:
    """compressed-tensors ``int-quantized``: symmetric INT8 codes (one int8 each) per channel
    or tensor; inputs INT8 per token (dynamic) or per tensor (a stored ``input_scale``)."""
    bits, strategy = w.get("num_bits"), w.get("strategy")
    if (bits, w.get("type")) != (8, "int") or strategy not in ("tensor", "channel"):
        problems.append(
            f"config.json: {CT_INT_FORMAT} weights {bits}-bit {w.get('type')} strategy "
            f"{strategy!r}: qckpt checks 8-bit int per channel or tensor"
        )
        return None
    if w.get("symmetric") is False or (i and i.get("symmetric") is False):
        problems.append("config.json: asymmetric int8 (zero points) is not checked")
        return None
    static = False
    if i:
        istrat, dyn = i.get("strategy"), i.get("dynamic")
        if (i.get("num_bits"), i.get("type")) != (8, "int") or (istrat, dyn) not in (
            ("token", True),
            ("tensor", False),
        ):
            problems.append(
                f"config.json: {CT_INT_FORMAT} inputs {i.get('num_bits')}-bit {i.get('type')} "
                f"strategy {istrat!r} dynamic {dyn!r}: qckpt checks int8 per token (dynamic) "
                "or per tensor (static)"
            )
            return None
        static = dyn is False
    return Scheme(
        name=f"INT8 {strategy}/{'static' if static else 'dynamic' if i else 'W8A16'}",
        weight=strategy,
        static_input=static,
        scale_dtypes=FLOAT_DTYPES,
        kv=qc.get("kv_cache_scheme") is not None,
        codes_dtype="I8",
    )


def _ct_mx_scheme(
    qc: dict, w: dict, i: dict | None, fmt: str, problems: list[str]
) -> Scheme | None:
    """compressed-tensors ``mxfp4-pack-quantized`` / ``mxfp8-quantized``: E2M1 / E4M3 weights
    under E8M0 scales per 32; MXFP8's inputs quantized per 32 at run time (nothing stored)."""
    bits = 4 if fmt == CT_MXFP4_FORMAT else 8
    got = (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("strategy"))
    if got != (bits, "float", MX_GROUP, "group"):
        problems.append(
            f"config.json: {fmt} weights {got[0]}-bit {got[1]} group_size {got[2]} "
            f"strategy {got[3]!r}: not MXFP{bits} ({bits}-bit float, groups of {MX_GROUP})"
        )
        return None
    if i and (bits == 4 or i.get("dynamic") is not True):
        problems.append(
            f"config.json: {fmt} with {'static ' if bits == 8 else ''}quantized inputs is not "
            "checked (qckpt writes MXFP4 weight-only, MXFP8 inputs dynamic)"
        )
        return None
    return Scheme(
        name=f"MXFP{bits} {'W4A16' if bits == 4 else 'dynamic' if i else 'W8A16'}",
        weight="group",
        packed=bits == 4,
        mx=True,
        static_input=False,
        scale_dtypes=("U8",),
        kv=qc.get("kv_cache_scheme") is not None,
        codes_leaf=CT_PACKED if bits == 4 else "weight",
    )
