"""The layering rules as functions of any source tree, read with ``ast`` (nothing is imported).

``tests/unit/test_layers.py`` runs them on ``qckpt/`` with its declared graph;
``tests/unit/test_layer_rules.py`` runs them on small planted trees, so that a rule which
stopped seeing anything would fail there instead of passing here vacuously.

A tree's *unit* is what the graph names: a top-level folder of the package (``calib`` for every
module under ``qckpt/calib/``) or a top-level module (``recipe`` for ``qckpt/recipe.py``,
``__init__`` for the package's own ``__init__.py``). Every import counts: a lazy one inside a
function as much as one at the top, and one under ``if TYPE_CHECKING:`` too (a type is a
dependency all the same); only the circle rule leaves type-only imports out (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

Graph = Mapping[str, Iterable[str]]


def is_module(name: str, root: Path = ROOT) -> bool:
    """Whether dotted ``name`` is a module or package under ``root``."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@lru_cache(maxsize=4096)
def _parsed(path: str, mtime_ns: int) -> ast.Module:
    return ast.parse(Path(path).read_text(), path)


def parse(path: Path) -> ast.Module:
    """``path`` parsed, once per version of the file (the rules read every module more than
    once)."""
    return _parsed(str(path), path.stat().st_mtime_ns)


def type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (they never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def imports_at(path: Path, root: Path = ROOT) -> Iterator[tuple[str, bool, int]]:
    """(module imported, whether only for typing, line) for every import of ``path`` (a file
    under ``root``): a name taken from a package counts as that package's submodule when it
    is one."""
    tree = parse(path)
    typing = type_only(tree)
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; an __init__'s is its own
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, id(node) in typing, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                mod = sub if is_module(sub, root) else base
                yield mod, id(node) in typing, node.lineno


def imports(path: Path, root: Path = ROOT) -> Iterator[tuple[str, bool]]:
    """(module imported, whether only for typing) for every import of ``path``."""
    for mod, typing, _ in imports_at(path, root):
        yield mod, typing


@dataclass(frozen=True)
class Tree:
    """One first-party package: ``root / package`` holds its modules."""

    root: Path
    package: str = "qckpt"

    @property
    def top(self) -> Path:
        return self.root / self.package

    def modules(self) -> list[Path]:
        return sorted(self.top.rglob("*.py"))

    def rel(self, path: Path) -> str:
        """``.../qckpt/read/sources.py`` -> ``read/sources.py``."""
        return path.relative_to(self.top).as_posix()

    def name(self, path: Path) -> str:
        """``qckpt/read/sources.py`` -> ``qckpt.read.sources``; a package's ``__init__`` -> it."""
        parts = path.relative_to(self.root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def unit(self, path: Path) -> str:
        """The unit of the graph the file at ``path`` belongs to."""
        return Path(self.rel(path)).parts[0].removesuffix(".py")

    def unit_of(self, mod: str) -> str:
        """The unit of dotted module ``mod`` of this package (``qckpt`` itself: ``__init__``)."""
        parts = mod.split(".")[1:]
        return parts[0] if parts else "__init__"

    def own_imports(self, path: Path) -> Iterator[tuple[str, bool, int]]:
        """The imports of ``path`` of this package's modules. ``import qckpt`` alone (its
        ``__version__``, or the package every submodule import passes through) is nobody's
        edge: the front door's lazy table imports nothing."""
        for mod, typing, line in imports_at(path, self.root):
            if mod.startswith(self.package + ".") and is_module(mod, self.root):
                yield mod, typing, line


# ---- circles ---------------------------------------------------------------------------------


def module_graph(tree: Tree, *, typing: bool) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``typing``: type-only imports too)."""
    out: dict[str, set[str]] = {}
    for p in tree.modules():
        me = tree.name(p)
        out[me] = {m for m, t, _ in tree.own_imports(p) if typing or not t} - {me}
    return out


def strong_components(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
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


def private_module(mod: str) -> bool:
    return mod.rpartition(".")[2].startswith("_") and not mod.endswith("__init__")


def allowed_circle(comp: list[str]) -> bool:
    """Only one package's own private modules (``qckpt.formats._x``), nothing else."""
    packages = {m.rpartition(".")[0] for m in comp}
    return len(packages) == 1 and all(private_module(m) for m in comp)


def import_circles(tree: Tree) -> list[list[str]]:
    """The import circles of ``tree`` that the rule refuses (type-only imports left out)."""
    return [c for c in strong_components(module_graph(tree, typing=False)) if not allowed_circle(c)]


# ---- the declared graph ----------------------------------------------------------------------


def units(tree: Tree) -> set[str]:
    return {tree.unit(p) for p in tree.modules()}


def undeclared_imports(tree: Tree, may_import: Graph) -> list[str]:
    """Every import of one unit's module from another unit that ``may_import`` does not
    declare, as ``rel:line: unit -> unit (module)``; a module whose unit the graph lacks, as
    ``rel: unit ... not in the graph``."""
    out: list[str] = []
    for p in tree.modules():
        me = tree.unit(p)
        if me not in may_import:
            out.append(f"{tree.rel(p)}: unit {me!r} is not in the graph (declare it)")
            continue
        allowed = set(may_import[me]) | {me}
        for mod, _, line in tree.own_imports(p):
            if (to := tree.unit_of(mod)) not in allowed:
                out.append(f"{tree.rel(p)}:{line}: {me} -> {to} ({mod})")
    return out


@dataclass(frozen=True)
class Never:
    """The documented "never" edges, which no declared graph may hold. ``only_from``: a unit
    -> the only units (beside itself) that may import it; ``only_to``: a unit -> the only
    units it may import; ``edges``: (importer, imported) -> why not."""

    only_from: Mapping[str, frozenset[str]]
    only_to: Mapping[str, frozenset[str]]
    edges: Mapping[tuple[str, str], str]


def never_edges(graph: Graph, never: Never) -> list[str]:
    """The edges of ``graph`` that ``never`` forbids, as ``a -> b: why``."""
    out = []
    for a in sorted(graph):
        for b in sorted(set(graph[a]) - {a}):
            if b in never.only_from and a not in never.only_from[b]:
                who = ", ".join(sorted(never.only_from[b]))
                why = f"only {who} may import {b}" if who else f"nothing may import {b}"
                out.append(f"{a} -> {b}: {why}")
            if a in never.only_to and b not in never.only_to[a]:
                what = ", ".join(sorted(never.only_to[a]))
                why = f"{a} imports only {what}" if what else f"{a} imports nothing"
                out.append(f"{a} -> {b}: {why}")
            if (a, b) in never.edges:
                out.append(f"{a} -> {b}: {never.edges[a, b]}")
    return out


def graph_faults(graph: Graph, layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """What is wrong with a declared graph against its layers (top first): a unit in no layer
    or in several, an edge to an undeclared unit, an edge running up, a circle of units."""
    where: dict[str, list[int]] = {}
    for i, (_, members) in enumerate(layers):
        for u in members:
            where.setdefault(u, []).append(i)
    out = [
        f"{u}: in {len(where.get(u, []))} layers"
        for u in sorted(graph)
        if len(where.get(u, [])) != 1
    ]
    for a in sorted(graph):
        for b in sorted(set(graph[a]) - {a}):
            if b not in graph:
                out.append(f"{a} -> {b}: {b} is not in the graph")
            elif len(where.get(a, [])) == len(where.get(b, [])) == 1 and where[b][0] < where[a][0]:
                out.append(
                    f"{a} -> {b}: runs up ({layers[where[a][0]][0]} under {layers[where[b][0]][0]})"
                )
    out += [f"circle: {' -> '.join(c)}" for c in strong_components(graph)]
    return out


# ---- private names ---------------------------------------------------------------------------


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _home(path: Path, root: Path) -> str:
    """The package a file belongs to (``tests/unit/x.py`` -> ``tests.unit``; "" elsewhere)."""
    try:
        return ".".join(path.relative_to(root).parts[:-1])
    except ValueError:  # a file outside the tree (a self-test's own)
        return ""


def private_module_outside(mod: str, home: str) -> bool:
    """``mod`` has a private part (``qckpt.cli._common``) whose package is not ``home``'s own
    (a package's private modules are its own: ``qckpt.cli`` and below may import it)."""
    parts = mod.split(".")
    for i, part in enumerate(parts):
        if private(part):
            owner = ".".join(parts[:i])
            return not (home == owner or home.startswith(owner + "."))
    return False


def private_uses(
    path: Path, root: Path = ROOT, first_party: tuple[str, ...] = ("qckpt", "tests", "bench")
) -> list[str]:
    """Every private name ``path`` takes from another first-party module (one under ``root``
    whose top package is in ``first_party``), as ``line: what``."""
    tree = parse(path)
    home = _home(path, root)

    def ours(mod: str) -> bool:
        return mod.split(".")[0] in first_party and is_module(mod, root)

    out: list[str] = []
    modules: set[str] = set()  # local names bound to a first-party module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if ours(a.name):
                    if private_module_outside(a.name, home):
                        out.append(f"{node.lineno}: import {a.name}")
                    modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mod = node.module
            if not ours(mod):
                continue
            if private_module_outside(mod, home):
                out.append(f"{node.lineno}: from {mod}")
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if is_module(sub, root):
                    if private_module_outside(sub, home):
                        out.append(f"{node.lineno}: from {mod} import {a.name}")
                    modules.add(a.asname or a.name)
                elif private(a.name):
                    out.append(f"{node.lineno}: from {mod} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):  # qckpt.formats.x._y: its first name
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(out), key=lambda s: (int(s.split(":")[0]), s))


def private_names(root: Path, patterns: Iterable[str], **kw) -> dict[str, list[str]]:
    """:func:`private_uses` of every file matching ``patterns`` under ``root``, by path."""
    return {
        p.relative_to(root).as_posix(): v
        for pattern in patterns
        for p in sorted(root.glob(pattern))
        if (v := private_uses(p, root, **kw))
    }
