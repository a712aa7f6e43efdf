"""The size rules of qckpt/: no function over 80 lines (Triton kernels excepted: one kernel is
one launch) and no module over 700 lines (no exception: a module of kernels splits as well as
any other)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "qckpt"
LIMIT = 80
MODULE_LIMIT = 700


def _is_kernel(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def long_functions(root: Path = PKG) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_kernel(node):
                n = node.end_lineno - node.lineno + 1
                if n > LIMIT:
                    out.append(f"{path.relative_to(root).as_posix()}:{node.name} ({n} lines)")
    return out


def long_modules(root: Path = PKG, limit: int = MODULE_LIMIT) -> list[str]:
    """Every module under ``root`` of more than ``limit`` lines, as ``rel (n lines)``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root).as_posix()} ({n} lines)")
    return out


def test_no_long_functions():
    assert long_functions() == []


def test_no_long_modules():
    assert long_modules() == []


def test_the_check_counts_lines_and_spares_kernels(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(
        f"def long():\n{body}\n\n@triton.jit\ndef kernel():\n{body}\n\ndef short():\n    pass\n"
    )
    assert long_functions(tmp_path) == [f"m.py:long ({LIMIT + 1} lines)"]


def test_the_module_cap_counts_every_line_of_every_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    at_cap = "\n".join(f"x{i} = {i}" for i in range(MODULE_LIMIT)) + "\n"
    (tmp_path / "pkg" / "full.py").write_text(at_cap)
    (tmp_path / "small.py").write_text("x = 1\n")
    assert long_modules(tmp_path) == []
    (tmp_path / "pkg" / "over.py").write_text(at_cap + "\n")  # a blank line counts too
    assert long_modules(tmp_path) == [f"pkg/over.py ({MODULE_LIMIT + 1} lines)"]
