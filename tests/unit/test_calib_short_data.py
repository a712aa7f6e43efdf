"""A tokens file holding fewer samples than ``num_samples``: said in the report, or refused
under ``calibrate.data.strict: true``."""

import json

import pytest

from tests.conftest import run_qckpt


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    d = tmp_path_factory.mktemp("short")
    save_model_dcp(build_model("tiny-dense", dtype="bfloat16"), d / "dcp")
    tokens = d / "tokens.txt"
    tokens.write_text(" ".join(str(i % 256) for i in range(3 * 32)))  # 3 samples of 32 tokens
    recipe = d / "r.yaml"
    recipe.write_text(
        "model: {source: tiny-dense}\n"
        f"checkpoint: {{path: {d / 'dcp'}}}\n"
        "load: {device: cpu}\n"
        f"calibrate:\n  data: {{source: tokens, path: {tokens}, num_samples: 16, seq_len: 32, "
        "batch_size: 4}\n"
        f"  output: {d / 'calib.safetensors'}\n"
    )
    return d, recipe


def test_short_tokens_file_is_said_in_the_log_and_the_json_report(setup):
    d, recipe = setup
    r = run_qckpt("calibrate", str(recipe), "--json", str(d / "report.json"))
    assert r.returncode == 0, r.stderr
    assert "holds 3 samples of 32 tokens, fewer than num_samples 16" in r.stderr
    data = json.loads((d / "report.json").read_text())["data"]
    assert data == {"source": "tokens", "num_samples": 16, "samples_used": 3, "short": True}
    assert (d / "calib.safetensors").is_file()
    (d / "calib.safetensors").unlink()


def test_short_tokens_file_is_refused_under_strict(setup):
    d, recipe = setup
    r = run_qckpt("calibrate", str(recipe), "--set", "calibrate.data.strict=true")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "holds 3 samples of 32 tokens, fewer than num_samples 16" in lines[0]
    assert "calibrate.data.strict is true" in lines[0]
    assert not (d / "calib.safetensors").exists()


@pytest.mark.parametrize(
    ("samples", "batch", "world", "ep", "refused"),
    [
        (20, 4, 2, 2, True),  # 5 batches over 2 EP ranks: one rank would wait for the other
        (18, 4, 2, 2, True),  # a short last batch still counts: 5 batches
        (16, 4, 2, 2, False),
        (20, 4, 2, 1, False),  # data parallel alone: ranks never exchange tokens
        (24, 4, 4, 2, True),  # DP2 x EP2: 6 batches over 4 data ranks
        (32, 4, 4, 2, False),
    ],
)
def test_uneven_batches_under_expert_parallel_are_refused_up_front(
    samples, batch, world, ep, refused
):
    from qckpt.calib.data import check_even_split
    from qckpt.errors import UsageError

    if not refused:
        check_even_split(samples, batch, world, ep)
        return
    with pytest.raises(UsageError) as exc:
        check_even_split(samples, batch, world, ep)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("calibrate.data:")
    assert f"over the {world} data ranks under parallel.ep={ep}" in msg
