"""The layering of ``qckpt/``, read from the source with ``ast`` (issue 28): three rules.

* **No import circle** between modules, except among one package's own private (``_x.py``)
  modules.
* **No import running up**: every module sits in one layer of :data:`LAYERS` (top first) and
  imports only from its own layer or the layers below it.
* **No private name across modules**: no ``_x`` imported from another module or read off an
  imported module (``mod._x``), and a package's private module imported only from inside that
  package, in ``qckpt/``, ``tests/`` and ``bench/``. Third-party privates (torch's) are not ours
  to rename and are not looked at.

Every import counts: a lazy one inside a function as much as one at the top, and one under
``if TYPE_CHECKING:`` too (a type is a dependency all the same).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "qckpt"

# top to bottom; a module may import its own layer and every layer below it. Paths are relative
# to qckpt/ (a folder: every module under it)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("front door", ("__init__.py", "__main__.py", "api.py")),
    ("cli", ("cli/",)),
    ("pipeline", ("pipeline/",)),
    (
        "command libraries",
        ("evaluate/", "plan/", "recipe_init.py", "inspect.py", "verify.py", "plot.py"),
    ),
    ("export, convert", ("export/", "convert/")),
    ("calib", ("calib/",)),
    ("load", ("load/",)),
    ("read", ("read/",)),
    ("layouts", ("layouts/",)),
    ("storage", ("storage/",)),
    ("parallel", ("parallel/",)),
    ("models", ("models/",)),
    ("formats", ("formats/",)),
    ("rendering", ("report.py", "summary.py", "term.py")),
    (
        "base",
        ("recipe.py", "recipe_yaml.py", "errors.py", "kernel_policy.py", "atomic.py",
         "outputs.py", "phases.py", "memory.py", "bytecode.py"),
    ),
]  # fmt: skip

# each layer's position, and each module's layer
_RANK = {prefix: i for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes}


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def layer_of(rel: str) -> int:
    """The index in :data:`LAYERS` of the module at ``rel`` (relative to qckpt/)."""
    hits = [i for prefix, i in _RANK.items() if rel == prefix or rel.startswith(prefix)]
    assert len(hits) == 1, f"{rel}: in {len(hits)} layers of LAYERS (place it in one)"
    return hits[0]


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _name(path: Path) -> str:
    """``qckpt/read/sources.py`` -> ``qckpt.read.sources``; a package's ``__init__`` -> it."""
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path = PKG.parent) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (they never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def imports(path: Path, root: Path = PKG.parent) -> Iterator[tuple[str, bool]]:
    """(module imported, whether only for typing) for every import of ``path``: a name taken
    from a package counts as that package's submodule when it is one."""
    tree = ast.parse(path.read_text(), str(path))
    typing = _type_only(tree)
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; an __init__'s is its own
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, id(node) in typing
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield (sub if _is_module(sub, root) else base), id(node) in typing


def _qckpt_imports(path: Path) -> Iterator[tuple[str, bool]]:
    for mod, typing in imports(path):
        # ``import qckpt`` (its __version__, or the package every submodule import passes
        # through) is no layer's: the front door's lazy table imports nothing
        if mod.startswith("qckpt.") and _is_module(mod):
            yield mod, typing


def _path(mod: str) -> Path:
    p = PKG.parent.joinpath(*mod.split("."))
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else p / "__init__.py"


def _graph(*, typing: bool) -> dict[str, set[str]]:
    """Module -> the qckpt modules it imports (``typing``: type-only imports too)."""
    out: dict[str, set[str]] = {}
    for p in _modules():
        out[_name(p)] = {m for m, t in _qckpt_imports(p) if typing or not t} - {_name(p)}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _private_module(mod: str) -> bool:
    return mod.rpartition(".")[2].startswith("_") and not mod.endswith("__init__")


def _allowed_circle(comp: list[str]) -> bool:
    """Only one package's own private modules (``qckpt.formats._x``), nothing else."""
    packages = {m.rpartition(".")[0] for m in comp}
    return len(packages) == 1 and all(_private_module(m) for m in comp)


def test_no_import_circle():
    bad = [c for c in _cycles(_graph(typing=False)) if not _allowed_circle(c)]
    assert not bad, bad


def test_every_module_has_a_layer():
    for p in _modules():
        layer_of(_rel(p))


def test_no_import_runs_up():
    bad = {}
    for p in _modules():
        mine = layer_of(_rel(p))
        up = sorted(m for m, _ in _qckpt_imports(p) if layer_of(_rel(_path(m))) < mine)
        if up:
            bad[_rel(p)] = up
    assert not bad, bad


def test_only_the_cli_imports_the_cli():
    allowed = ("cli/", "__main__.py")
    bad = {
        _rel(p): m
        for p in _modules()
        for m, _ in _qckpt_imports(p)
        if m.startswith("qckpt.cli") and not _rel(p).startswith(allowed)
    }
    assert not bad, bad


def test_only_the_cli_and_the_front_door_call_the_pipeline():
    allowed = ("cli/", "pipeline/", "__main__.py", "api.py")
    bad = {
        _rel(p): m
        for p in _modules()
        for m, _ in _qckpt_imports(p)
        if m.startswith("qckpt.pipeline") and not _rel(p).startswith(allowed)
    }
    assert not bad, bad


def test_nothing_inside_the_package_imports_the_front_door():
    # qckpt/__init__.py names qckpt.api in strings (a lazy lookup), not in an import
    bad = {
        _rel(p): m
        for p in _modules()
        for m, _ in _qckpt_imports(p)
        if m == "qckpt.api" and _rel(p) != "api.py"
    }
    assert not bad, bad


# ---- private names ---------------------------------------------------------------------------

FIRST_PARTY = ("qckpt", "tests", "bench")
SCANNED = ("qckpt/**/*.py", "tests/**/*.py", "bench/**/*.py")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _ours(mod: str) -> bool:
    return mod.split(".")[0] in FIRST_PARTY and _is_module(mod, ROOT)


def _home(path: Path) -> str:
    """The package a file belongs to (``tests/unit/x.py`` -> ``tests.unit``; "" elsewhere)."""
    try:
        return ".".join(path.relative_to(ROOT).parts[:-1])
    except ValueError:  # a file of the checker's own test
        return ""


def _private_module_outside(mod: str, home: str) -> bool:
    """``mod`` has a private part (``qckpt.cli.output``) whose package is not ``home``'s own
    (a package's private modules are its own: ``qckpt.cli`` and below may import it)."""
    parts = mod.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            owner = ".".join(parts[:i])
            return not (home == owner or home.startswith(owner + "."))
    return False


def private_uses(path: Path) -> list[str]:
    """Every private name ``path`` takes from another first-party module, as ``line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    home = _home(path)
    out: list[str] = []
    modules: set[str] = set()  # local names bound to a first-party module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    if _private_module_outside(a.name, home):
                        out.append(f"{node.lineno}: import {a.name}")
                    modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mod = node.module
            if not _ours(mod):
                continue
            if _private_module_outside(mod, home):
                out.append(f"{node.lineno}: from {mod}")
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if _is_module(sub, ROOT):
                    if _private_module_outside(sub, home):
                        out.append(f"{node.lineno}: from {mod} import {a.name}")
                    modules.add(a.asname or a.name)
                elif _private(a.name):
                    out.append(f"{node.lineno}: from {mod} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):  # qckpt.formats.x._y: its first name
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(out), key=lambda s: (int(s.split(":")[0]), s))


def test_no_private_name_crosses_a_module():
    found = {
        p.relative_to(ROOT).as_posix(): v
        for pattern in SCANNED
        for p in sorted(ROOT.glob(pattern))
        if (v := private_uses(p))
    }
    assert not found, found


def test_the_checkers_see_every_spelling(tmp_path):
    # the rules would pass vacuously if the parser missed these spellings
    src = tmp_path / "x.py"
    src.write_text(
        "import qckpt.export.stages as pipe\n"
        "from qckpt.cli import _common, app\n"
        "from qckpt.read import fast_read\n"
        "import qckpt.cli._torchrun\n"
        "from bench.formats import _timer\n"
        "def f(self):\n"
        "    from ..calib import sync\n"
        "    self._private_attr_of_its_own = 1\n"  # its own object's: not a module's
        "    return pipe._Pipeline, fast_read._byte_view, app.main._x, qckpt.formats.FORMATS\n"
    )
    got = [v.split(": ", 1)[1] for v in private_uses(src)]
    assert got == [
        "from qckpt.cli import _common",
        "import qckpt.cli._torchrun",
        "from bench.formats import _timer",
        "app.main._x",
        "fast_read._byte_view",
        "pipe._Pipeline",
    ], got
    # inside the package, its private modules are its own
    assert private_uses(PKG / "cli" / "app.py") == []
    pkg = tmp_path / "qckpt" / "parallel"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(src.read_text())
    (tmp_path / "qckpt" / "calib").mkdir()
    (tmp_path / "qckpt" / "calib" / "sync.py").write_text("")
    mods = {m for m, _ in imports(pkg / "x.py", tmp_path)}
    assert "qckpt.calib.sync" in mods and "qckpt.cli._torchrun" in mods, mods
