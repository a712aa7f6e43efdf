"""The layering of ``qckpt/`` (issues 28, 41), read from the source with ``ast``: the rules of
``tests/unit/layer_rules.py`` (self-tested in ``tests/unit/test_layer_rules.py``) on the real
tree, with its layers and its declared graph (docs/ARCHITECTURE.md, "Layers and seams").

* **No import circle** between modules, except among one package's own private (``_x.py``)
  modules (type-only imports aside: they never run).
* **Every import is declared**: a unit (a folder of ``qckpt/`` or a top-level module) imports
  only the units :data:`MAY_IMPORT` names for it. The declared graph runs down :data:`LAYERS`
  (top first), has no circle, and holds none of the documented "never" edges (:data:`NEVER`).
* **No private name across modules**: no ``_x`` imported from another module or read off an
  imported module (``mod._x``), and a package's private module imported only from inside that
  package, in ``qckpt/``, ``tests/`` and ``bench/``. Third-party privates (torch's) are not ours
  to rename and are not looked at.

Every import counts: a lazy one inside a function as much as one at the top, and one under
``if TYPE_CHECKING:`` too (a type is a dependency all the same).
"""

from __future__ import annotations

import re
from itertools import takewhile

from tests.unit.layer_rules import (
    ROOT,
    Never,
    Tree,
    graph_faults,
    import_circles,
    never_edges,
    private_names,
    undeclared_imports,
    units,
)

TREE = Tree(ROOT, "qckpt")

# top to bottom: the data flows up, formats -> storage -> layouts -> read -> load -> calib ->
# export. Units: a folder of qckpt/ (``calib``) or a top-level module (``recipe``)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("front door", ("__init__", "__main__", "api")),
    ("cli", ("cli",)),
    ("pipeline", ("pipeline",)),
    ("command libraries", ("evaluate", "plan", "search", "recipe_init", "inspect", "verify", "plot")),
    ("export, convert", ("export", "convert")),
    ("calib", ("calib",)),
    ("load", ("load",)),
    ("read", ("read",)),
    ("layouts", ("layouts",)),
    ("parallel", ("parallel",)),
    ("models", ("models",)),
    ("storage", ("storage",)),
    ("formats", ("formats",)),
    ("rendering", ("report", "summary", "term")),
    (
        "base",
        ("recipe", "recipe_yaml", "errors", "kernel_policy", "atomic", "outputs", "phases",
         "memory", "bytecode"),
    ),
]  # fmt: skip


def below(layer: str) -> frozenset[str]:
    """Every unit of the layers under ``layer``."""
    names = [name for name, _ in LAYERS]
    return frozenset(u for _, members in LAYERS[names.index(layer) + 1 :] for u in members)


# the recipe's dataclasses and the error types: read by every stage above the bytes and the
# quantized tensors
DATA = frozenset({"recipe", "errors"})

