"""Which imported modules were compiled from source because no bytecode cache was there.

Python keeps each module's compiled form beside its source (``__pycache__/*.pyc``, or under
``sys.pycache_prefix``). Where none is there and none can be written (``PYTHONDONTWRITEBYTECODE``,
a read-only install, an image built with ``pip --no-compile``), every process compiles every
module it imports again: on the H200 machine torch and sympy imported 4-10x slower than where
their caches exist (issue 18). A command cannot fix its environment, but its report can say so.

Torch-free (stdlib only): ``phases.summary`` calls it for every command's ``--json``.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from types import ModuleType
from typing import Any

# above this much source compiled at import, the report says how to cache it (about 3 MB/s
# is what compile() reached here, so this is ~1 s of every command's start-up)
WARN_SOURCE_BYTES = 3 * 2**20


def _uncached(mod: ModuleType, listed: dict[str, set[str]]) -> str | None:
    """``mod``'s source path when it came from a ``.py`` file whose bytecode cache is absent."""
    spec = getattr(mod, "__spec__", None)
    origin = getattr(spec, "origin", None)
    cached = getattr(spec, "cached", None)
    if not (origin and cached and origin.endswith(".py")):
        return None  # built-in, extension, namespace package or sourceless
    folder, name = os.path.split(cached)
    if folder not in listed:
        try:
            listed[folder] = set(os.listdir(folder))  # one listing per folder, not a stat each
        except OSError:
            listed[folder] = set()
    return None if name in listed[folder] else origin


def compiled_at_import(modules: dict[str, Any] | None = None, top: int = 6) -> dict[str, Any]:
    """``{"modules": n, "source_bytes": b, "by_package": {pkg: n}, "writes_bytecode": bool}``:
    the modules among ``modules`` (default ``sys.modules``) loaded from source with no bytecode
    cache beside it, so that every process compiles them again. A cache this process wrote
    itself exists by now and is not counted (the next process finds it)."""
    listed: dict[str, set[str]] = {}
    count: Counter[str] = Counter()
    size = 0
    for name, mod in list((sys.modules if modules is None else modules).items()):
        if not isinstance(mod, ModuleType) or name.startswith("__"):
            continue  # __main__ (and multiprocessing's alias of it) is the script run
        origin = _uncached(mod, listed)
        if origin is None:
            continue
        count[name.partition(".")[0]] += 1
        try:
            size += os.path.getsize(origin)
        except OSError:
            pass
    return {
        "modules": sum(count.values()),
        "source_bytes": size,
        "by_package": dict(count.most_common(top)),
        "writes_bytecode": not sys.dont_write_bytecode,
        "pycache_prefix": sys.pycache_prefix,
    }


def advice(info: dict[str, Any]) -> str | None:
    """One line for the report when the start-up compiled a lot of source, else None."""
    if not info or info.get("source_bytes", 0) < WARN_SOURCE_BYTES:
        return None
    pkgs = ", ".join(f"{k} {v}" for k, v in info["by_package"].items())
    why = (
        "PYTHONDONTWRITEBYTECODE is set"
        if not info.get("writes_bytecode", True)
        else "their caches could not be written"
    )
    return (
        f"start-up compiled {info['modules']} modules from source "
        f"({info['source_bytes'] / 2**20:.0f} MiB: {pkgs}; {why}): every run pays for it; "
        "`python -m compileall -q -j 0 DIR` once on the install (or PYTHONPYCACHEPREFIX set to a "
        "compiled, writable dir) removes it"
    )
