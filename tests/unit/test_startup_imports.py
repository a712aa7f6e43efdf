"""Commands that need no model start without torch or transformers (issue 18: no wasted work):
help, version, ``check``, and every refusal made before the work (a bad recipe, a guarded
output). One subprocess runs them all through ``main`` and reports what got imported."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("torch", "transformers", "triton", "matplotlib", "safetensors.torch")


def test_commands_that_need_no_model_import_no_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {source: tiny-moe}\nload: {params: fp9}\n")
    good = ROOT / "configs" / "tiny-moe.yaml"
    (tmp_path / "empty").mkdir()
    argvs = {
        "help": (["--help"], 0),
        "version": (["--version"], 0),
        "load help": (["load", "--help"], 0),
        "calibrate help": (["calibrate", "--help"], 0),
        "export help": (["export", "--help"], 0),
        "convert help": (["convert", "--help"], 0),
        "check of a dir that is no export": (["check", str(tmp_path / "empty")], 1),
        "eval of a missing export": (["eval", str(tmp_path / "missing")], 2),
        "eval help": (["eval", "--help"], 0),
        "a bad recipe value": (["load", str(bad)], 2),
        "--json onto the recipe": (["load", str(good), "--json", str(good)], 2),
        "convert --json onto its recipe": (
            ["convert", str(good), str(tmp_path / "dst"), "--json", str(good)],
            2,
        ),
        "export onto its own checkpoint": (
            [
                "export",
                str(good),
                "--set",
                "export.output=runs/x",
                "--set",
                "checkpoint.path=runs/x",
            ],
            2,
        ),
    }
    code = (
        "import json, sys\n"
        "from qckpt.cli.app import main\n"
        "out = {}\n"
        "for name, argv in json.loads(sys.argv[1]).items():\n"
        "    try:\n        main(argv)\n        rc = 0\n"
        "    except SystemExit as e:\n        rc = e.code if isinstance(e.code, int) else 1\n"
        f"    out[name] = [rc, [m for m in {HEAVY!r} if m in sys.modules]]\n"
        "print('RESULT', json.dumps(out))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps({k: v[0] for k, v in argvs.items()})],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-2000:]
    got = json.loads(line[len("RESULT ") :])
    assert {k: v[0] for k, v in got.items()} == {k: v[1] for k, v in argvs.items()}, r.stderr
    # every one of them, in one process, left the heavy modules unimported
    assert all(not v[1] for v in got.values()), got


def test_modules_compiled_from_source_are_counted_and_a_cache_clears_them(tmp_path, monkeypatch):
    """``compiled_at_import`` (every command's ``--json``) names the modules this process
    compiled because no bytecode cache was there, and stops naming one once its cache exists;
    the report's advice line appears only above its threshold."""
    import importlib
    import py_compile

    from qckpt.bytecode import WARN_SOURCE_BYTES, advice, compiled_at_import

    pkg = tmp_path / "qckpt_bc_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("X = 1\n" + "# padding\n" * 100)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    try:
        mod = importlib.import_module("qckpt_bc_probe.mod")
        mods = {"qckpt_bc_probe": sys.modules["qckpt_bc_probe"], "qckpt_bc_probe.mod": mod}
        got = compiled_at_import(mods)
        assert got["modules"] == 2 and got["by_package"] == {"qckpt_bc_probe": 2}
        assert got["source_bytes"] == (pkg / "mod.py").stat().st_size
        assert got["writes_bytecode"] is False
        py_compile.compile(str(pkg / "mod.py"), cfile=mod.__spec__.cached)
        assert compiled_at_import(mods)["by_package"] == {"qckpt_bc_probe": 1}  # __init__ only
    finally:
        for name in ("qckpt_bc_probe.mod", "qckpt_bc_probe"):
            sys.modules.pop(name, None)
    assert advice(got) is None  # a few bytes: nothing to say
    big = {**got, "source_bytes": WARN_SOURCE_BYTES, "by_package": {"torch": 700}}
    line = advice(big)
    assert line is not None and "\n" not in line
    assert "torch 700" in line and "PYTHONDONTWRITEBYTECODE" in line and "compileall" in line


def test_the_report_prints_the_startup_parts_and_the_advice_as_one_line_each():
    import io

    from rich.console import Console

    from qckpt.bytecode import WARN_SOURCE_BYTES
    from qckpt.report import render_command

    buf = io.StringIO()
    data = {
        "phases": {"startup": 9.5, "read": 1.0, "total": 10.5},
        "startup_parts": {"before_main": 0.3, "torch": 3.0, "model_code": 6.0, "other": 0.2},
        "compiled_at_import": {
            "modules": 2678,
            "source_bytes": 2 * WARN_SOURCE_BYTES,
            "by_package": {"torch": 1151, "sympy": 419},
            "writes_bytecode": False,
        },
    }
    render_command(data, Console(file=buf, width=40, highlight=False))
    lines = buf.getvalue().splitlines()
    assert any(ln.startswith("start-up (s)") and "model code 6.00" in ln for ln in lines), lines
    notes = [ln for ln in lines if "compiled 2678 modules" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: ") and "compileall" in notes[0], lines
    # below the threshold (a few of qckpt's own modules): no note
    buf = io.StringIO()
    data["compiled_at_import"]["source_bytes"] = 500_000
    render_command(data, Console(file=buf, width=40, highlight=False))
    assert "note:" not in buf.getvalue()


def test_cuda_first_use_runs_on_a_thread_during_the_imports_and_is_joined(monkeypatch):
    """The start-up's CUDA warm-up: the first CUDA tensor is made on another thread while the
    imports run, joined before ``warm_imports`` returns, and then the main thread's device is
    this rank's GPU (a phase boundary synchronizes the current device: the default GPU 0 would
    get a context of every rank). A failure there stays silent: the world's set-up reports it.
    CUDA is faked (this machine has none)."""
    import threading

    import torch

    from qckpt.pipeline import imports

    calls: list[tuple[str, str, object]] = []
    state = {"init": False, "fail": False}
    real_empty = torch.empty

    def fake_empty(*a, **kw):
        dev = kw.get("device")
        if getattr(dev, "type", None) != "cuda":
            return real_empty(*a, **kw)
        calls.append(("empty", threading.current_thread().name, dev))
        if state["fail"]:
            raise RuntimeError("CUDA error: no CUDA-capable device is detected")
        state["init"] = True
        return real_empty(*a)

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["init"])
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda d: calls.append(("set_device", threading.current_thread().name, d)),
    )
    imports.warm_imports(None, "json", cuda_first_use=True)
    main = threading.current_thread().name
    assert [c[0] for c in calls] == ["empty", "set_device", "set_device"], calls
    assert calls[0][1] != main and calls[0][2] == torch.device("cuda", 1)
    # the thread's own device (its warm-up launches there), never GPU 0
    assert calls[1][1] == calls[0][1] and calls[1][2] == torch.device("cuda", 1)
    assert calls[2][1:] == (main, 1)  # after the join, on this thread, this rank's GPU
    assert not any(t.name == "qckpt-cuda-first-use" for t in threading.enumerate())

    calls.clear()
    state.update(init=False, fail=True)
    imports.warm_imports(None, "json", cuda_first_use=True)  # no exception comes out
    assert [c[0] for c in calls] == ["empty"], calls  # no device set: nothing initialized

    calls.clear()
    imports.warm_imports(None, "json")  # off unless asked
    assert calls == []
    assert imports.cuda_warmup_wanted("auto", {"QCKPT_CUDA_WARMUP": "1"})
    assert not imports.cuda_warmup_wanted("cpu", {"QCKPT_CUDA_WARMUP": "1"})
    assert imports.cuda_warmup_wanted("cuda", {})  # on by default
    assert not imports.cuda_warmup_wanted("cuda", {"QCKPT_CUDA_WARMUP": "0"})


