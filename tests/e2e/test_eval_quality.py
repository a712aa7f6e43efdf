"""``qckpt eval`` on the shared quality model (a small Llama trained on Python text): the BF16
source gives the README's figure, each of qckpt's exports stays within its tolerance of it, a
broken export is caught, and the command's exits and messages.

One calibration (32 x 512 bytes of ``calib.bin``, per-tensor weights, static inputs: a quarter of
the README's 128 windows, since calibration's BF16 matmuls are slow on a CPU) is run for the
module; the other variants' calibration files are derived from it: their input amaxes are the
same observations, and a ``max`` weight amax is the weights' own abs-max per tensor,
channel or block. Exports and the source's outputs are shared by the tests of this module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import ROOT, run_qckpt

QUALITY = ROOT.parent / "shared" / "quality"
MODEL = QUALITY / "models" / "llama-textlm"
HELDOUT = QUALITY / "heldout.bin"

pytestmark = [
    pytest.mark.skipif(not MODEL.is_dir(), reason="../shared/quality is not here"),
    # the module's exports fixture (a calibration and six exports of the Llama) is timed as part
    # of the first test that uses it
    pytest.mark.timeout(600),
]

FP8_TOL, NVFP4_TOL = 0.005, 0.03
FEW = 8  # windows where the exact README figure is not needed

# name -> (export.format, weights, inputs)
VARIANTS = {
    "ct-fp8-tensor": ("compressed-tensors", ("fp8", "tensor"), ("fp8", "tensor", False)),
    "ct-fp8-channel": ("compressed-tensors", ("fp8", "channel"), ("fp8", "tensor", True)),
    "ct-fp8-block": ("compressed-tensors", ("fp8", "block"), ("fp8", "block", True)),
    "ct-nvfp4": ("compressed-tensors", ("nvfp4", "tensor"), ("nvfp4", "tensor", False)),
    "modelopt-fp8": ("modelopt", ("fp8", "tensor"), ("fp8", "tensor", False)),
    "modelopt-nvfp4": ("modelopt", ("nvfp4", "tensor"), ("nvfp4", "tensor", False)),
}


def _recipe(tmp: Path, name: str, fmt: str, w: tuple, i: tuple, calib: Path) -> Path:
    text = f"""
model: {{source: {MODEL}}}
checkpoint: {{path: {MODEL}}}
quant:
  weights: {{format: {w[0]}, granularity: {w[1]}}}
  inputs: {{format: {i[0]}, granularity: {i[1]}, dynamic: {str(i[2]).lower()}}}
  ignore: ["lm_head"]
calibrate:
  data: {{source: text, path: {QUALITY / "calib.bin"}, num_samples: 32, seq_len: 512,
          batch_size: 16}}
  output: {calib}
