"""No function over 80 lines in qckpt/ (Triton kernels excepted: one kernel is one launch)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "qckpt"
LIMIT = 80


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


def test_no_long_functions():
    assert long_functions() == []


def test_the_check_counts_lines_and_spares_kernels(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(
        f"def long():\n{body}\n\n@triton.jit\ndef kernel():\n{body}\n\ndef short():\n    pass\n"
    )
    assert long_functions(tmp_path) == [f"m.py:long ({LIMIT + 1} lines)"]
