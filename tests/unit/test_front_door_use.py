"""``tests/e2e`` and ``bench/`` use only the front door (issue 28): ``qckpt`` (its lazy names,
``qckpt/api.py``), ``qckpt.pipeline.*`` (the commands' bodies), and the CLI's entry for running a
command (``qckpt.cli.app.main``, ``python -m qckpt``). Parsed with ``ast`` as the layer test
parses (lazy imports inside functions count), plus ``qckpt.X`` read off ``import qckpt``.

What a file may import beyond that is in :data:`ALLOWED`, each entry with its reason: the bench
micro-benchmarks, which by their nature measure one internal piece, and the few end-to-end
tests that look inside an artifact through the piece that reads it. An entry no longer needed
fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import qckpt
from tests.unit.layer_rules import ROOT, imports

FRONT = {"qckpt", "qckpt.api", "qckpt.pipeline", "qckpt.cli.app", "qckpt.__main__"}
SCANNED = ("tests/e2e/*.py", "bench/**/*.py")

# (file, internal module it imports) -> why the front door is not enough there
ALLOWED = {
    # -- bench micro-benchmarks: each measures one internal piece ------------------------------
    # the formats' kernels themselves: the registry, the kernel policy, compiled / Triton paths
    ("bench/formats.py", "qckpt.formats"): "FORMATS, KernelPolicy: every format x kernel",
    ("bench/formats.py", "qckpt.formats.kernels"): "the compiled kernels, timed alone",
    ("bench/formats.py", "qckpt.formats.numerics"): "the reference numerics, timed alone",
    ("bench/formats.py", "qckpt.formats.triton_kernels"): "the Triton kernels, timed alone",
    ("bench/tune_triton.py", "qckpt.formats.triton_kernels"): "tunes the Triton kernels' blocks",
    # the fast reader's ceiling and knobs: raw reads below any checkpoint format
    ("bench/read_ceiling.py", "qckpt.read.fast_io"): "the reader's byte views, no decoding",
    ("bench/read_ceiling.py", "qckpt.read.read_sizes"): "its chunk size and thread default",
    ("bench/read_knobs.py", "qckpt.read.fast_read"): "sets CHUNK_BYTES / READ_AHEAD_BYTES",
    # the amax sync alone, on synthetic quantizers
    ("bench/sync.py", "qckpt.calib.quantizer"): "AmaxStore / TensorQuantizer to sync",
    ("bench/sync.py", "qckpt.calib.sync"): "sync_amax, the protocol timed alone",
    # a peer tool's baseline calibrated on qckpt's very windows: the loader alone, no model
    ("bench/llmcompressor_export.py", "qckpt.calib.data"): "the calibration windows' bytes",
    ("bench/llmcompressor_export.py", "qckpt.recipe"): "the DataConfig of bench.quality's recipe",
    # calibration's forward overhead: the quantizers inserted and removed around a model
    ("bench/calibrate_speed.py", "qckpt.calib.instrument"): "insert / remove quantizers",
    ("bench/calibrate_speed.py", "qckpt.recipe"): "a QuantConfig for the instrumentation",
    ("bench/calibrate_speed.py", "qckpt.calib.moe_forward"): "auto's verdicts forgotten: timed",
    (
        "bench/gptq_batched.py",
        "qckpt.calib.gptq",
    ): "micro-benchmark: the per-linear reference against the batched sweep",
    (
        "bench/gptq_batched.py",
        "qckpt.calib.gptq_pass",
    ): "micro-benchmark: one GPTQ pass timed per step",
    (
        "bench/gptq_batched.py",
        "qckpt.calib.calibrate",
    ): "micro-benchmark: the max calibration before the GPTQ pass",
    ("bench/gptq_batched.py", "qckpt.calib.data"): "micro-benchmark: the calibration batches",
    ("bench/gptq_batched.py", "qckpt.parallel.mesh"): "micro-benchmark: a one-process mesh",
    ("bench/gptq_batched.py", "qckpt.recipe"): "micro-benchmark: the recipe's quant config",
    # the export's quantize stage per item: wraps the stage's pipeline methods to count
    ("bench/export_items.py", "qckpt.export.stages"): "wraps Pipeline's per-item methods",
    # -- bench set-ups that write synthetic inputs without running a model ---------------------
    # a calibration file for a synthetic checkpoint: its state, fingerprint and linears' names
    ("bench/export.py", "qckpt.calib.state_file"): "a synthetic CalibrationState + fingerprint",
    ("bench/export.py", "qckpt.export.plan"): "model_modules: the linears to calibrate",
    ("bench/export.py", "qckpt.models.build"): "load_config of the synthetic model",
    ("bench/export.py", "qckpt.models.naming"): "quant.ignore matching for the synthetic amaxes",
    ("bench/export.py", "qckpt.read.hf_names"): "the synthetic checkpoint's HF entries",
    ("bench/export.py", "qckpt.read.sources"): "SafetensorsSource: the source read alone",
    ("bench/export.py", "qckpt.recipe"): "the QuantConfig of the synthetic amaxes",
    ("bench/megatron_export.py", "qckpt.calib.state_file"): "a synthetic CalibrationState",
    ("bench/megatron_export.py", "qckpt.export.plan"): "model_linears: the linears to calibrate",
    ("bench/megatron_export.py", "qckpt.models.build"): "load_config of the HF model it maps to",
    ("bench/megatron_export.py", "qckpt.models.naming"): "quant.ignore matching",
    ("bench/megatron_export.py", "qckpt.read.readers"): "open_source: the Megatron read alone",
    ("bench/megatron_export.py", "qckpt.read.training_sources"): "--open-only: the opening alone",
    ("bench/megatron_export.py", "qckpt.recipe"): "the QuantConfig of the synthetic amaxes",
    ("bench/quantized_source.py", "qckpt.calib.state_file"): "a synthetic CalibrationState",
    ("bench/quantized_source.py", "qckpt.memory"): "the process's peak RSS, reset per phase",
    ("bench/quantized_source.py", "qckpt.models.build"): "load_config, outside the timed export",
    ("bench/quantized_source.py", "qckpt.models.quantize_params"): "fp8_block with block_size",
    ("bench/quantized_source.py", "qckpt.recipe"): "QuantConfig / ExportConfig in code",
    # -- bench measurements against their baselines and bounds ---------------------------------
    # the load benchmark: qckpt's load against torch DCP's own reader, TE params, a plot
    ("bench/load.py", "qckpt.convert.dcp"): "save_model_dcp: the DCP checkpoint to load",
    ("bench/load.py", "qckpt.formats"): "FORMATS / is_quantized: the params it counts",
    ("bench/load.py", "qckpt.formats.te"): "is_te_quantized: the TE backend's params",
    ("bench/load.py", "qckpt.load.loader"): "load_checkpoint with every knob, LoadReport",
    ("bench/load.py", "qckpt.models.quantize_params"): "quantized params per format x backend",
    ("bench/load.py", "qckpt.plot"): "plot_memory of the runs",
    ("bench/load.py", "qckpt.read.fast_read"): "DEFAULT_MAX_INFLIGHT, the flag's default",
    ("bench/load.py", "qckpt.storage.dcp_metadata"): "the plain-DCP baseline's safe reader",
    # issue 17's bound: the quantized model's bytes counted on meta, nothing allocated
    ("bench/load_bound.py", "qckpt.formats"): "is_quantized / quantized_nbytes per param",
    ("bench/load_bound.py", "qckpt.models.build"): "build_model on meta (no allocation)",
    ("bench/load_bound.py", "qckpt.models.quantize_params"): "shape-only quantized params",
    ("bench/whole_command.py", "qckpt.phases"): "the phase recorder around transformers' load",
    ("bench/resident_quality.py", "qckpt.models.naming"): "experts per module for its W8A8",
    ("bench/calibrate_offload.py", "qckpt.calib.state_file"): "calibration_differences, bitwise",
    # qckpt eval against vLLM's figures: its windows, its worker env, the source-score cache
    ("bench/quality.py", "qckpt.evaluate.run"): "evaluate with a source cache across exports",
    ("bench/quality.py", "qckpt.evaluate.vllm_client"): "vLLM's own figures on the same windows",
    ("bench/quality.py", "qckpt.evaluate.windows"): "the held-out windows vLLM is given",
    ("bench/quality.py", "qckpt.layouts.source_layout"): "read_json_if_any of an export's config",
    # -- tests/e2e: an artifact looked into through the piece that reads it --------------------
    ("tests/e2e/_paused_cli.py", "qckpt.export.writer"): "pauses write_export mid-export",
    ("tests/e2e/test_eval_moe.py", "qckpt.evaluate.scheme"): "read_scheme of the MoE export",
    ("tests/e2e/test_export_mixed.py", "qckpt.evaluate.scheme"): "read_scheme: each linear's",
    ("tests/e2e/test_export_mixed.py", "qckpt.formats.scheme"): "the scheme read_scheme gives",
    ("tests/e2e/test_eval_quality.py", "qckpt.evaluate.run"): "the source cache, score_model",
    ("tests/e2e/test_eval_quality.py", "qckpt.evaluate.fused"): "requantized: vLLM's fusing",
    ("tests/e2e/test_eval_quality.py", "qckpt.evaluate.scheme"): "read_scheme of each export",
    # the bug's path: asserts the export really takes the model from the calibration file
    ("tests/e2e/test_training_cli.py", "qckpt.export.model_record"): "peek / usable",
}


def _files(root: Path) -> list[Path]:
    return sorted({p for pattern in SCANNED for p in root.glob(pattern)})


def _front(mod: str) -> bool:
    return mod in FRONT or mod.startswith("qckpt.pipeline.")


def _attribute_reads(path: Path) -> list[str]:
    """``qckpt.X`` read off ``import qckpt`` where X is no front-door name."""
    tree = ast.parse(path.read_text(), str(path))
    ok = set(qckpt.__all__) | {"__version__", "pipeline"}
    return [
        f"qckpt.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "qckpt"
        if n.attr not in ok
    ]


def internal_uses(root: Path = ROOT) -> set[tuple[str, str]]:
    """(file, what it uses behind the front door) over the scanned files under ``root``."""
    out = set()
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        mods = {m for m, _ in imports(path, root) if m == "qckpt" or m.startswith("qckpt.")}
        out |= {(rel, m) for m in mods if not _front(m)}
        out |= {(rel, m) for m in _attribute_reads(path)}
    return out


def test_e2e_and_bench_use_only_the_front_door():
    extra = sorted(internal_uses() - set(ALLOWED))
    assert not extra, (
        "these go behind the front door (use a qckpt name or qckpt.pipeline; a micro-benchmark "
        f"of one internal piece may be added to ALLOWED with its reason): {extra}"
    )


def test_the_allow_list_only_shrinks():
    stale = sorted(set(ALLOWED) - internal_uses())
    assert not stale, f"no longer imported: remove from ALLOWED: {stale}"


def test_the_checker_sees_every_spelling(tmp_path):
    (tmp_path / "qckpt").symlink_to(ROOT / "qckpt")  # a name is a submodule when it is one
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / "tests" / "e2e" / "test_x.py").write_text(
        "import qckpt\n"
        "import qckpt.export.writer as w\n"
        "from qckpt import build_model, formats\n"
        "from qckpt.pipeline.export import export\n"
        "from qckpt.cli.app import main\n"
        "def f():\n"
        "    from qckpt.recipe import QuantConfig\n"
        "    return qckpt.load_recipe, qckpt.read, qckpt.__version__\n"
    )
    got = {m for _, m in internal_uses(tmp_path)}
    assert got == {"qckpt.export.writer", "qckpt.formats", "qckpt.recipe", "qckpt.read"}
