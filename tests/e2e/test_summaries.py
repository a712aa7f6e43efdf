"""What a person reads (issue 30): every command's default output is a short summary (at most
12 lines on a tiny model) holding its output path and its whole-command peak against a bound;
the tables come under --verbose; --json keeps its keys."""

from __future__ import annotations

import json
import re

import pytest

from tests._inproc import run_main
from tests.conftest import ROOT

RECIPE = str(ROOT / "configs" / "tiny-moe.yaml")
# "peak host RSS 466.95 MiB of 23.54 GiB (2%)" / "peak device 29.8 GiB of 139.8 GiB (21%)"
PEAK = re.compile(r"peak (host RSS|device) [\d.]+ \w?i?B of [\d.]+ \w?i?B \(\d+%\)")
MAX_LINES = 12

# the --json keys each command wrote before the summaries (a single-process run)
KEYS = {
    "convert": {"compiled_at_import", "dst", "peaks", "phases", "src", "startup_parts", "to"},
    "load": {"compiled_at_import", "params", "peaks", "phases", "recipe", "runs",
             "startup_parts", "world_size"},
    "calibrate": {"batches", "calibrated", "compiled_at_import", "data", "disabled", "dp", "ep",
                  "forward_parts", "forward_seconds", "layers", "param_bytes", "peaks", "phases",
                  "quantizers", "read", "shared_from_layer", "startup_parts", "sync_collectives",
                  "sync_seconds", "tokens_this_rank", "tp", "uncalibrated", "weight_amax_here",
                  "weights_resident", "world_size",
                  # calibrate.algorithm (issue 27): which one ran, its seconds and collectives
                  "algorithm", "algorithm_collectives", "algorithm_seconds",
                  # calibrate.moe_forward (issue 44): asked, used, why eager under auto
                  "moe_forward"},
    "export": {"bytes_read", "bytes_written", "compiled_at_import", "device", "files", "gbps",
               "host_bound_bytes", "lanes", "largest_tensor_bytes", "layout", "output",
               "peak_rss_anon_bytes", "peak_rss_bytes", "peaks", "phases", "quant_format",
               "quantized_linears", "ranks", "run_sources", "seconds", "shards", "source_format",
               "source_tensors", "startup_parts", "steps", "tensors_written", "warnings",
               "world_size", "write_rss_anon_bytes"},
    "check": {"experts", "kv_cache_scales", "layout", "ok", "path", "problems", "quantized",
              "scheme", "unquantized"},
    "inspect": {"bytes", "config_groups", "dtypes", "files", "ignore", "index", "kind", "largest",
                "model_type", "path", "quant_format", "quant_method", "scales", "shard_metadata",
                "source_layout", "tensors"},
    "plan": {"checkpoint", "commands", "fits", "gpu_memory_bytes", "host_memory_bytes", "layout",
             "layouts", "model", "nnodes", "notes", "nproc_per_node", "recipe", "suggestion",
             "world_size"},
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command once on the tiny MoE model, in the order a user runs them."""
    d = tmp_path_factory.mktemp("summaries")
    sets = [
        "--set", f"checkpoint.path={d}/dcp", "--set", f"calibrate.output={d}/calib.safetensors",
        "--set", f"export.output={d}/fp8",
    ]  # fmt: skip
    argvs = {
        "convert": ["convert", RECIPE, f"{d}/dcp", *sets],
        "load": ["load", RECIPE, *sets, "--compare"],
        "calibrate": ["calibrate", RECIPE, *sets],
        "export": ["export", RECIPE, *sets],
        "check": ["check", f"{d}/fp8"],
        "inspect": ["inspect", f"{d}/fp8"],
        "plan": ["plan", RECIPE, *sets, "--nproc-per-node", "1", "--gpu-memory", "1GiB"],
    }
    out = {}
    for cmd, argv in argvs.items():
        r = run_main(*argv, "--json", str(d / f"{cmd}.json"), cwd=d)
        assert r.returncode == 0, (cmd, r.stderr)
        out[cmd] = (r, json.loads((d / f"{cmd}.json").read_text()))
    verbose = run_main("inspect", f"{d}/fp8", "--verbose", cwd=d)
    return d, out, verbose


OUTPUT = {
    "convert": "dcp",
    "load": "dcp",
    "calibrate": "calib.safetensors",
    "export": "fp8",
    "check": "fp8",
    "inspect": "fp8",
}


@pytest.mark.parametrize("cmd", list(KEYS))
def test_default_output_is_a_short_summary_with_the_output_and_the_peak(runs, cmd):
    d, out, _ = runs
    r, _ = out[cmd]
    text = r.stdout + r.stderr
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) <= MAX_LINES, text
    if cmd == "plan":  # a prediction: its peaks per command against the GPU memory given
        assert "peak" in text and "fits" in text and "1 GiB" in text.replace("1.00 GiB", "1 GiB")
        return
    assert str(d / OUTPUT[cmd]) in text, text
    assert PEAK.search(text), text
    assert "Traceback" not in text and "┏" not in text  # no tables by default


@pytest.mark.parametrize("cmd", list(KEYS))
def test_json_keys_are_unchanged(runs, cmd):
    _, out, _ = runs
    assert set(out[cmd][1]) == KEYS[cmd]


def test_load_says_the_transient_against_its_bound_and_the_bulk_baseline(runs):
    _, out, _ = runs
    r, data = out["load"]
    run = data["runs"][0]
    bound = run["predicted_transient_bytes"]
    assert "transient" in r.stderr and "against its bound" in r.stderr
    assert run["transient_bytes"] <= bound * 1.05 + 4096
    assert "warning" not in r.stderr  # nothing deserved one
    assert "bulk baseline" in r.stderr


def test_calibrate_says_which_experts_forward_ran(runs):
    _, out, _ = runs
    r, data = out["calibrate"]
    moe = data["moe_forward"]
    assert (moe["asked"], moe["used"], moe["why"]) == ("auto", "grouped", "")
    assert moe["first_call_seconds"] > 0
    assert re.search(r"^  experts forward grouped \(auto\), first call [\d.]+ s$", r.stderr, re.M)


def test_verbose_keeps_the_tables(runs):
    _, _, verbose = runs
    assert verbose.returncode == 0
    assert "quant_method" in verbose.stdout and "shard_metadata" in verbose.stdout


def test_a_run_as_a_user_runs_it_prints_only_qckpts_lines(runs):
    """In a process of its own (what a terminal shows: libraries' warnings and logs included):
    the summary and the result, nothing of torch, torchao or transformers."""
    from tests.conftest import run_qckpt

    d, _, _ = runs
    sets = [
        "--set", f"checkpoint.path={d}/dcp", "--set", f"calibrate.output={d}/calib.safetensors",
        "--set", f"export.output={d}/fp8-again",
    ]  # fmt: skip
    r = run_qckpt("export", RECIPE, *sets, cwd=d)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines and lines[0].startswith("export: "), r.stderr
    assert all(ln.startswith("  ") for ln in lines[1:]), r.stderr
    assert r.stdout.strip() == f"wrote {d}/fp8-again (compressed-tensors) on 1 rank(s)"