# unit -> the units it may import (its own modules always). An edge not here fails the test:
# add it here (and to docs/ARCHITECTURE.md) when it is meant, within LAYERS and NEVER
MAY_IMPORT: dict[str, frozenset[str]] = {
    # qckpt/__init__ names its modules in strings, looked up on first use (PEP 562)
    "__init__": frozenset(),
    "__main__": frozenset({"cli"}),
    "api": below("cli"),
    "cli": below("cli"),
    "pipeline": below("pipeline"),
    "evaluate": DATA | {"calib", "read", "layouts", "storage", "models", "formats"},
    "plan": DATA | {"calib", "read", "layouts", "parallel", "models", "formats", "report"},
    "search": DATA | {"calib", "layouts", "parallel", "models", "formats"},
    "recipe_init": DATA | {"plan", "models", "formats", "report"},
    "inspect": DATA | {"calib", "read", "layouts", "storage", "models", "formats"},
    "verify": DATA | {"read", "layouts", "storage", "models", "formats", "term"},
    "plot": DATA | {"load"},
    "export": DATA
    | {"calib", "read", "layouts", "storage", "parallel", "models", "formats"}
    | {"memory", "phases", "outputs", "atomic", "kernel_policy"},
    "convert": DATA | {"load", "read", "storage", "models", "formats", "outputs"},
    "calib": DATA
    | {"load", "read", "layouts", "storage", "parallel", "models", "formats"}
    | {"phases", "atomic", "kernel_policy", "memory", "term"},
    "load": DATA | {"read", "layouts", "storage", "parallel", "models", "formats"}
    | {"memory", "phases"},
    "read": DATA | {"layouts", "storage", "models", "formats", "phases"},
    "layouts": DATA | {"storage", "models", "formats"},
    "parallel": DATA | {"models"},
    "models": DATA | {"formats"},
    "storage": frozenset({"errors"}),
    "formats": frozenset({"kernel_policy", "errors"}),
    "report": frozenset({"term", "bytecode"}),
    "summary": frozenset({"report"}),
    "term": frozenset(),
    "recipe": frozenset({"recipe_yaml", "errors"}),
    "recipe_yaml": frozenset({"errors"}),
    "errors": frozenset(),
    "kernel_policy": frozenset(),
    "atomic": frozenset({"recipe", "errors"}),
    "outputs": frozenset({"atomic", "recipe", "errors"}),
    "phases": frozenset({"bytecode", "memory"}),
    "memory": frozenset(),
    "bytecode": frozenset(),
}  # fmt: skip

# the documented "never" edges: no MAY_IMPORT may hold one, whatever LAYERS allows
NEVER = Never(
    only_from={
        "cli": frozenset({"__main__"}),  # a command's rendering and exits are its own
        "pipeline": frozenset({"cli", "api"}),  # the commands' bodies: called, never shared
        "api": frozenset(),  # the library user's verbs; qckpt/__init__ names it in strings
        "__main__": frozenset(),
    },
    only_to={
        "__init__": frozenset(),  # ``import qckpt`` imports no torch
        "storage": frozenset({"errors"}),  # bytes in files, no quantization
        "formats": frozenset({"kernel_policy", "errors"}),
        "errors": frozenset(),
    },
    edges={
        ("export", "load"): "an export reads a checkpoint's tensors (read/), never a model",
    },
)


def test_the_layers_follow_the_data():
    order = [name for name, _ in LAYERS]
    flow = ["formats", "storage", "layouts", "read", "load", "calib", "export, convert"]
    assert [order.index(n) for n in flow] == sorted((order.index(n) for n in flow), reverse=True)


def test_the_declared_graph_runs_down_and_keeps_the_never_rules():
    assert graph_faults(MAY_IMPORT, LAYERS) == []
    assert never_edges(MAY_IMPORT, NEVER) == []


def test_every_unit_is_declared_and_exists():
    assert units(TREE) == set(MAY_IMPORT)


def test_every_import_is_declared():
    assert undeclared_imports(TREE, MAY_IMPORT) == []


def test_no_import_circle():
    assert import_circles(TREE) == []


def test_no_private_name_crosses_a_module():
    assert private_names(ROOT, ("qckpt/**/*.py", "tests/**/*.py", "bench/**/*.py")) == {}


def _unit_word(word: str) -> bool:
    return re.fullmatch(r"\w+(/|\.py)", word) is not None


def _doc_section() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    return text.split("## Layers and seams\n", 1)[1].split("\n## ", 1)[0]


def test_the_architecture_doc_states_these_layers_and_this_graph():
    section = _doc_section()
    block = section.split("```\n", 2)[1]
    # a layer line names its units first (``export/  convert/``), then says what they hold
    named = [
        {w.removesuffix("/").removesuffix(".py") for w in takewhile(_unit_word, line.split())}
        for line in block.splitlines()
    ]
    assert named == [set(members) for _, members in LAYERS]
    table: dict[str, frozenset[str]] = {}
    for row in re.findall(r"^\| (`.+?) \| (.+) \|$", section, re.M):
        below_of = re.match(r"every unit below `(\w+)`", row[1])
        said = below(below_of[1]) if below_of else frozenset(re.findall(r"`(\w+)`", row[1]))
        table |= {unit: said for unit in re.findall(r"`(\w+)`", row[0])}
    assert table == MAY_IMPORT
