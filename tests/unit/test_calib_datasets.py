"""``calibrate.data.source: dataset`` (issue 30): JSONL / Parquet / Arrow files and
``save_to_disk`` dirs, a ``text`` or ``messages`` column (chat template), ``shuffle_seed``,
packed or truncated samples; one-line errors for what cannot be read."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from qckpt.calib.data import calibration_batches
from qckpt.calib.datasets import dataset_samples, precheck
from qckpt.errors import CalibrationError, UsageError
from qckpt.recipe import DataConfig
from tests.conftest import ROOT

ROWS = [{"text": f"row {i} " + "x" * i, "id": i} for i in range(12)]


def _jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(path, **kw):
    base = {"source": "dataset", "path": str(path), "num_samples": 4, "seq_len": 8}
    return DataConfig(**{**base, **kw})


def _bytes(rows):
    return [b for r in rows for b in r["text"].encode()]


def test_jsonl_text_is_packed_into_seq_len_pieces_in_order(tmp_path):
    cfg = _cfg(_jsonl(tmp_path / "d.jsonl"))
    got = dataset_samples(cfg, vocab_size=256, model_source=None)
    want = torch.tensor(_bytes(ROWS)[: 4 * 8]).view(4, 8)  # no tokenizer: the text's bytes
    assert torch.equal(got, want)


def test_truncate_keeps_one_sample_per_long_enough_row(tmp_path):
    cfg = _cfg(_jsonl(tmp_path / "d.jsonl"), pack=False, seq_len=10, num_samples=3)
    got = dataset_samples(cfg, vocab_size=256, model_source=None)
    long_rows = [r for r in ROWS if len(r["text"]) >= 10][:3]  # "row 4 xxxx" is the first
    assert got.tolist() == [list(r["text"].encode()[:10]) for r in long_rows]


def test_shuffle_seed_reorders_the_rows_the_same_way_every_time(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl")
    plain = dataset_samples(_cfg(path, pack=False, seq_len=5), vocab_size=256, model_source=None)
    a = dataset_samples(
        _cfg(path, pack=False, seq_len=5, shuffle_seed=3), vocab_size=256, model_source=None
    )
    b = dataset_samples(
        _cfg(path, pack=False, seq_len=5, shuffle_seed=3), vocab_size=256, model_source=None
    )
    assert torch.equal(a, b) and not torch.equal(a, plain)


def test_batches_of_a_dataset_are_dealt_like_any_source(tmp_path):
    cfg = _cfg(_jsonl(tmp_path / "d.jsonl"), batch_size=2)
    stats: dict = {}
    one = calibration_batches(cfg, vocab_size=256, stats=stats)
    assert stats["samples"] == 4 and [b.shape for b in one] == [torch.Size([2, 8])] * 2


def _chat_model_dir(tmp_path, template: bool):
    """A model dir holding only a word-level tokenizer (ids < 256), with or without a template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<unk>", "user", "assistant", ":", "hello", "there", "how", "are", "you"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    if template:
        fast.chat_template = (
            "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        )
    d = tmp_path / ("chat" if template else "plain")
    fast.save_pretrained(d)
    return d


def test_messages_are_rendered_with_the_models_chat_template(tmp_path):
    model = _chat_model_dir(tmp_path, template=True)
    conv = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "how are you"},
    ]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": conv}] * 3)
    got = dataset_samples(
        _cfg(path, seq_len=10, num_samples=2), vocab_size=256, model_source=str(model)
    )
    # "user : hello there assistant : how are you" -> 2 4 5 6 3 4 7 8 9, three times, packed
    one = [2, 4, 5, 6, 3, 4, 7, 8, 9]
    assert got.tolist() == [(one * 3)[:10], (one * 3)[10:20]]


def test_messages_without_a_chat_template_is_one_line(tmp_path):
    model = _chat_model_dir(tmp_path, template=False)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    with pytest.raises(UsageError, match="'messages' needs a chat template; the tokenizer in"):
        dataset_samples(_cfg(path), vocab_size=256, model_source=str(model))


@pytest.mark.parametrize(
    ("rows", "kw", "needle"),
    [
        ([{"body": "x"}], {}, "no 'text' or 'messages' column (has body); name one with"),
        ([{"text": "x"}], {"column": "prompt"}, "no column 'prompt' (has text)"),
        ([{"text": "ab"}], {}, "not one sample of 8 tokens (packed) in 1 rows"),
    ],
)
def test_data_that_cannot_make_samples_is_one_line(tmp_path, rows, kw, needle):
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(CalibrationError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        dataset_samples(_cfg(path, **kw), vocab_size=256, model_source=None)


def test_a_missing_path_is_refused_before_any_rank(tmp_path):
    with pytest.raises(UsageError, match="calibrate.data.path: .*nope not found"):
        precheck(_cfg(tmp_path / "nope"))


def test_a_missing_datasets_package_is_one_line(tmp_path, monkeypatch):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(UsageError, match=r"needs the 'datasets' package \(pip install datasets\)"):
        precheck(_cfg(d))


def test_parquet_arrow_and_save_to_disk_give_the_jsonl_samples(tmp_path):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    want = dataset_samples(_cfg(_jsonl(tmp_path / "d.jsonl")), vocab_size=256, model_source=None)
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet")
    # a fixed fingerprint: datasets' own hashing of a new table is not needed to write one
    ds = datasets.Dataset(table, fingerprint="calib-test")
    ds.save_to_disk(str(tmp_path / "disk"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    arrow = next((tmp_path / "disk").glob("*.arrow"))
    for path in (tmp_path / "d.parquet", arrow, tmp_path / "disk", tmp_path / "dict"):
        cfg = _cfg(path)
        precheck(cfg)
        assert torch.equal(dataset_samples(cfg, vocab_size=256, model_source=None), want), path


def test_calibrate_on_a_jsonl_dataset_end_to_end(tmp_path):
    from tests._inproc import run_main
    from tests.quantized_fixtures import bf16_dir

    model = bf16_dir(tmp_path, "tiny-dense")
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "calibration text " * 20}] * 8)
    sets = [
        "--set", f"model.source={model}", "--set", f"checkpoint.path={model}",
        "--set", "calibrate.data.source=dataset", "--set", f"calibrate.data.path={data}",
        "--set", "calibrate.data.shuffle_seed=1", "--set", "calibrate.data.num_samples=6",
        "--set", "calibrate.data.seq_len=64", "--set", f"calibrate.output={tmp_path}/c.safetensors",
    ]  # fmt: skip
    recipe = str(ROOT / "configs" / "tiny-dense.yaml")
    r = run_main("calibrate", recipe, *sets, "--json", str(tmp_path / "c.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "c.json").read_text())
    assert rep["data"]["source"] == "dataset" and rep["data"]["samples_used"] == 6
    assert (tmp_path / "c.safetensors").is_file()
