"""Never run a model directory's own Python code.

A Hugging Face model dir can ask transformers to import Python files that ship with it: an
``auto_map`` in ``config.json`` (or in the tokenizer's, processor's or feature extractor's
config) names ``module.Class`` entries that transformers imports from the directory. Asked
without ``trust_remote_code``, transformers *prompts on stdin* and a ``y`` runs the code. qckpt
refuses such a directory outright, before transformers is asked anything, and passes
``trust_remote_code=False`` wherever it calls transformers as a second line of defence.
"""

from __future__ import annotations

import json
from pathlib import Path

from qckpt.errors import UsageError

# the files of a model dir whose ``auto_map`` transformers follows
CONFIG_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "feature_extractor_config.json",
)
_MAX_CONFIG_BYTES = 64 << 20  # a config larger than this is not one; leave it to the reader


def _auto_map(path: Path) -> dict | None:
    """The ``auto_map`` of a JSON config file, or None (missing, unreadable: not our concern
    here; the reader that needs the file reports it)."""
    try:
        if not path.is_file() or path.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    found = data.get("auto_map")
    if found is None:
        return None
    return found if isinstance(found, dict) else {"auto_map": found}


def _modules(auto_map: dict) -> list[str]:
    """The Python files an ``auto_map`` points at (``repo--module.Class`` or lists of them)."""
    out: list[str] = []
    for ref in auto_map.values():
        for r in ref if isinstance(ref, list) else [ref]:
            if isinstance(r, str) and "." in r:
                name = r.split("--")[-1].rsplit(".", 1)[0] + ".py"
                if name not in out:
                    out.append(name)
    return out


def refuse_custom_code(model_dir: str | Path, what: str = "model.source") -> None:
    """Raise :class:`UsageError` if ``model_dir`` asks transformers to run its own code."""
    d = Path(model_dir)
    for name in CONFIG_FILES:
        found = _auto_map(d / name)
        if found is None:
            continue
        files = _modules(found)
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        detail = f" ({shown})" if files else ""
        raise UsageError(
            f"{what}: {d / name} asks to run the model directory's own Python code via "
            f"auto_map{detail}; qckpt never runs code from a model dir"
        )
