"""Reading recipe YAML safely: bounded size, no alias bombs, no duplicate keys, short messages.

``yaml.safe_load`` refuses Python objects but not everything a careless or hostile file can do:

* an *alias bomb* (anchors that alias anchors, a few hundred bytes) loads as shared objects in
  microseconds, but anything that walks or prints the value (an error message, a deep copy)
  expands it to gigabytes. So the composed node graph is measured, aliases expanded, before
  anything is constructed, and a recipe whose expansion exceeds :data:`MAX_NODES` is refused;
* a key given twice in one mapping silently keeps the last value; here it is an error naming the
  key's YAML path and both lines;
* deep nesting makes PyYAML's recursive composer raise ``RecursionError``; it is a one-line
  error like any other.

:func:`show` is how every recipe message quotes a value: a bounded ``repr`` cut to
:data:`MAX_SHOWN` characters, so no message can grow with the input.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.events import MappingEndEvent, MappingStartEvent, SequenceEndEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from qckpt.errors import RecipeError

MAX_BYTES = 256 << 10  # a recipe is a few hundred bytes; this leaves room for long ignore lists
MAX_NODES = 10_000  # YAML nodes after expanding every alias
MAX_DEPTH = 64  # nesting levels (a recipe uses 4)
MAX_SHOWN = 80  # characters of a value quoted in a message

_MERGE = "tag:yaml.org,2002:merge"

_repr = reprlib.Repr()
_repr.maxstring = MAX_SHOWN
_repr.maxother = MAX_SHOWN
_repr.maxlevel = 3


def show(value: Any) -> str:
    """``repr(value)`` for a message: bounded work, at most ~``MAX_SHOWN`` characters."""
    text = _repr.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "…"


def _where(node: Node) -> str:
    return f"line {node.start_mark.line + 1}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Checker:
    """Counts the nodes of a composed document with aliases expanded; finds duplicate keys.

    A node reached through several aliases is the same Python object, so its expanded size is
    computed once (memoized by ``id``): the cost is linear in the *text*, never in the expansion.
    """

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.active: set[int] = set()

    def size(self, node: Node, path: str, depth: int) -> int:
        key = id(node)
        if key in self.sizes:
            return self.sizes[key]
        if depth > MAX_DEPTH:
            raise RecipeError(f"{path or 'recipe'}: nested more than {MAX_DEPTH} levels deep")
        if key in self.active:
            raise RecipeError(f"{path or 'recipe'}: an alias refers to itself ({_where(node)})")
        self.active.add(key)
        n = 1
        if isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                n += self.size(item, f"{path}[{i}]", depth + 1)
                self._cap(n, path)
        elif isinstance(node, MappingNode):
            self._duplicates(node, path)
            for k, v in node.value:
                name = k.value if isinstance(k, ScalarNode) else "?"
                n += self.size(k, path, depth + 1) + self.size(v, _join(path, name), depth + 1)
                self._cap(n, path)
        self.active.discard(key)
        self.sizes[key] = n
        return n

    @staticmethod
    def _cap(n: int, path: str) -> None:
        if n > MAX_NODES:
            raise RecipeError(
                f"{path or 'recipe'}: expands to more than {MAX_NODES} YAML nodes "
                "(an alias bomb?); a recipe is a few small sections"
            )

    @staticmethod
    def _duplicates(node: MappingNode, path: str) -> None:
        seen: dict[tuple[str, str], Node] = {}
        for k, _ in node.value:
            if not isinstance(k, ScalarNode) or k.tag == _MERGE:
                continue  # merge keys may repeat and be overridden: that is what they are for
            first = seen.setdefault((k.tag, k.value), k)
            if first is not k:
                raise RecipeError(
                    f"{_join(path, _cut(k.value))}: given twice "
                    f"({_where(first)} and {_where(k)}); keep one"
                )


def _prescan(text: str, where: str) -> None:
    """Bound depth and size on the event stream, before composing anything.

    PyYAML's scanner spends time proportional to the nesting depth on every token (quadratic
    overall: 20,000 ``[`` take minutes) and its composer recurses; the event stream is produced
    lazily, so stopping here at the first event past a limit costs almost nothing.
    """
    depth = events = 0
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        events += 1
        if isinstance(ev, (SequenceStartEvent, MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                line = ev.start_mark.line + 1
                raise RecipeError(f"{where}: line {line}: nested more than {MAX_DEPTH} levels deep")
        elif isinstance(ev, (SequenceEndEvent, MappingEndEvent)):
            depth -= 1
        if events > 2 * MAX_NODES:  # a node is one event (two for a collection)
            raise RecipeError(f"{where}: more than {MAX_NODES} YAML nodes; not a recipe")


def safe_parse(text: str, where: str = "recipe") -> Any:
    """Parse one YAML document; ``yaml.YAMLError`` for bad syntax, :class:`RecipeError` for a
    document too large once expanded, too deep, with a key given twice, or a value Python
    cannot hold (an integer of thousands of digits, February 30)."""
    _prescan(text, where)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _Checker().size(node, "", 0)
        try:
            return loader.construct_document(node)
        except (ValueError, OverflowError) as exc:
            raise RecipeError(f"{where}: a value cannot be read: {_cut(exc)}") from None
    except RecursionError:
        raise RecipeError(f"{where}: nested more than {MAX_DEPTH} levels deep") from None
    finally:
        loader.dispose()


def parse_yaml(text: str, where: str) -> Any:
    """The value of a YAML document, or :class:`RecipeError` naming ``where`` and what is wrong."""
    try:
        return safe_parse(text, where)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [""])[0]
        raise RecipeError(f"{where}: not valid YAML{at}: {_cut(problem)}") from None


def _cut(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "…"


def read_yaml_file(path: str | Path) -> Any:
    """Read a recipe file (bounded, UTF-8) and parse it with :func:`parse_yaml`."""
    p = Path(path)
    if not p.is_file():  # also refuses FIFOs and devices, which could block or never end
        raise RecipeError(f"{path}: recipe file not found")
    try:
        with p.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise RecipeError(f"{path}: larger than {MAX_BYTES >> 10} KiB; not a recipe")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    return parse_yaml(text, str(path))
