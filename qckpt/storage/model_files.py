"""The small files a model dir carries besides its weights, copied into what we write from it.

``export`` and ``convert --to hf`` both produce a model dir that transformers and serving stacks
open directly, so both bring along the tokenizer, the generation config and the chat template of
their source (never its weights, config.json or code: the writer makes those itself).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qckpt.storage.files import is_regular

CARRY_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_model_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy the :data:`CARRY_FILES` that ``src_dir`` holds as regular files; their names.

    Anything else under those names (a FIFO, a directory) is left alone: copying a FIFO would
    block forever, and it is no tokenizer.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    copied = []
    for name in CARRY_FILES:
        if is_regular(src / name):
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
