"""Held-out windows for ``qckpt eval``.

The data file is one of:

* ``.npy`` / ``.pt``: token ids (a 1-D integer array; a 2-D one is read row after row);
* anything else: text. With a tokenizer in the source dir it is decoded as UTF-8 and tokenized;
  without one (a byte-vocabulary model) its bytes are the token ids.

Windows: ``windows`` starts drawn with ``torch.Generator().manual_seed(seed)``,
``torch.randint(0, n - seq_len - 1, (windows,))`` over the ``n`` token ids, each window the
``seq_len + 1`` ids from its start (the model reads the first ``seq_len`` and predicts the last
``seq_len``). The defaults (64 windows, 512, seed 7) are the protocol of the shared quality
set's README and ``train_textlm.py``.

Bytes: without a tokenizer a predicted token is one byte. With one, a window's bytes are the
UTF-8 length of its predicted tokens decoded together, so bits per byte = total NLL bits / those
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qckpt.errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Windows:
    ids: torch.Tensor  # [windows, seq_len + 1] int64
    nbytes: list[int]  # per window, the bytes its predicted tokens cover
    kind: str  # "bytes" | "text" | "tokens"
    source: str  # the data file
    seed: int
    starts: list[int]

    @property
    def predicted(self) -> int:
        return int(self.ids.shape[0] * (self.ids.shape[1] - 1))


def tokenizer_of(model_dir: Path | None) -> Any:
    if model_dir is None or not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(model_dir), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers raises many kinds for a broken tokenizer dir
        raise UsageError(f"{model_dir}: cannot load the tokenizer: {exc}") from None


def _read_ids(path: Path) -> torch.Tensor:
    try:
        if path.suffix.lower() == ".pt":
            t = torch.load(path, map_location="cpu", weights_only=True)
        else:
            import numpy as np

            t = torch.from_numpy(np.load(path, allow_pickle=False))
    except Exception as exc:  # unreadable or malformed: one line naming it
        raise UsageError(f"{path}: cannot read token ids ({exc})") from None
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dim() not in (1, 2):
        what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
        raise UsageError(f"{path}: expected 1-D or 2-D integer token ids, got {what}")
    return t.reshape(-1).to(torch.long)


def make_windows(
    path: Path,
    *,
    vocab_size: int,
    tokenizer: Any = None,
    windows: int = 64,
    seq_len: int = 512,
    seed: int = 7,
) -> Windows:
    """The held-out windows of ``path`` (see the module doc)."""
    if not path.is_file():
        raise UsageError(f"{path}: data file not found")
    if path.suffix.lower() in (".npy", ".pt"):
        ids, kind = _read_ids(path), "tokens"
    elif tokenizer is not None:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids, kind = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long), "text"
    else:
        ids = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).to(torch.long)
        kind = "bytes"
    if ids.numel() < seq_len + 2:
        raise UsageError(
            f"{path}: {ids.numel()} tokens, too few for a window of {seq_len + 1} (eval.seq_len)"
        )
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise UsageError(f"{path}: token ids {lo}..{hi} do not fit the vocabulary of {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len - 1, (windows,), generator=g).tolist()
    win = torch.stack([ids[s : s + seq_len + 1] for s in starts])
    if kind == "text" and tokenizer is not None:
        nbytes = [len(tokenizer.decode(w[1:].tolist()).encode("utf-8")) for w in win]
    else:
        nbytes = [seq_len] * windows
    return Windows(ids=win, nbytes=nbytes, kind=kind, source=str(path), seed=seed, starts=starts)


def data_section(win, data) -> dict:  # noqa: ANN001 (Windows, a path)
    """The report's ``data``: which windows of which file were scored."""
    return {
        "path": str(data),
        "kind": win.kind,
        "windows": int(win.ids.shape[0]),
        "seq_len": int(win.ids.shape[1] - 1),
        "seed": win.seed,
    }
