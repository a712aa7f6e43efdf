"""Calibration data as people keep it (``calibrate.data.source: dataset``): a Hugging Face
``datasets`` dir written by ``save_to_disk``, or JSONL / Parquet / Arrow files, local only.

A ``text`` column is tokenized as it is; a ``messages`` column (chat turns: ``role`` and
``content``) is rendered with the model's chat template first, as llm-compressor's and ModelOpt's
examples calibrate. Rows are shuffled with ``shuffle_seed`` (unset: in order), then tokenized one
at a time until ``num_samples`` samples of ``seq_len`` tokens are made, packed (the rows' tokens
concatenated and cut) or truncated (each row its own sample, shorter rows skipped).

JSONL needs nothing; Parquet and Arrow need ``pyarrow``, a save_to_disk dir needs ``datasets``
(``pip install datasets`` brings both): one line says so when they are missing.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qckpt.errors import CalibrationError, UsageError
from qckpt.recipe import DataConfig

if TYPE_CHECKING:
    import torch

KEY = "calibrate.data.path"
COLUMNS = ("messages", "text")
_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def _need(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"{KEY}: reading {what} needs the '{module.split('.')[0]}' package "
            "(pip install datasets)"
        ) from None


def _jsonl(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    if not all(isinstance(r, dict) for r in rows):
        raise CalibrationError(f"{KEY}: {path}: every row must be a JSON object")
    return rows


def _arrow_table(path: Path) -> Any:
    pa = _need("pyarrow", "Arrow files")
    if path.suffix == ".parquet":
        return _need("pyarrow.parquet", "Parquet files").read_table(path)
    with pa.memory_map(str(path)) as src:
        try:  # datasets writes the IPC stream format; pyarrow's feather files are the file format
            return pa.ipc.open_stream(src).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(src).read_all()


def _from_disk(path: Path, split: str) -> list[dict]:
    ds = _need("datasets", "a save_to_disk dir").load_from_disk(str(path))
    if hasattr(ds, "keys"):  # a DatasetDict: the split asked for
        if split not in ds:
            raise UsageError(f"calibrate.data.split: {split!r} not in {path} ({', '.join(ds)})")
        ds = ds[split]
    return ds.to_list()


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
    if not files:
        raise CalibrationError(f"{KEY}: {path}: no .jsonl, .json, .parquet or .arrow files")
    return files


def precheck(cfg: DataConfig) -> None:
    """What can be refused before any rank starts: a path that is not there, a reader missing."""
    if cfg.source != "dataset":
        return
    path = Path(cfg.path or "")
    if not path.exists():
        raise UsageError(f"{KEY}: {path} not found")
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        _need("datasets", "a save_to_disk dir")
    elif any(f.suffix in (".parquet", ".arrow") for f in _files(path)):
        _need("pyarrow", "Parquet and Arrow files")


def read_rows(path: Path, split: str = "train") -> list[dict]:
    """Every row of the dataset at ``path``, as dicts."""
    if not path.exists():
        raise CalibrationError(f"{KEY}: {path} not found")
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        return _from_disk(path, split)
    rows: list[dict] = []
    for f in _files(path):
        try:
            if f.suffix in (".jsonl", ".json"):
                rows += _jsonl(f)
            else:
                rows += _arrow_table(f).to_pylist()
        except (UsageError, CalibrationError):
            raise
        except Exception as exc:  # a malformed file: one line naming it
            raise CalibrationError(f"{KEY}: {f}: cannot read it ({exc})") from None
    return rows


def pick_column(rows: list[dict], column: str | None, path: Path) -> str:
    have = list(rows[0]) if rows else []
    if column is not None:
        if column not in have:
            raise CalibrationError(f"{KEY}: {path}: no column {column!r} (has {', '.join(have)})")
        return column
    for c in COLUMNS:
        if c in have:
            return c
    raise CalibrationError(
        f"{KEY}: {path}: no 'text' or 'messages' column (has {', '.join(have) or 'no rows'}); "
        "name one with calibrate.data.column"
    )


def _tokenizer(model_source: str | None) -> Any:
    src = Path(model_source) if model_source else None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if src is None or not src.is_dir() or not any((src / f).is_file() for f in names):
        return None
    from qckpt.models.remote_code import refuse_custom_code

    refuse_custom_code(src)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(src), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers raises many kinds for a broken tokenizer dir
        raise CalibrationError(f"{src}: cannot load the tokenizer: {exc}") from None


def _encoder(column: str, model_source: str | None, vocab_size: int) -> Callable[[Any], list[int]]:
    """row value -> token ids: the model's tokenizer (its chat template for messages), or the
    text's bytes folded into the vocabulary when the model has no tokenizer."""
    tok = _tokenizer(model_source)
    if column == "messages":
        if tok is None:
            raise UsageError(
                f"calibrate.data.column: 'messages' needs the model's tokenizer and chat "
                f"template; {model_source} has no tokenizer (use a 'text' column)"
            )
        if not getattr(tok, "chat_template", None):
            raise UsageError(
                f"calibrate.data.column: 'messages' needs a chat template; the tokenizer in "
                f"{model_source} has none (use a 'text' column)"
            )

        def chat(value: Any) -> list[int]:
            text = tok.apply_chat_template(value, tokenize=False)
            # the template writes the special tokens (BOS) itself
            return list(tok(text, add_special_tokens=False)["input_ids"])

        return chat
    if tok is not None:
        return lambda value: list(tok(str(value))["input_ids"])
    return lambda value: [b % vocab_size for b in str(value).encode("utf-8")]


def _pieces(ids: Iterator[list[int]], seq: int, pack: bool) -> Iterator[list[int]]:
    if not pack:
        for x in ids:
            if len(x) >= seq:
                yield x[:seq]
        return
    buf: list[int] = []
    for x in ids:
        buf += x
        while len(buf) >= seq:
            yield buf[:seq]
            buf = buf[seq:]


def dataset_samples(cfg: DataConfig, *, vocab_size: int, model_source: str | None) -> torch.Tensor:
    """``[count, seq_len]`` token ids, count <= num_samples (fewer when the data runs out)."""
    import torch

    path = Path(cfg.path or "")
    rows = read_rows(path, cfg.split)
    column = pick_column(rows, cfg.column, path)
    order = list(range(len(rows)))
    if cfg.shuffle_seed is not None:
        random.Random(cfg.shuffle_seed).shuffle(order)
    encode = _encoder(column, model_source, vocab_size)
    ids = (encode(rows[i][column]) for i in order if rows[i].get(column) not in (None, ""))
    out: list[list[int]] = []
    for piece in _pieces(ids, cfg.seq_len, cfg.pack):
        out.append(piece)
        if len(out) == cfg.num_samples:
            break
    if not out:
        how = "packed" if cfg.pack else f"rows of at least {cfg.seq_len} tokens"
        raise CalibrationError(
            f"{KEY}: {path}: not one sample of {cfg.seq_len} tokens ({how}) in {len(rows)} rows"
        )
    t = torch.tensor(out, dtype=torch.long)
    if int(t.max()) >= vocab_size:
        raise CalibrationError(
            f"{KEY}: {path}: the tokenizer's ids reach {int(t.max())}, the model's vocabulary "
            f"has {vocab_size}"
        )
    return t
