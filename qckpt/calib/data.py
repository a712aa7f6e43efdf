"""Calibration batches: synthetic, a local text file, a local file of token ids, or a local
dataset (:mod:`qckpt.calib.datasets`).

The global set of samples is cut into global batches first (``batch_size`` samples each, the last
one possibly shorter) and the batches are dealt round-robin to the data ranks. So the union over
ranks is the same set of samples, in the same batches, for any world size: every batch runs the
very same forward whatever the layout, which is what makes calibration bit-identical between one
rank and any DP x EP split (max is exact; but a matmul's bits may depend on its batch shape).
"""

from __future__ import annotations

from pathlib import Path

import torch

from qckpt.errors import CalibrationError, UsageError
from qckpt.models.remote_code import refuse_custom_code
from qckpt.recipe import DataConfig


def check_even_split(samples: int, batch_size: int, data_world: int, ep: int) -> None:
    """Under expert parallelism every data rank must run the same number of forwards (each
    forward exchanges tokens with the other EP ranks): refuse, on every rank alike, a set whose
    batches do not split evenly instead of letting the short rank's peers wait out the timeout."""
    batches = -(-samples // batch_size)
    if ep > 1 and data_world > 1 and batches % data_world:
        raise UsageError(
            f"calibrate.data: {samples} samples in batches of {batch_size} make {batches} "
            f"batches, which do not split evenly over the {data_world} data ranks under "
            f"parallel.ep={ep} (every EP rank runs the same number of forwards); make the "
            f"number of batches a multiple of {data_world}"
        )


def calibration_batches(
    data_cfg: DataConfig,
    *,
    vocab_size: int,
    model_source: str | None = None,
    data_rank: int = 0,
    data_world: int = 1,
    stats: dict | None = None,
) -> list[torch.LongTensor]:
    """This data rank's share of the calibration batches, each a LongTensor ``[b, seq_len]``.

    ``stats``, when given, gets ``samples``: how many samples the whole set has (the same on
    every rank), which is fewer than ``num_samples`` when the file is short. Under
    ``strict: true`` a short file is a :class:`CalibrationError` instead.
    """
    if not 0 <= data_rank < data_world:
        raise ValueError(f"data_rank {data_rank} out of range for {data_world} data ranks")
    samples = _samples(data_cfg, vocab_size=vocab_size, model_source=model_source)
    got = int(samples.shape[0])
    if got < data_cfg.num_samples and data_cfg.strict:
        raise CalibrationError(
            f"calibrate.data.path: {data_cfg.path}: holds {got} samples of "
            f"{data_cfg.seq_len} tokens, fewer than num_samples {data_cfg.num_samples} "
            "(calibrate.data.strict is true)"
        )
    if stats is not None:
        stats["samples"] = got
    b = data_cfg.batch_size
    batches = [samples[i : i + b] for i in range(0, samples.shape[0], b)]
    return [batches[i] for i in range(data_rank, len(batches), data_world)]


def _samples(cfg: DataConfig, *, vocab_size: int, model_source: str | None) -> torch.Tensor:
    n, seq = cfg.num_samples, cfg.seq_len
    if cfg.source == "synthetic":
        g = torch.Generator().manual_seed(1234)
        return torch.randint(0, vocab_size, (n, seq), generator=g, dtype=torch.long)
    if cfg.source == "dataset":  # a dataset dir or JSONL / Parquet / Arrow files
        from qckpt.calib.datasets import dataset_samples

        return dataset_samples(cfg, vocab_size=vocab_size, model_source=model_source)
    path = Path(cfg.path or "")
    if not path.is_file():
        raise CalibrationError(f"calibrate.data.path: {path} not found")
    if cfg.source == "text":
        ids = _tokenize(path, vocab_size, model_source)
    else:
        ids = _read_tokens(path)
    if ids.dim() == 2:
        if ids.shape[1] < seq:
            raise CalibrationError(
                f"calibrate.data.path: {path}: samples of {ids.shape[1]} tokens, seq_len is {seq}"
            )
        samples = ids[:, :seq]
    else:
        count = ids.numel() // seq
        if count == 0:
            raise CalibrationError(
                f"calibrate.data.path: {path}: {ids.numel()} tokens, fewer than one sample of {seq}"
            )
        samples = ids[: count * seq].view(count, seq)
    samples = samples[:n].to(torch.long).contiguous()
    if samples.numel() and (int(samples.min()) < 0 or int(samples.max()) >= vocab_size):
        raise CalibrationError(
            f"calibrate.data.path: {path}: token ids must be in [0, {vocab_size}), "
            f"found {int(samples.min())}..{int(samples.max())}"
        )
    return samples


def _tokenize(path: Path, vocab_size: int, model_source: str | None) -> torch.Tensor:
    text = path.read_text(encoding="utf-8", errors="replace")
    src = Path(model_source) if model_source else None
    if (
        src is not None
        and src.is_dir()
        and any(
            (src / f).is_file()
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
    ):
        refuse_custom_code(src)
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(
                str(src), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:  # transformers raises many kinds for a broken tokenizer dir
            raise CalibrationError(f"{src}: cannot load the tokenizer: {exc}") from None
        return torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    # no tokenizer: bytes, folded into the vocabulary (good enough to drive activations)
    raw = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    return raw.to(torch.long) % vocab_size


def _read_tokens(path: Path) -> torch.Tensor:
    suffix = path.suffix.lower()
    try:
        if suffix == ".pt":
            t = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor):
                raise CalibrationError(
                    f"calibrate.data.path: {path}: expected a tensor of token ids"
                )
        elif suffix == ".npy":
            import numpy as np

            t = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            t = torch.tensor([int(w) for w in path.read_text().split()], dtype=torch.long)
    except CalibrationError:
        raise
    except Exception as exc:  # unreadable or malformed file: one line, naming it
        raise CalibrationError(
            f"calibrate.data.path: {path}: cannot read token ids ({exc})"
        ) from None
    if t.dtype.is_floating_point or t.dim() not in (1, 2):
        raise CalibrationError(
            f"calibrate.data.path: {path}: expected 1-D or 2-D integer token ids, got "
            f"{t.dtype} of shape {tuple(t.shape)}"
        )
    return t.to(torch.long)
