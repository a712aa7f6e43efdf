"""Every output of every command aimed at each of its inputs, at their parents, at the working
directory, the home directory, the root, an empty path and a symlink to an input: the CLI (run as
a user runs it) refuses with exit 2 and one line naming the output, before any work; every file
of the workspace and of $HOME is byte-identical afterwards and nothing new appears.

The workspace is made once (cheap stand-ins for the inputs: the guard refuses before reading
them) and the recipe sets ``export.overwrite: true``, so a missing refusal would destroy.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.conftest import run_qckpt

RECIPE = """\
model: {source: model, dtype: bfloat16, seed: 0}
checkpoint: {path: ckpt/dcp}
calibrate:
  data: {source: text, path: data/text.txt, num_samples: 4, seq_len: 8, batch_size: 2}
  output: cal/calib.safetensors
export: {output: out/fp8, overwrite: true}
"""


def _tree_hashes(*roots: Path) -> dict[str, str]:
    """sha256 of every file (and the target of every symlink) under the roots, by path."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    out[str(p)] = "link:" + os.readlink(p)
                elif p.is_file():
                    out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
                else:
                    out[str(p)] = "dir"
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    home, work = root / "home", root / "work"
    (home / ".config").mkdir(parents=True)
    (home / ".config" / "keep").write_text("the user's own file")
    (work / "model").mkdir(parents=True)
    (work / "model" / "config.json").write_text('{"model_type": "llama"}')
    (work / "model" / "model.safetensors").write_bytes(os.urandom(256))
    (work / "ckpt" / "dcp").mkdir(parents=True)
    (work / "ckpt" / "dcp" / ".metadata").write_bytes(os.urandom(64))
    (work / "ckpt" / "dcp" / "__0_0.distcp").write_bytes(os.urandom(512))
    (work / "cal").mkdir()
    (work / "cal" / "calib.safetensors").write_bytes(os.urandom(128))
    (work / "data").mkdir()
    (work / "data" / "text.txt").write_text("some calibration text\n" * 10)
    (work / "recipe.yaml").write_text(RECIPE)
    (work / "emptydir").mkdir()
    (work / "link-ckpt").symlink_to("ckpt/dcp")
    (work / "link-cal").symlink_to("cal/calib.safetensors")
    (work / "link-recipe").symlink_to("recipe.yaml")
    return {"root": root, "home": home, "work": work}


# targets: (path as the user types it, words the refusal must contain)
INPUT_TARGETS = {
    "recipe": ("recipe.yaml", "is RECIPE"),
    "checkpoint": ("ckpt/dcp", "is checkpoint.path"),
    "checkpoint-file": ("ckpt/dcp/__0_0.distcp", "lies inside checkpoint.path"),
    "checkpoint-parent": ("ckpt", "contains checkpoint.path"),
    "model": ("model", "is model.source"),
    "model-file": ("model/config.json", "lies inside model.source"),
    "calib": ("cal/calib.safetensors", "is calibrate.output"),
    "calib-parent": ("cal", "contains calibrate.output"),
    "data": ("data/text.txt", "is calibrate.data.path"),
    "link-to-checkpoint": ("link-ckpt", "is checkpoint.path"),
    "link-to-calib": ("link-cal", "is calibrate.output"),
    "link-to-recipe": ("link-recipe", "is RECIPE"),
}
PLACE_TARGETS = {
    "dot": (".", "is the working directory"),
    "cwd-absolute": ("{work}", "is the working directory"),
    "cwd-parent": ("..", "contains the"),
    "home": ("~/", "is the home directory"),
    "root": ("/", "is the filesystem root"),
}


def _cases():
    """(command, output key, how to pass it, target name): every output of every command, at
    its inputs (under their keys), their parents, symlinks to them and the protected places."""
    inputs = ["recipe", "checkpoint", "checkpoint-file", "checkpoint-parent", "model"]
    inputs += ["model-file", "link-to-checkpoint", "calib", "calib-parent", "link-to-calib"]
    cases = [("export", "export.output", "set", t) for t in [*inputs, *PLACE_TARGETS, "empty"]]
    for t in ["recipe", "checkpoint-file", "checkpoint-parent", "model-file", "data"]:
        cases.append(("calibrate", "calibrate.output", "set", t))
    for t in ["link-to-recipe", "dot", "empty", "emptydir"]:
        cases.append(("calibrate", "calibrate.output", "set", t))
    for t in ["recipe", "calib", "emptydir", "inside-export.output"]:
        cases.append(("export", "--json", "flag", t))
    for t in ["checkpoint-file", "data", "same-as-calibrate.output"]:
        cases.append(("calibrate", "--json", "flag", t))
    cases += [("load", "--json", "flag", t) for t in ["model-file", "link-to-checkpoint", "dot"]]
    cases += [("load", "--plot", "flag", "recipe")]
    for t in ["calib", "link-to-calib", "calib-parent", "emptydir"]:
        cases.append(("inspect", "--json", "flag", t))
    for t in ["recipe", "model-file", "home", "root", "dot"]:
        cases.append(("convert-recipe", "DST", "arg", t))
    for t in ["checkpoint", "checkpoint-file", "checkpoint-parent", "link-to-checkpoint"]:
        cases.append(("convert-dcp", "DST", "arg", t))
    return cases


def _target(name: str, cmd: str, ws) -> tuple[str, str]:
    if name in INPUT_TARGETS:
        path, words = INPUT_TARGETS[name]
        # the same file under the name this command gives it
        if cmd == "inspect":
            words = words.replace("calibrate.output", "PATH")
        if cmd == "convert-dcp":
            words = words.replace("checkpoint.path", "SRC")
        return path, words
    if name in PLACE_TARGETS:
        path, words = PLACE_TARGETS[name]
        return path.format(work=ws["work"]), words
    return {
        "empty": ("", "empty path"),
        "emptydir": ("emptydir", "is a directory; name a file"),
        "same-as-calibrate.output": ("out/calib.safetensors", "is calibrate.output"),
        "inside-export.output": ("out/fp8/report.json", "lies inside export.output"),
    }[name]


def _argv(cmd: str, key: str, how: str, path: str) -> list[str]:
    if cmd == "inspect":
        return ["inspect", "cal/calib.safetensors", "--json", path]
    if cmd == "convert-recipe":
        return ["convert", "recipe.yaml", path]
    if cmd == "convert-dcp":
        return ["convert", "ckpt/dcp", path, "--to", "hf"]
    argv = [cmd, "recipe.yaml"]
    if cmd == "calibrate" and key == "--json":
        argv += ["--set", "calibrate.output=out/calib.safetensors"]
    return argv + (["--set", f"{key}={path}"] if how == "set" else [key, path])


@pytest.mark.parametrize(("cmd", "key", "how", "target"), _cases(), ids=lambda v: str(v))
def test_output_aimed_at_an_input_is_refused_and_nothing_changes(ws, cmd, key, how, target):
    path, words = _target(target, cmd, ws)
    before = _tree_hashes(ws["root"])
    r = run_qckpt(*_argv(cmd, key, how, path), cwd=ws["work"], env={"HOME": str(ws["home"])})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"qckpt: error: {key}: "), r.stderr
    assert words in lines[0], lines[0]
    assert _tree_hashes(ws["root"]) == before  # byte-identical, and nothing new (no temp)
