"""The layering of ``qckpt/``, read from the source with ``ast``: no module imports a layer above it.

cli -> pipeline -> checkpoint -> calib -> (parallel, models) -> formats; ``report``/``verify``
sit beside the library and under the CLI; only the CLI and the front door (``qckpt/api.py``,
beside the CLI) call the pipeline, and nothing inside the package imports the front door. A lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "qckpt"

# (modules the rule covers, as path prefixes relative to qckpt/) -> packages they must not import
RULES = [
    (("parallel/", "formats/"), ("qckpt.calib", "qckpt.checkpoint", "qckpt.cli")),
    (("report.py", "verify.py"), ("qckpt.cli",)),
    (("pipeline/",), ("qckpt.cli",)),
]


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (``from qckpt import cli`` -> ``qckpt.cli``)."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; an __init__'s is its own
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _hits(imports: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imports if any(m == b or m.startswith(b + ".") for b in banned))


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


@pytest.mark.parametrize(("covered", "banned"), RULES, ids=lambda v: "+".join(v))
def test_lower_layers_do_not_import_upper(covered, banned):
    bad = {
        _rel(p): hits
        for p in _modules()
        if _rel(p).startswith(covered) and (hits := _hits(_imports(p), banned))
    }
    assert not bad, bad


def test_only_the_cli_imports_the_cli():
    allowed = ("cli/", "__main__.py")
    bad = {
        _rel(p): hits
        for p in _modules()
        if not _rel(p).startswith(allowed) and (hits := _hits(_imports(p), ("qckpt.cli",)))
    }
    assert not bad, bad


def test_only_the_cli_calls_the_pipeline():
    allowed = ("cli/", "pipeline/", "__main__.py", "api.py")
    bad = {
        _rel(p): hits
        for p in _modules()
        if not _rel(p).startswith(allowed) and (hits := _hits(_imports(p), ("qckpt.pipeline",)))
    }
    assert not bad, bad


def test_nothing_inside_the_package_imports_the_front_door():
    # qckpt/__init__.py names qckpt.api in strings (a lazy lookup), not in an import
    bad = {
        _rel(p): hits
        for p in _modules()
        if _rel(p) != "api.py" and (hits := _hits(_imports(p), ("qckpt.api",)))
    }
    assert not bad, bad


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    # the rules would pass vacuously if the parser missed these spellings
    pkg = tmp_path / "qckpt" / "parallel"
    pkg.mkdir(parents=True)
    mod = pkg / "x.py"
    mod.write_text("def f():\n    from ..calib import sync\n    import qckpt.cli.app\n")
    global PKG
    saved, PKG = PKG, tmp_path / "qckpt"
    try:
        got = _hits(_imports(mod), ("qckpt.calib", "qckpt.cli"))
    finally:
        PKG = saved
    assert got == ["qckpt.calib", "qckpt.calib.sync", "qckpt.cli.app"]
