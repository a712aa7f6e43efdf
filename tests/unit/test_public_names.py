"""``bench/`` and ``tests/e2e`` use qckpt's public names only (issue 28), read with ``ast``:
no ``_name`` imported from another module, no private module of qckpt (``qckpt.formats._triton``)
imported, no ``_name`` read off an imported qckpt module (``pipe._Pipeline``).

The files that still do are listed in ``ALLOWED`` with the reason; an entry that no longer
needs its place fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

SCANNED = ("bench/*.py", "tests/e2e/*.py")

ALLOWED = {
    # kernel benchmarks: they read and set the kernels' own state in qckpt/formats/_common.py
    # and _triton.py (private modules by name; renaming modules is the package re-cut's job)
    "bench/formats.py": "formats._common / formats._triton kernel state",
    "bench/tune_triton.py": "sets formats._triton's tuning constants",
    # count and keep the export pipeline's work by wrapping its class's methods
    "bench/export_items.py": "checkpoint.export_pipeline._Pipeline",
    # the read ceiling reads into host buffers exactly as the fast reader does
    "bench/read_ceiling.py": "checkpoint.fast_read._byte_view",
    # owned by other work in progress (issue 26 / 30), not converted here
    "bench/quality.py": "quantized_sources._read_json, vllm_client._figures",
    "tests/e2e/test_one_recipe.py": "cli._gpus",
    # merged from parallel work (issues 29 / 30) after this test was written; to convert
    "bench/megatron_export.py": "DCP's _StorageInfo, training_layouts' privates, export._digests",
    "tests/e2e/test_summaries.py": "cli._output (what the summary prints through)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_qckpt_module(name: str) -> bool:
    # by its file, not importlib: finding qckpt.formats.x would import torch
    if name != "qckpt" and not name.startswith("qckpt."):
        return False
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(path: Path) -> list[str]:
    """Every private name ``path`` takes from another module, as ``line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[str] = []
    modules: set[str] = set()  # local names bound to a qckpt module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("qckpt") and any(map(_private, a.name.split("."))):
                    out.append(f"{node.lineno}: import {a.name}")
                if a.name.startswith("qckpt"):
                    modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            if mod.startswith("qckpt") and any(map(_private, mod.split("."))):
                out.append(f"{node.lineno}: from {mod}")
            for a in node.names:
                if _private(a.name):
                    out.append(f"{node.lineno}: from {mod} import {a.name}")
                elif _is_qckpt_module(f"{mod}.{a.name}"):
                    modules.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):  # qckpt.formats._common: its first name
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                out.append(f"{node.lineno}: {ast.unparse(node)}")
    # dict.fromkeys, not set: duplicates dropped, the walk's order kept (a set's order is the
    # string hashes', which differ from one process to the next)
    return sorted(dict.fromkeys(out), key=lambda s: int(s.split(":")[0]))


def _scanned() -> list[Path]:
    return sorted(p for pattern in SCANNED for p in ROOT.glob(pattern))


def test_bench_and_e2e_use_public_names_only():
    found = {p.relative_to(ROOT).as_posix(): v for p in _scanned() if (v := violations(p))}
    bad = {f: v for f, v in found.items() if f not in ALLOWED}
    assert not bad, bad
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"no private names left in {stale}: drop them from ALLOWED"


def test_the_checker_sees_every_spelling(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        "import qckpt.checkpoint.export_pipeline as pipe\n"
        "from qckpt.formats import _common, quantize\n"
        "from qckpt.checkpoint import fast_read\n"
        "import qckpt.formats._triton\n"
        "from bench.formats import _timer\n"
        "def f(self):\n"
        "    self._private_attr_of_its_own = 1\n"  # its own object's: not a module's
        "    return pipe._Pipeline, fast_read._byte_view, quantize._x, qckpt.formats.FORMATS\n"
    )
    got = [v.split(": ", 1)[1] for v in violations(src)]
    assert got == [
        "from qckpt.formats import _common",
        "import qckpt.formats._triton",
        "from bench.formats import _timer",
        "pipe._Pipeline",
        "fast_read._byte_view",
    ], got
