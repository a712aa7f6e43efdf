"""The export files of every example recipe are the bytes recorded before the package re-cut
(issue 28): a sha256 of every file an export writes, per case, in ``export_hashes.json``.

Each case is a recipe of ``configs/`` (or a variation of one that reaches another layout, format
or source reader) run as a user runs it, in this process: ``convert`` (when the case needs a
checkpoint), ``calibrate``, then ``export`` into each layout. Nothing an export writes holds a
time or an absolute path, so every file is compared, none left out; only the
``transformers_version`` of ``config.json`` and ``generation_config.json`` (the version of the
library that wrote it: a transformers release on PyPI changed it under CI once) reads as ``"*"``.

GPTQ's bytes also depend on the BLAS/LAPACK code path (its Cholesky factors and the block
update's GEMM): MKL picks one per processor, and an AMD and an Intel machine gave different bytes
for the same case. A case marked ``blas`` therefore runs in a child process under MKL's
conditional numerical reproducibility (``MKL_CBWR=COMPATIBLE,STRICT``: one code path on every
x86 processor, whatever the alignment), ATen's and oneDNN's AVX2 kernels (oneDNN runs the BF16
matmuls and picks its own ISA: an AMD EPYC with avx512_bf16 differed from the Intel recording
until it was capped), one thread: the same bytes on any machine CI lands on.

Record again (only for a change that means to change the bytes, said in its commit):
``python -m tests.e2e.test_export_hashes --record``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

MODULE = "tests.e2e.test_export_hashes"
HASHES = Path(__file__).with_name("export_hashes.json")
LAYOUTS = ("compressed-tensors", "modelopt")
FIXTURES = ROOT / "tests" / "fixtures"


@dataclass(frozen=True)
class Case:
    """One recipe and the ``--set`` overrides that make it this case."""

    name: str
    recipe: str  # relative to ROOT
    sets: tuple[str, ...] = ()
    layouts: tuple[str, ...] = LAYOUTS
    # "convert": the recipe's model written as DCP first; "hf": its model saved by transformers
    # and read as an HF dir; "blockwise": that dir quantized DeepSeek-style; "given": the
    # recipe's own checkpoint.path (a committed fixture)
    source: str = "convert"
    # the bytes depend on the BLAS/LAPACK code path: run under one pinned path (module doc)
    blas: bool = False


MOE_NVFP4 = (
    "quant.weights.format=nvfp4",
    "quant.inputs.format=nvfp4",
)
CASES = [
    # the example recipes as they are
    Case("tiny-dense", "configs/tiny-dense.yaml"),
    Case("tiny-moe", "configs/tiny-moe.yaml"),
    Case("tiny-dense-channel-kv", "configs/tiny-dense-channel-kv.yaml"),
    # several schemes in one export: NVFP4 experts, FP8 attention, BF16 routers and lm_head
    Case("tiny-moe-mixed", "configs/tiny-moe-mixed.yaml"),
    # INT4 W4A16 (compressed-tensors pack-quantized; ModelOpt refuses it)
    Case("tiny-dense-w4a16", "configs/tiny-dense-w4a16.yaml", layouts=LAYOUTS[:1]),
    # INT8 W8A8 (compressed-tensors int-quantized; ModelOpt refuses it)
    Case("tiny-dense-w8a8", "configs/tiny-dense-w8a8.yaml", layouts=LAYOUTS[:1]),
    # MXFP4 W4A16 (compressed-tensors mxfp4-pack-quantized; ModelOpt refuses it)
    Case(
        "tiny-dense-mxfp4",
        "configs/tiny-dense-w4a16.yaml",
        ("quant.weights.format=mxfp4",),
        layouts=LAYOUTS[:1],
    ),
    # the same recipes reaching the other formats, scales, algorithms and shard splits
    Case("tiny-moe-nvfp4", "configs/tiny-moe.yaml", MOE_NVFP4),
    Case(
        "tiny-moe-per-expert-shards",
        "configs/tiny-moe.yaml",
        ("export.moe_scales=per_expert", "export.max_shard_size=60KB"),
        layouts=("compressed-tensors",),
    ),
    Case(
        "tiny-dense-block",
        "configs/tiny-dense.yaml",
        (
            "quant.weights.granularity=block",
            "quant.weights.block_size=[32, 32]",
            "quant.inputs.granularity=block",
            "quant.inputs.block_size=[1, 32]",
            "quant.inputs.dynamic=true",
        ),
        layouts=("compressed-tensors",),
    ),
    Case("tiny-dense-mse", "configs/tiny-dense.yaml", ("calibrate.algorithm=mse",)),
    Case(
        "tiny-dense-nvfp4-gptq",
        "configs/tiny-dense.yaml",
        ("calibrate.algorithm=gptq", "quant.weights.format=nvfp4", "quant.inputs.format=nvfp4"),
        blas=True,
    ),
    # other readers: an HF dir, a DeepSeek-style blockwise FP8 dir, training checkpoints
    Case("tiny-moe-hf-source", "configs/tiny-moe.yaml", source="hf", layouts=LAYOUTS[:1]),
    Case("tiny-moe-blockwise-source", "configs/tiny-moe.yaml", source="blockwise"),
    Case(
        "megatron-moe-ep2",
        "configs/tiny-moe.yaml",
        (
            f"model.source={FIXTURES / 'megatron' / 'moe_hf'}",
            f"checkpoint.path={FIXTURES / 'megatron' / 'moe_ep2'}",
            "checkpoint.format=megatron",
            "load.params=none",
            "quant.ignore=[lm_head]",
        ),
        source="given",
        layouts=LAYOUTS[:1],
    ),
    Case(
        "torchtitan-llama3",
        "configs/tiny-dense.yaml",
        (
            f"model.source={FIXTURES / 'torchtitan' / 'llama3_hf'}",
            f"checkpoint.path={FIXTURES / 'torchtitan' / 'llama3'}",
            "checkpoint.format=torchtitan",
            "load.params=none",
        ),
        source="given",
        layouts=LAYOUTS[:1],
    ),
]


# the one field of config.json (and generation_config.json) that names the library that wrote
# it, not what the export says
_WRITER = re.compile(rb'("transformers_version": )"[^"]*"')


def _file_bytes(p: Path) -> bytes:
    data = p.read_bytes()
    return _WRITER.sub(rb'\1"*"', data) if p.suffix == ".json" else data


def _digests(out: Path) -> dict[str, str]:
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(_file_bytes(p)).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _run(*argv: str) -> None:
    from tests._inproc import run_main

    r = run_main(*argv)
    assert r.returncode == 0, (argv, r.stderr[-3000:])


def _source(case: Case, run: Path) -> list[str]:
    """The ``--set``s that point the recipe at this case's checkpoint, made here if need be."""
    from tests import quantized_fixtures as fx

    if case.source == "given":
        return []
    if case.source == "convert":
        dcp = run / "dcp"
        _run("convert", str(ROOT / case.recipe), str(dcp), *_sets(case.sets))
        return [f"checkpoint.path={dcp}"]
    from qckpt import load_recipe

    model = load_recipe(ROOT / case.recipe).model.source
    src = fx.bf16_dir(run, model)
    if case.source == "blockwise":
        src = fx.blockwise_fp8(src, run / "blockwise")
    # the model is the dir's own (config.json), read as safetensors; nothing quantized loads
    return [f"model.source={src}", f"checkpoint.path={src}", "load.params=none"]


