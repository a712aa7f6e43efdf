"""The scheme seam: stages ask a ``Scheme`` what a format does; none compares a format's name.

A format name compared outside :mod:`qckpt.formats` (``fmt == "nvfp4"``) is the switch that
made every new format a change across the tree; :mod:`qckpt.formats.scheme` is where a stage
asks instead. The scan looks at every comparison (``==``, ``!=``, ``in``, ``not in``) in
``qckpt/`` outside ``formats/`` whose other side is a quantization format's name, or a tuple,
list or set holding one. ``"none"`` and ``"bf16"`` are left out of the scan: they also name
settings that are no format (``calibrate.offload: none``, a BF16-resident calibration).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qckpt.errors import FormatError
from qckpt.formats.scheme import (
    FP8_MAX,
    SCHEMES,
    Fp8Scheme,
    NoScheme,
    Nvfp4Scheme,
    make_scheme,
    scheme_bits,
    scheme_of,
)
from qckpt.recipe import TensorQuantConfig

ROOT = Path(__file__).resolve().parents[2] / "qckpt"
FORMAT_NAMES = {"fp8", "nvfp4", "mxfp8", "fp8_block", "fp8_delayed", "mxfp4", "int4", "int8"}


def _names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def format_comparisons(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: the comparison`` for each comparison of a format name in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            hit = _names(side) & FORMAT_NAMES
            if hit:
                out.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
                break
    return out


def test_the_scan_finds_what_it_looks_for():
    planted = (
        "if fmt == 'nvfp4': pass\n"
        "ok = q.format in ('fp8', 'x')\n"
        "bad = 'mxfp8' != name\n"
        "fine = offload == 'none'\n"
        "also = kind == 'weight'\n"
    )
    found = format_comparisons(planted)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3"]


def test_no_module_outside_formats_compares_a_format_name():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if rel.parts[1] == "formats":
            continue
        found += format_comparisons(path.read_text(), str(rel))
    assert not found, "ask the Scheme (qckpt.formats.scheme) instead:\n" + "\n".join(found)


def test_schemes_are_registered_and_answer_for_their_format():
    assert {"fp8", "nvfp4", "mxfp8", "none"} <= set(SCHEMES)
    s = scheme_of(TensorQuantConfig(format="nvfp4"))
    assert isinstance(s, Nvfp4Scheme)
    assert (s.calib_granularity, s.scalar_amax, s.group, s.packed_fp4) == (
        "dynamic_block",
        True,
        16,
        True,
    )
    assert s.amax_shape("weight", (64, 32)) == ()
    assert s.qmax == 6 * 448 and s.input_mode() == "nvfp4"
    b = scheme_of(TensorQuantConfig(format="fp8", granularity="block", block_size=[128]))
    assert isinstance(b, Fp8Scheme) and b.block == (128, 128)
    assert b.amax_shape("weight", (300, 256)) == (3, 2)
    assert b.qmax == FP8_MAX and not b.stacks()
    c = scheme_of(TensorQuantConfig(format="fp8", granularity="channel"))
    assert c.amax_shape("weight", (64, 32)) == (64,) and c.stacks()
    dyn = scheme_of(TensorQuantConfig(format="fp8", dynamic=True), "input")
    assert dyn.input_mode() == "fp8_token" and not dyn.calibrates("input")
    assert dyn.calibrates("weight")
    grp = make_scheme("fp8", granularity="block", block=(1, 64), dynamic=True, kind="input")
    assert grp.input_mode() == "fp8_group"
    none = make_scheme("none", kind="input")
    assert isinstance(none, NoScheme) and none.input_mode() == "none"
    assert not none.calibrates("input")


def test_schemes_compare_by_value():
    a = scheme_of(TensorQuantConfig(format="fp8", granularity="block", block_size=[128]))
    b = make_scheme("fp8", granularity="block", block=(128, 128))
    assert a == b and hash(a) == hash(b)
    assert a != make_scheme("fp8", granularity="tensor")


@pytest.mark.parametrize(
    ("fmt", "gran", "kind", "needle"),
    [
        ("nvfp4", "channel", "weight", "nvfp4 weights take granularity tensor, not channel"),
        ("fp8", "channel", "input", "fp8 inputs take granularity tensor or block, not channel"),
        ("int3", "tensor", "weight", "unknown quantization scheme 'int3'"),
    ],
)
def test_a_scheme_that_cannot_be_is_refused_in_one_line(fmt, gran, kind, needle):
    with pytest.raises(FormatError, match=needle):
        make_scheme(fmt, granularity=gran, kind=kind)


def test_bits_count_codes_and_scales():
    shape = (128, 256)
    n = 128 * 256
    assert scheme_bits(make_scheme("nvfp4"), shape) == n * 4 + (n // 16) * 8 + 32
    assert scheme_bits(make_scheme("fp8"), shape) == n * 8 + 16
    assert scheme_bits(make_scheme("fp8", granularity="channel"), shape) == n * 8 + 128 * 16
    assert scheme_bits(make_scheme("none"), shape) == n * 16


def test_names_repeat_the_scheme_constants():
    """``layouts.names`` repeats the scheme constants for readers that may not import formats."""
    from qckpt.formats import scheme
    from qckpt.layouts import names

    assert (names.FP8_MAX, names.FP4_MAX, names.NVFP4_GROUP) == (
        scheme.FP8_MAX,
        scheme.FP4_MAX,
        scheme.NVFP4_GROUP,
    )


def test_every_recipe_format_is_a_registered_scheme():
    """The recipe names its formats without importing ``formats`` (it sits below it): each one
    a recipe accepts must be a scheme the stages can build, or a recipe passes validation and
    fails mid-run."""
    import typing

    from qckpt.formats.scheme import SCHEMES
    from qckpt.recipe import TensorQuantConfig

    hints = typing.get_type_hints(TensorQuantConfig)
    accepted = set(typing.get_args(hints["format"]))
    assert accepted and accepted <= set(SCHEMES), accepted - set(SCHEMES)


def test_the_how_to_add_section_names_files_that_exist():
    """docs/ARCHITECTURE.md's "How to add" steps name real files and registries: a step that
    names a file which moved would send the next format's author to the wrong place."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "ARCHITECTURE.md").read_text()
    section = doc.split("## How to add a scheme, an algorithm, a source, a layout")[1]
    section = section.split("\n## ")[0]
    named = set(re.findall(r"`((?:qckpt/)?[a-z_]+/[a-z_<>]+\.py)`", section))
    named = {n for n in named if "<" not in n}  # `<family>.py`: the file to write
    assert len(named) >= 10, named
    for n in named:
        p = root / n if n.startswith("qckpt/") else root / "qckpt" / n
        assert p.is_file() or (root / n).is_file(), n
    from qckpt.layouts import registry

    for table in ("SOURCE_FAMILIES", "EXPORT_FAMILIES", "MIXED_FAMILIES"):
        assert table in section and getattr(registry, table)
