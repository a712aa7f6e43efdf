"""The front door (issue 28): ``import qckpt`` offers exactly these names, imports no torch,
and every name resolves; the torch-free ones stay torch-free when used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PUBLIC = [
    "load_recipe", "init_mesh", "build_model", "quantize", "dequantize", "empty",
    "open_checkpoint", "load_checkpoint", "LoadOptions", "calibrate_model", "save_calibration",
    "load_calibration", "plan_export", "write_export", "export_checkpoint", "WriteOptions",
    "check_export", "evaluate_export", "EvalOptions", "recipe_from_dict", "EXPORT_MARKER",
    "QckptError", "UsageError", "RecipeError", "FormatError", "CheckpointError",
    "CalibrationError", "SyncError", "PeerError", "ExportError", "OutputPathError", "OutputError",
]  # fmt: skip
# names a script may use without paying for torch (qckpt check's path, recipes, options, errors)
TORCH_FREE = [n for n in PUBLIC if n.endswith(("Error", "EvalOptions", "LoadOptions"))] + [
    "check_export",
    "load_recipe",
    "recipe_from_dict",
    "EXPORT_MARKER",
]

PROBE = """
import json, sys
import qckpt
out = {"dir": dir(qckpt), "all": list(qckpt.__all__), "version": qckpt.__version__}
out["after_import"] = sorted(m for m in ("torch", "transformers") if m in sys.modules)
for name in json.loads(sys.argv[1]):
    getattr(qckpt, name)
out["after_light"] = sorted(m for m in ("torch", "transformers") if m in sys.modules)
out["kinds"] = {n: type(getattr(qckpt, n)).__name__ for n in qckpt.__all__}
print("RESULT", json.dumps(out))
"""


def test_import_qckpt_offers_exactly_the_public_names_and_no_torch():
    r = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(TORCH_FREE)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )  # fmt: skip
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-2000:]
    got = json.loads(line[len("RESULT ") :])
    assert got["all"] == PUBLIC
    assert got["dir"] == sorted(PUBLIC)
    assert got["after_import"] == [] and got["after_light"] == [], got
    # every name resolves: a class for the options and errors, a function for the verbs, the
    # marker's file name a string
    kinds = {n: "function" if n[0].islower() else "type" for n in PUBLIC}
    kinds["EXPORT_MARKER"] = "str"
    assert got["kinds"] == kinds
    assert got["version"]


def test_front_door_names_are_the_modules_own_objects():
    import qckpt
    from qckpt import outputs
    from qckpt.calib import state_file
    from qckpt.errors import QckptError
    from qckpt.export import writer as export

    assert qckpt.save_calibration is state_file.save_calibration
    assert qckpt.WriteOptions is export.WriteOptions
    assert qckpt.EXPORT_MARKER == outputs.EXPORT_MARKER == ".qckpt-export.json"
    assert all(issubclass(getattr(qckpt, n), QckptError) for n in PUBLIC if n.endswith("Error"))
    # a name outside the list is no front-door name (``qckpt.load`` is the package of the
    # loader now: once imported, the import system sets it on qckpt as any submodule)
    with pytest.raises(AttributeError, match="no attribute 'load_model'"):
        qckpt.load_model  # noqa: B018
    # a submodule is still importable by name (the lookup falls back to the import system)
    from qckpt import formats

    assert qckpt.quantize is formats.quantize


def test_load_options_reach_the_loader_and_bad_ones_are_refused(tmp_path):
    import qckpt

    model = qckpt.build_model("tiny-dense", seed=3)
    model.save_pretrained(tmp_path / "hf")
    fp8 = qckpt.build_model("tiny-dense", params="fp8", weights="empty", ignore=["lm_head"])
    rep = qckpt.load_checkpoint(fp8, tmp_path / "hf", qckpt.LoadOptions(reader="plain"))
    assert (rep.reader, rep.format, rep.tensors_per_format["fp8"]) == ("plain", "safetensors", 14)
    w = fp8.model.layers[0].self_attn.q_proj.weight
    ref = model.model.layers[0].self_attn.q_proj.weight
    assert qckpt.dequantize(w).float().sub(ref.float()).abs().max() <= ref.abs().max() / 8
    with pytest.raises(qckpt.UsageError, match="seeded or empty"):
        qckpt.build_model("tiny-dense", weights="zeros")
    with pytest.raises(qckpt.UsageError, match="max or mse"):
        qckpt.calibrate_model(model, [], qckpt.load_recipe(ROOT / "configs/tiny-dense.yaml").quant,
                              algorithm="gptq")  # fmt: skip
