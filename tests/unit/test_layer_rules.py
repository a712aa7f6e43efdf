"""The layering rules of ``tests/unit/layer_rules.py`` on small planted trees: each rule reports
the violation planted for it, and a clean tree passes (so ``tests/unit/test_layers.py`` cannot
pass on ``qckpt/`` because a rule stopped seeing anything)."""

from __future__ import annotations

from pathlib import Path

from tests.unit.layer_rules import (
    ROOT,
    Never,
    Tree,
    graph_faults,
    import_circles,
    imports,
    never_edges,
    private_names,
    private_uses,
    undeclared_imports,
    units,
)

LAYERS = [("top", ("top",)), ("mid", ("mid", "side")), ("low", ("low", "base", "__init__"))]
GRAPH = {
    "__init__": set(),
    "top": {"mid", "low", "base"},
    "mid": {"low", "side"},
    "side": {"base"},
    "low": {"base"},
    "base": set(),
}

CLEAN = {
    "__init__.py": "",
    "base.py": "X = 1\n",
    "low/__init__.py": "",
    "low/a.py": "from fk.base import X\n",
    "low/_p.py": "from fk.low import _q\n",  # one package's private modules may circle
    "low/_q.py": "def f():\n    from fk.low import _p\n",
    # a type-only import never runs: no circle
    "low/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fk.low import f\n",
    "low/f.py": "from fk.low import e\n",
    "side.py": "import fk.base\n",
    "mid/__init__.py": "from . import m\n",
    "mid/m.py": "from ..low import a\nfrom fk import side\nimport fk\n",
    "top/__init__.py": "",
    "top/t.py": "from fk.mid.m import a\nfrom fk.low.a import X\nimport json\n",
}


def plant(tmp_path: Path, extra: dict[str, str] | None = None) -> Tree:
    for rel, src in {**CLEAN, **(extra or {})}.items():
        path = tmp_path / "fk" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
    return Tree(tmp_path, "fk")


def test_a_clean_tree_passes_every_rule(tmp_path):
    tree = plant(tmp_path)
    assert units(tree) == set(GRAPH)
    assert import_circles(tree) == []
    assert undeclared_imports(tree, GRAPH) == []
    assert graph_faults(GRAPH, LAYERS) == []
    assert private_names(tmp_path, ("fk/**/*.py",), first_party=("fk",)) == {}


def test_a_circle_is_seen_through_a_lazy_import(tmp_path):
    tree = plant(
        tmp_path,
        {
            "low/c.py": "import fk.low.d\n",
            "low/d.py": "def f():\n    from fk.low import c\n",
            # private modules of two packages: not their own circle
            "side.py": "import fk.base\nfrom fk.low import _r\n",
            "low/_r.py": "def g():\n    import fk.side\n",
        },
    )
    assert import_circles(tree) == [["fk.low._r", "fk.side"], ["fk.low.c", "fk.low.d"]]


def test_an_undeclared_edge_is_seen_in_every_spelling(tmp_path):
    tree = plant(
        tmp_path,
        {
            "low/up.py": "def g():\n    from fk.top import t\n",  # lazy, running up
            "low/rel.py": "from ..mid import m\n",  # relative
            "low/typed.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from fk import side\n",  # type-only
            "side.py": "import fk.base\nimport fk.low.a as a\n",  # declared? no: side -> low
            "stray.py": "",  # a unit the graph does not know
        },
    )
    assert undeclared_imports(tree, GRAPH) == [
        "low/rel.py:1: low -> mid (fk.mid.m)",
        "low/typed.py:3: low -> side (fk.side)",
        "low/up.py:2: low -> top (fk.top.t)",
        "side.py:2: side -> low (fk.low.a)",
        "stray.py: unit 'stray' is not in the graph (declare it)",
    ]


def test_a_declared_graph_that_runs_up_or_circles_is_refused():
    bad = {
        **GRAPH,
        "low": {"base", "mid"},  # runs up
        "side": {"mid", "ghost"},  # a circle with mid; an unknown unit
        "lost": set(),  # in no layer
    }
    assert graph_faults(bad, LAYERS) == [
        "lost: in 0 layers",
        "low -> mid: runs up (low under mid)",
        "side -> ghost: ghost is not in the graph",
        "circle: low -> mid -> side",
    ]


def test_the_never_edges_are_refused_whatever_the_layers_allow():
    never = Never(
        only_from={"top": frozenset(), "mid": frozenset({"top"})},
        only_to={"base": frozenset()},
        edges={("side", "base"): "side keeps off base"},
    )
    assert never_edges(GRAPH, never) == ["side -> base: side keeps off base"]
    bad = {**GRAPH, "mid": {"top"}, "base": {"low"}, "low": {"mid"}}
    assert never_edges(bad, never) == [
        "base -> low: base imports nothing",
        "low -> mid: only top may import mid",
        "mid -> top: nothing may import top",
        "side -> base: side keeps off base",
    ]


def test_a_private_name_is_seen_in_a_planted_tree(tmp_path):
    plant(
        tmp_path,
        {
            "low/a.py": "from fk.base import X\nfrom fk.low import _p\n",  # its own package's
            "mid/m.py": "from fk.low import _p\nimport fk.base as b\nY = b._hidden\n",
        },
    )
    assert private_names(tmp_path, ("fk/**/*.py",), first_party=("fk",)) == {
        "fk/mid/m.py": ["1: from fk.low import _p", "3: b._hidden"]
    }


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
    assert private_uses(ROOT / "qckpt" / "cli" / "app.py") == []
    pkg = tmp_path / "qckpt" / "parallel"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(src.read_text())
    (tmp_path / "qckpt" / "calib").mkdir()
    (tmp_path / "qckpt" / "calib" / "sync.py").write_text("")
    mods = {m for m, _ in imports(pkg / "x.py", tmp_path)}
    assert "qckpt.calib.sync" in mods and "qckpt.cli._torchrun" in mods, mods