export: {{format: {fmt}, output: {tmp / name}}}
eval: {{path: {HELDOUT}, windows: 2}}
"""
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def _weight_amax(w: torch.Tensor, granularity: str) -> torch.Tensor:
    a = w.float().abs()
    if granularity == "tensor":
        return a.amax()
    if granularity == "channel":
        return a.amax(dim=1)
    r, c = w.shape
    pad = torch.zeros(-(-r // 128) * 128, -(-c // 128) * 128)
    pad[:r, :c] = a
    return pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).amax(dim=(1, 3))


def _derive(base: Path, out: Path, w: tuple, i: tuple) -> None:
    from qckpt import load_calibration, save_calibration

    state = load_calibration(base)
    weights = load_file(str(MODEL / "model.safetensors"))
    for key in list(state.amax):
        if key.endswith(".weight_amax"):
            state.amax[key] = _weight_amax(weights[key[: -len("_amax")]], w[1])
    state.quant["weights"] = {**state.quant["weights"], "format": w[0], "granularity": w[1]}
    state.quant["inputs"] = {
        **state.quant["inputs"],
        "format": i[0],
        "granularity": i[1],
        "dynamic": i[2],
    }
    save_calibration(state, out)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("quality")
    base = tmp / "calib-base.safetensors"
    fmt, w, i = VARIANTS["ct-fp8-tensor"]
    r = run_qckpt("calibrate", str(_recipe(tmp, "base", fmt, w, i, base)), timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    recipes = []
    for name, (fmt, w, i) in VARIANTS.items():
        calib = tmp / f"calib-{name}.safetensors"
        _derive(base, calib, w, i)
        recipes.append(str(_recipe(tmp, name, fmt, w, i, calib)))
    # every export in one process: one interpreter and torch start-up for all six
    code = (
        "import sys\nfrom qckpt.cli.app import main\n"
        "for r in sys.argv[1:]:\n"
        "    try:\n        main(['export', r])\n"
        "    except SystemExit as e:\n        assert e.code in (0, None), (r, e.code)\n"
    )
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", code, *recipes], capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return {name: tmp / name for name in VARIANTS} | {"_tmp": tmp}


@pytest.fixture(scope="module")
def source_cache() -> dict:
    return {}


def _eval(export: Path, cache: dict | None, windows: int = FEW, fused: str = "vllm", **kw) -> dict:
    from qckpt import EvalOptions
    from qckpt.evaluate.run import evaluate  # evaluate_export's body: it takes the source cache

    opts = EvalOptions(windows=windows, fused=fused, **kw)
    return evaluate(export, MODEL, HELDOUT, opts, cache=cache)


# NVFP4 shards (q/k/v, gate/up) computed as vLLM loads them (one global scale per fused weight)
# and as stored: qckpt's export gives them one global scale, so the two agree (before it did,
# vLLM served them as garbage: issue 26, 4.78 bits/byte in vLLM 0.26)
CASES = [pytest.param(n, "vllm", id=n) for n in VARIANTS] + [
    pytest.param(n, "as-stored", id=f"{n}-as-stored") for n in VARIANTS if "nvfp4" in n
]


def test_the_bf16_source_gives_the_readmes_bits_per_byte():
    from qckpt import EvalOptions
    from qckpt.evaluate.run import score_model

    got = score_model(MODEL, HELDOUT, EvalOptions())  # 64 windows of 513, seed 7
    assert got["unit"] == "byte" and got["tokens"] == 64 * 512
    assert abs(got["bits_per_byte"] - 1.0927) <= 0.0005, got


@pytest.mark.parametrize(("name", "fused"), CASES)
def test_each_export_stays_within_its_tolerance_of_the_source(exports, source_cache, name, fused):
    rep = _eval(exports[name], source_cache, fused=fused)
    tol = NVFP4_TOL if "nvfp4" in name else FP8_TOL
    src, exp = rep["source_bits_per_byte"], rep["export_bits_per_byte"]
    assert abs(exp / src - 1.0) < tol, (name, src, exp)
    assert rep["emulated"]["linears"] == 42  # every linear but lm_head, emulated
    want = {"ct-fp8-tensor": "fp8 static per-tensor", "ct-fp8-channel": "fp8 dynamic per-token"}
    want |= {"ct-fp8-block": "fp8 dynamic per-group 128", "modelopt-fp8": "fp8 static per-tensor"}
    mode = want.get(name, "nvfp4 per-16 under a static global scale")
    assert rep["scheme"]["input_quantization"] == {mode: 42}
    top1, kl = (0.90, 0.05) if "nvfp4" in name else (0.95, 0.01)
    assert rep["top1_agreement"] > top1 and 0.0 < rep["kl_mean"] < kl, rep
    assert rep["warnings"] == []
    assert len(rep["layers"]) == 6 and len(rep["layers_moved_most"]) == 3


def test_fused_shards_are_computed_as_vllm_loads_them(exports):
    """FP8 per-tensor q/k/v (gate/up) requantized to the group's largest scale through float16
    (vLLM's requantize_with_max_scale); NVFP4 shards all computed with the largest global scale,
    with a warning when that is not their own."""
    from qckpt.evaluate.fused import requantized
    from qckpt.evaluate.scheme import read_scheme

    fp8 = read_scheme(exports["ct-fp8-tensor"])
    f = fp8.fetch()
    attn = "model.layers.0.self_attn"
    scales = {p: f(f"{attn}.{p}_proj.weight_scale", None, None).float().reshape(()) for p in "qkv"}
    smax = max(scales.values())
    for p, s in scales.items():
        mod = f"{attn}.{p}_proj"
        assert (mod in fp8.requant) == (s != smax) and (s == smax or fp8.requant[mod] == smax)
        if s != smax:
            codes = f(f"{mod}.weight", None, None)
            dq = (codes.float() * s.half().float()).half()  # both in float16, product rounded
            ref = (dq.float() * (1.0 / smax)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            got = requantized(fp8.weights[f"{mod}.weight"], f, smax)
            assert torch.equal(got, ref * smax)
    # qckpt's NVFP4 export: one global scale per fused weight, nothing recomputed
    nv = read_scheme(exports["ct-nvfp4"])
    assert nv.nvfp4_global == {} and not any("NVFP4 global" in n for n in nv.notes)
    # another tool's export whose gate and up disagree: both computed with the larger, and said
    bad = exports["_tmp"] / "nvfp4-split-globals"
    if not bad.exists():
        shutil.copytree(exports["ct-nvfp4"], bad)
        f = next(bad.glob("*.safetensors"))
        t = load_file(str(f))
        t["model.layers.0.mlp.up_proj.weight_global_scale"] *= 2
        save_file(t, str(f), metadata={"format": "pt"})
    nv = read_scheme(bad)
    g = nv.fetch()
    mlp = "model.layers.0.mlp"
    gs = {p: float(g(f"{mlp}.{p}_proj.weight_global_scale", None, None)) for p in ("gate", "up")}
    used = max(gs.values())
    for p, v in gs.items():
        assert (f"{mlp}.{p}_proj" in nv.nvfp4_global) == (v != used)
    assert any("different NVFP4 global scales" in n for n in nv.notes)
    stored = read_scheme(bad, fused="as-stored")
    assert stored.nvfp4_global == {} and stored.notes == []


def test_unquantized_inputs_give_the_weights_alone(exports, source_cache):
    """``--inputs unquantized``: no linear's input quantized, the same figure as the export's
    weights dequantized into a plain model (what a weight-only kernel computes), and below the
    W4A4 figure of the same export."""
    from qckpt import EvalOptions
    from qckpt.evaluate.run import score_model

    w4a4 = _eval(exports["ct-nvfp4"], source_cache)
    w4a16 = _eval(exports["ct-nvfp4"], source_cache, inputs="unquantized")
    assert w4a16["scheme"]["input_quantization"] == {"unquantized": 42}
    assert w4a16["options"]["inputs"] == "unquantized"
    assert w4a16["source_bits_per_byte"] == w4a4["source_bits_per_byte"]
    plain = score_model(exports["ct-nvfp4"], HELDOUT, EvalOptions(windows=FEW))
    assert abs(w4a16["export_bits_per_byte"] / plain["bits_per_byte"] - 1) < 1e-3, plain
    assert w4a16["export_bits_per_byte"] < w4a4["export_bits_per_byte"]
    assert w4a16["kl_mean"] < w4a4["kl_mean"]
    # a Hopper client has no FP4 GEMM (NVFP4 runs weight-only) and one for FP8 inputs
    hop = _eval(exports["ct-nvfp4"], source_cache, inputs="hopper")
    assert hop["export_bits_per_byte"] == w4a16["export_bits_per_byte"]
    fp8 = _eval(exports["ct-fp8-tensor"], source_cache)
    fp8_hop = _eval(exports["ct-fp8-tensor"], source_cache, inputs="hopper")
    assert fp8_hop["export_bits_per_byte"] == fp8["export_bits_per_byte"]
    assert fp8_hop["scheme"]["input_quantization"] == fp8["scheme"]["input_quantization"]


def test_unquantized_weights_give_the_inputs_alone(exports, source_cache):
    """``--weights unquantized``: the source's weights under the export's input quantization.
    With the inputs unquantized too it is the source itself (the same bits per byte, KL 0);
    alone it costs less than W4A4 and more than nothing, and layer-by-layer gives it too."""
    w4a4 = _eval(exports["ct-nvfp4"], source_cache)
    a4 = _eval(exports["ct-nvfp4"], source_cache, weights="unquantized")
    assert a4["options"]["weights"] == "unquantized"
    assert a4["scheme"]["input_quantization"] == w4a4["scheme"]["input_quantization"]
    src = a4["source_bits_per_byte"]
    assert src < a4["export_bits_per_byte"] < w4a4["export_bits_per_byte"]
    assert 0 < a4["kl_mean"] < w4a4["kl_mean"]
    none = _eval(exports["ct-nvfp4"], source_cache, weights="unquantized", inputs="unquantized")
    # the emulated linears multiply in float32 where the source's run in BF16: not bit for bit
    assert abs(none["export_bits_per_byte"] - src) < 0.1 * (a4["export_bits_per_byte"] - src)
    assert none["kl_mean"] < 0.1 * a4["kl_mean"]
    layered = _eval(exports["ct-nvfp4"], None, weights="unquantized", offload="layer")
    assert abs(layered["export_bits_per_byte"] / a4["export_bits_per_byte"] - 1) < 1e-4


def _broken(exports: dict, how: str) -> Path:
    dst = exports["_tmp"] / f"broken-{how}"
    if dst.exists():
        return dst
    shutil.copytree(exports["ct-fp8-tensor"], dst)
    f = dst / "model-00001-of-00001.safetensors"
    t = load_file(str(f))
    g = torch.Generator().manual_seed(0)
    for k in list(t):
        if how == "scales" and k.endswith(".weight_scale"):
            t[k] = t[k] * 4
        if how == "shuffled" and t[k].dtype == torch.float8_e4m3fn:
            flat = t[k].view(torch.uint8).reshape(-1)
            perm = torch.randperm(flat.numel(), generator=g)
            t[k] = flat[perm].reshape(t[k].shape).view(torch.float8_e4m3fn)
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_a_broken_export_is_caught_with_a_clear_figure(exports, source_cache):
    rep = _eval(_broken(exports, "shuffled"), source_cache, windows=2)
    assert rep["export_bits_per_byte"] > 1.5 * rep["source_bits_per_byte"]
    assert rep["top1_agreement"] < 0.7
    assert any("above the source" in w for w in rep["warnings"])


def test_cli_reports_warns_and_fails_above_a_threshold(exports, tmp_path):
    out = tmp_path / "eval.json"
    bad = _broken(exports, "scales")
    args = ["eval", str(bad), "--source", str(MODEL), "--data", str(HELDOUT), "--windows", "2"]
    r = run_qckpt(*args, "--json", str(out), "--fail-above", "10")
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("source  ") and lines[1].startswith("export  ")
    assert "warning: the export's bits per byte are" in r.stderr
    rep = json.loads(out.read_text())
    assert rep["relative_increase"] > 0.10 and rep["data"]["windows"] == 2
    assert "phases" in rep and "peaks" in rep


def test_cli_from_a_recipe(exports):
    recipe = exports["_tmp"] / "ct-fp8-channel.yaml"
    r = run_qckpt("eval", str(recipe))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KL(source || export)" in r.stdout and "top-1 agreement" in r.stdout


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["/nonexistent/export"], 2, "not found"),
        (["{model}"], 2, "needs --source MODEL_DIR and --data FILE"),
        (["{model}", "--source", "{model}", "--data", "{data}"], 1, "not a quantized export"),
        (["{model}", "--source", "{model}", "--data", "/nope.bin"], 2, "--data: /nope.bin"),
        (["{model}", "--source", "{model}", "--data", "{data}", "--client", "x"], 2, "--client"),
        (["{model}", "--source", "{model}", "--data", "{data}", "--inputs", "x"], 2, "--inputs"),
        (
            ["{model}", "--source", "{model}", "--data", "{data}", "--client", "vllm"]
            + ["--inputs", "unquantized"],
            2,
            "--inputs unquantized: the qckpt client's",
        ),
        (
            ["{model}", "--source", "{model}", "--data", "{data}", "--client", "vllm"]
            + ["--weights", "unquantized"],
            2,
            "--weights unquantized: the qckpt client's",
        ),
        (["{model}", "--source", "{model}", "--data", "{data}", "--weights", "x"], 2, "--weights"),
    ],
    ids=[
        "missing",
        "no-source",
        "not-an-export",
        "no-data",
        "bad-client",
        "bad-inputs",
        "vllm",
        "vllm-weights",
        "bad-weights",
    ],
)
def test_cli_refusals_are_one_line(args, code, says):
    fill = {"model": str(MODEL), "data": str(HELDOUT)}
    r = run_qckpt("eval", *[a.format(**fill) for a in args])
    assert r.returncode == code, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("qckpt: error: ") and says in err[0], r.stderr


def test_layer_by_layer_gives_the_resident_figures_on_nvfp4(exports):
    from qckpt import EvalOptions, evaluate_export

    kw = {"windows": 2, "batch_size": 1}
    a = evaluate_export(exports["ct-nvfp4"], MODEL, HELDOUT, EvalOptions(**kw))
    b = evaluate_export(exports["ct-nvfp4"], MODEL, HELDOUT, EvalOptions(**kw, offload="layer"))
    for k in ("source_bits_per_byte", "export_bits_per_byte", "kl_mean", "layers"):
        assert a[k] == b[k], k


def test_cli_recipe_refusals(tmp_path):
    base = f"model: {{source: {MODEL}}}\ncheckpoint: {{path: {MODEL}}}\n"
    cases = {
        "no eval.path": (base, "eval.path: required by qckpt eval"),
        "a DCP checkpoint": (
            f"model: {{source: tiny-dense}}\ncheckpoint: {{path: {tmp_path}}}\n"
            f"eval: {{path: {HELDOUT}}}\n",
            "is not an HF safetensors dir",
        ),
        "held-out = calibration": (
            base + f"calibrate: {{data: {{source: text, path: {HELDOUT}}}}}\n"
            f"eval: {{path: {HELDOUT}}}\n",
            "eval.path: is the calibration file",
        ),
    }
    for name, (text, says) in cases.items():
        recipe = tmp_path / "r.yaml"
        recipe.write_text(text)
        r = run_qckpt("eval", str(recipe))
        assert r.returncode == 2, (name, r.stderr)
        assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