def _imports_of(argvs: dict, cwd) -> dict:
    """{name: [exit code, which of HEAVY + transformers' modeling code it imported]}, each argv
    run through ``main`` in a fresh process of its own."""
    mods = (*HEAVY, "transformers.modeling_utils", "torch.distributed.checkpoint")
    code = (
        "import json, sys\nfrom qckpt.cli.app import main\n"
        "try:\n    main(json.loads(sys.argv[1]))\n    rc = 0\n"
        "except SystemExit as e:\n    rc = e.code if isinstance(e.code, int) else 1\n"
        f"print('RESULT', json.dumps([rc, [m for m in {mods!r} if m in sys.modules]]))\n"
    )
    out = {}
    for name, argv in argvs.items():
        r = subprocess.run(
            [sys.executable, "-c", code, json.dumps(argv)],
            capture_output=True, text=True, timeout=300, cwd=str(cwd),
        )  # fmt: skip
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert line is not None, r.stderr[-2000:]
        out[name] = json.loads(line[len("RESULT ") :])
    return out


def test_export_check_and_inspect_import_no_model_code(tmp_path):
    """What each command that needs no model code imports (issue 30): export reads the model's
    linears from the calibration file that calibrate wrote, so it imports torch but none of
    transformers; check, and inspect of a DCP dir, an export or a calibration file, import no
    torch (an export's ``source_layout``, told from torch dtypes, comes with --json / -v only);
    the export is byte for byte the one made by building the model."""
    from qckpt.calib.state_file import load_calibration, save_calibration
    from qckpt.export.model_record import peek, usable
    from tests._inproc import run_main

    recipe = str(ROOT / "configs" / "tiny-dense.yaml")
    sets = [
        "--set", f"checkpoint.path={tmp_path}/dcp", "--set", f"calibrate.output={tmp_path}/c.safetensors",
        "--set", "calibrate.data.num_samples=4",
    ]  # fmt: skip
    assert run_main("convert", recipe, f"{tmp_path}/dcp", *sets, cwd=tmp_path).returncode == 0
    assert run_main("calibrate", recipe, *sets, cwd=tmp_path).returncode == 0
    assert usable(peek(tmp_path / "c.safetensors"), "tiny-dense")
    # the same calibration without the record: export builds the model as it always did
    state = load_calibration(tmp_path / "c.safetensors")
    state.model = {}
    save_calibration(state, tmp_path / "bare.safetensors")
    bare = [*sets, "--set", f"calibrate.output={tmp_path}/bare.safetensors"]
    fast = [*sets, "--set", f"export.output={tmp_path}/fast"]
    got = _imports_of(
        {
            "export": ["export", recipe, *fast],
            "export, no record": [
                "export",
                recipe,
                *bare,
                "--set",
                f"export.output={tmp_path}/slow",
            ],
            "check": ["check", f"{tmp_path}/fast"],
            "check --json": ["check", f"{tmp_path}/fast", "--json", f"{tmp_path}/check.json"],
            "inspect a calibration": ["inspect", f"{tmp_path}/c.safetensors"],
            "inspect a DCP dir": ["inspect", f"{tmp_path}/dcp"],
            "inspect a DCP dir --json": [
                "inspect",
                f"{tmp_path}/dcp",
                "--json",
                f"{tmp_path}/dcp.json",
            ],
            "inspect an export": ["inspect", f"{tmp_path}/fast"],
        },
        tmp_path,
    )
    assert got["export"] == [0, ["torch", "safetensors.torch", "torch.distributed.checkpoint"]], got
    assert got["export, no record"][0] == 0
    assert "transformers.modeling_utils" in got["export, no record"][1]
    for name in (
        "check", "check --json", "inspect a calibration", "inspect a DCP dir",
        "inspect a DCP dir --json", "inspect an export",
    ):  # fmt: skip
        assert got[name] == [0, []], (name, got[name])
    for f in sorted(p.name for p in (tmp_path / "slow").iterdir()):
        if f != ".qckpt-export.json":
            assert (tmp_path / "fast" / f).read_bytes() == (tmp_path / "slow" / f).read_bytes(), f


def test_plan_imports_no_torch(tmp_path):
    """issue 44: plan sizes the model from its config (``plan.spec``), so neither torch nor
    transformers is imported, with and without --gpu-memory's layout search."""
    recipe = str(ROOT / "configs" / "tiny-moe.yaml")
    got = _imports_of(
        {
            "plan": ["plan", recipe, "--nproc-per-node", "1", "--set", "checkpoint.path=none"],
            "plan, a layout search": [
                "plan", recipe, "--nproc-per-node", "4", "--gpu-memory", "1MiB",
                "--host-memory", "1TB", "--set", "checkpoint.path=none", "--json",
                str(tmp_path / "plan.json"),
            ],
        },
        tmp_path,
    )  # fmt: skip
    assert got == {"plan": [0, []], "plan, a layout search": [0, []]}, got