def _sets(sets: tuple[str, ...] | list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


# one code path for MKL and ATen on any x86 machine, one thread (a thread count changes how a
# reduction is split)
PINNED_BLAS = {
    "MKL_CBWR": "COMPATIBLE,STRICT",
    "ATEN_CPU_CAPABILITY": "avx2",
    # oneDNN (the BF16 matmuls of the calibration forward) dispatches on the ISA too: an AMD
    # machine with avx512_bf16 gave other GPTQ bytes than the Intel one under the MKL pin alone
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def export_case(case: Case, run: Path) -> dict[str, dict[str, str]]:
    """Each layout's export of ``case`` (made under ``run``) -> file -> sha256; a ``blas`` case
    in a child process under :data:`PINNED_BLAS`."""
    if case.blas:
        r = subprocess.run(
            [sys.executable, "-m", MODULE, "--case", case.name, str(run)],
            cwd=ROOT,
            env={**os.environ, **PINNED_BLAS},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1])
    return _export_here(case, run)


def _export_here(case: Case, run: Path) -> dict[str, dict[str, str]]:
    run.mkdir(parents=True, exist_ok=True)
    sets = [*case.sets, *_source(case, run), f"calibrate.output={run}/calib.safetensors"]
    _run("calibrate", str(ROOT / case.recipe), *_sets(sets))
    out: dict[str, dict[str, str]] = {}
    for layout in case.layouts:
        dst = run / layout
        more = [f"export.format={layout}", f"export.output={dst}"]
        _run("export", str(ROOT / case.recipe), *_sets([*sets, *more]))
        out[layout] = _digests(dst)
    return out


def _recorded() -> dict:
    return json.loads(HASHES.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_export_bytes_are_the_recorded_ones(tmp_path, case):
    recorded = _recorded()
    assert case.name in recorded, f"{case.name}: not recorded (run with --record)"
    assert export_case(case, tmp_path) == recorded[case.name]


def test_every_case_is_recorded_and_every_example_recipe_is_a_case():
    assert sorted(_recorded()) == sorted(c.name for c in CASES)
    recipes = {p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml")}
    assert recipes <= {c.recipe for c in CASES if not c.sets and c.source == "convert"}


def _record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        got = {c.name: export_case(c, Path(tmp) / c.name) for c in CASES}
    HASHES.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    print(f"recorded {sum(map(len, got.values()))} exports of {len(got)} cases in {HASHES}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--case"] and len(args) == 3:
        # a ``blas`` case's child (export_case): its digests as the last line of stdout
        (case,) = [c for c in CASES if c.name == args[1]]
        print(json.dumps(_export_here(case, Path(args[2]))))
    elif args == ["--record"]:
        _record()
    else:
        sys.exit(f"usage: python -m {MODULE} --record")
