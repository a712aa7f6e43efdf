"""export_checkpoint: layouts read back by an independent reader, sharding, sources, refusals.

The ModelOpt reader here is written from the documented key names only (REFERENCES.md):
safetensors via ``safe_open``, E2M1 decoded from a table, the even column in the low nibble.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qckpt.calib.state_file import load_calibration, save_calibration
from qckpt.errors import ExportError, SchemeError
from qckpt.export.writer import export_checkpoint
from qckpt.models.fused import fused_parts
from qckpt.outputs import EXPORT_MARKER
from qckpt.read.sources import SafetensorsSource
from qckpt.recipe import ExportConfig
from tests.export_fixtures import (
    hf_state,
    make_calibration,
    quant_config,
    run_export,
    saved_model,
    write_calibration,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def moe(root):
    return saved_model(root, "tiny-moe")


@pytest.fixture(scope="module")
def dense(root):
    return saved_model(root, "tiny-dense")


def read_export(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """All tensors of an export through its index, and each shard's header metadata."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    metas: dict[str, dict] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / shard), "pt") as f:
            metas[shard] = f.metadata()
            for k in f.keys():
                assert k not in tensors
                tensors[k] = f.get_tensor(k)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    return tensors, metas


# -- ModelOpt, read back independently ---------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def decode_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1).long()
    vals = E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    s = scale.float() * scale_2.float()
    return vals * s.repeat_interleave(16, dim=1)


def test_modelopt_fp8_reads_back_within_fp8_bound(root, moe):
    model, hf_dir = moe
    q = quant_config("tensor", "static")
    cal = make_calibration(model, q)
    out = root / "mo-fp8"
    # per_expert: every scale is its own module's calibrated amax / 448 (shared: tests elsewhere)
    run_export(
        model, hf_dir, cal, out, q, fmt="modelopt", source_dir=hf_dir, moe_scales="per_expert"
    )
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "FP8"
    assert hq["producer"]["name"] == "qckpt"
    assert "lm_head" in hq["quantization"]["exclude_modules"]
    assert "model.layers.0.mlp.gate" in hq["quantization"]["exclude_modules"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    tensors, metas = read_export(out)
    assert {m["qckpt_layout"] for m in metas.values()} == {"modelopt"}
    assert {m["quant_format"] for m in metas.values()} == {"FP8"}
    n_linear = 0
    for name, w in hf_state(model).items():
        module = name.rpartition(".")[0]
        if f"{module}.weight_scale" not in tensors:
            assert torch.equal(tensors[name], w), name  # embeddings, norms, router, lm_head
            continue
        n_linear += 1
        qw, ws, inp = (
            tensors[name],
            tensors[f"{module}.weight_scale"],
            tensors[f"{module}.input_scale"],
        )
        assert qw.dtype == torch.float8_e4m3fn and qw.shape == w.shape
        assert (
            ws.dtype == torch.float32
            and ws.shape == ()
            and inp.dtype == torch.float32
            and inp.shape == ()
        )
        assert ws.item() == pytest.approx(cal.amax[f"{module}.weight_amax"].item() / 448, rel=1e-6)
        assert inp.item() == pytest.approx(cal.amax[f"{module}.input_amax"].item() / 448, rel=1e-6)
        deq = qw.float() * ws
        ref = w.float()
        # E4M3: 3 mantissa bits -> half an ulp is 2^-4 relative; subnormals step 2^-9 * scale
        bound = torch.maximum(ref.abs() * 2**-4, ws * 2**-9) + 1e-7
        assert ((deq - ref).abs() <= bound).all(), name
    assert n_linear == 8 + 2 * 8 * 3


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_modelopt_nvfp4_reads_back_within_fp4_bound(root, request, which):
    model, hf_dir = request.getfixturevalue(which)
    q = quant_config("tensor", "static", fmt="nvfp4")
    cal = make_calibration(model, q)
    out = root / f"mo-nvfp4-{which}"
    run_export(model, hf_dir, cal, out, q, fmt="modelopt", moe_scales="per_expert")
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and hq["group_size"] == 16
    tensors, _ = read_export(out)
    # vLLM fuses q/k/v and gate/up into one weight with one global scale: the group's largest
    quantized = [k.rpartition(".")[0] for k in tensors if k.endswith(".weight_scale_2")]
    group_of = {m: g for g in fused_parts(quantized) for m in g}
    rels = []
    for name, w in hf_state(model).items():
        module = name.rpartition(".")[0]
        if f"{module}.weight_scale_2" not in tensors:
            assert torch.equal(tensors[name], w), name
            continue
        packed, sc, sc2 = (
            tensors[f"{module}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")
        )
        inp = tensors[f"{module}.input_scale"]
        rows, cols = w.shape
        assert packed.dtype == torch.uint8 and packed.shape == (rows, cols // 2)
        assert sc.dtype == torch.float8_e4m3fn and sc.shape == (rows, cols // 16)
        assert sc2.dtype == torch.float32 and sc2.shape == () and inp.shape == ()
        top = max(cal.amax[f"{m}.weight_amax"].item() for m in group_of.get(module, [module]))
        assert sc2.item() == pytest.approx(top / (6 * 448), rel=1e-6)
        assert inp.item() == pytest.approx(
            cal.amax[f"{module}.input_amax"].item() / (6 * 448), rel=1e-6
        )
        deq = decode_nvfp4(packed, sc, sc2)
        ref = w.float()
        s = (sc.float() * sc2).repeat_interleave(16, dim=1)
        # half the E2M1 spacing at the value's magnitude: 0.25 below 2, 0.5 below 4, 1 up to 6
        mag = ref.abs() / s.clamp_min(1e-30)
        half = torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))
        assert ((deq - ref).abs() <= half * s + 1e-6).all(), name
        rels.append(((deq - ref).norm() / ref.norm()).item())
    assert len(rels) == (14 if which == "dense" else 8 + 48)
    assert max(rels) < 0.15  # NVFP4 on Gaussian-like weights: ~0.09 relative RMS error


# -- compressed-tensors config and layout -------------------------------------------------------


@pytest.mark.parametrize(
    "weights,inputs,strategy_in",
    [("tensor", "static", "tensor"), ("channel", "token", "token"), ("block", "group", "group")],
)
def test_compressed_tensors_config_parses_and_scales_have_its_shapes(
    root, dense, weights, inputs, strategy_in
):
    from compressed_tensors.quantization import QuantizationConfig

    model, hf_dir = dense
    q = quant_config(weights, inputs, (32, 32), group=32)
    cal = make_calibration(model, q)
    out = root / f"ct-{weights}"
    run_export(model, hf_dir, cal, out, q, source_dir=hf_dir)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.quant_method == "compressed-tensors" and parsed.format == "float-quantized"
    assert parsed.quantization_status == "compressed"
    assert parsed.ignore == ["lm_head"]
    g = parsed.config_groups["group_0"]
    assert g.targets == ["Linear"]
    assert g.weights.strategy == weights and g.input_activations.strategy == strategy_in
    assert g.input_activations.dynamic is (inputs != "static")
    tensors, metas = read_export(out)
    assert {m["quant_format"] for m in metas.values()} == {"float-quantized"}
    w = hf_state(model)["model.layers.0.mlp.down_proj.weight"]  # [64, 128]
    ws = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert ws.dtype == torch.bfloat16
    assert tuple(ws.shape) == {"tensor": (1,), "channel": (64, 1), "block": (2, 4)}[weights]
    assert ("model.layers.0.mlp.down_proj.input_scale" in tensors) is (inputs == "static")
    # dequantize as compressed-tensors does (scale broadcast per block) and bound the error
    qw = tensors["model.layers.0.mlp.down_proj.weight"].float()
    s = ws.float()
    if weights == "block":
        s = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    err = (qw * s - w.float()).abs()
    assert (err <= w.float().abs() * 2**-4 + s * 2**-9 + 1e-7).all()
    # the carried-over files
    assert (out / "generation_config.json").read_text() == (
        hf_dir / "generation_config.json"
    ).read_text()


def test_compressed_tensors_refuses_nvfp4_dynamic_inputs_and_block_static_inputs(root, dense):
    # nvfp4 with static nvfp4 inputs is written (nvfp4-pack-quantized, test_ct_nvfp4_export);
    # with dynamic inputs there is no input global scale to write
    model, hf_dir = dense
    for q in (quant_config(fmt="nvfp4", inputs="token"), quant_config("block", "group", (32, 32))):
        if q.inputs.granularity == "block":
            q.inputs.dynamic = False
        # a recipe the layout cannot write: a usage error (exit 2), in one line
        with pytest.raises(SchemeError, match="compressed-tensors") as exc:
            run_export(model, hf_dir, make_calibration(model, q), root / "never", q)
        assert "\n" not in str(exc.value)
    assert not (root / "never").exists()


# -- sharding, sources ----------------------------------------------------------------------------


def test_shards_index_and_dcp_source_give_the_same_tensors(root, moe):
    import torch.distributed.checkpoint as dcp

    model, hf_dir = moe
    q = quant_config("channel", "token")
    cal = write_calibration(root, model, q, "calib-channel.safetensors")
    one = root / "one-shard"
    rep1 = run_export(model, hf_dir, cal, one, q)
    assert rep1.shards == 1
    many = root / "many-shards"
    rep = run_export(model, hf_dir, cal, many, q, max_shard_size="64KB")
    assert rep.shards > 3 and rep.tensors_written == rep1.tensors_written
    t1, _ = read_export(one)
    tn, metas = read_export(many)
    assert len(metas) == rep.shards
    for shard in metas:  # each shard within the limit (one group never straddles two)
        assert (many / shard).stat().st_size <= 64_000 + 16_384
    assert set(t1) == set(tn) and all(torch.equal(t1[k], tn[k]) for k in t1)
    # a weight and its scales land in the same shard
    wm = json.loads((many / "model.safetensors.index.json").read_text())["weight_map"]
    for k in wm:
        if k.endswith(".weight_scale"):
            assert wm[k] == wm[k.replace("weight_scale", "weight")]
    # the same model saved as DCP (fused experts in the state dict) exports to the same bytes
    dcp_dir = root / "dcp"
    if not dcp_dir.exists():
        dcp.save(model.state_dict(), checkpoint_id=str(dcp_dir), no_dist=True)
    from_dcp = root / "from-dcp"
    rep_dcp = run_export(model, dcp_dir, cal, from_dcp, q)
    assert rep_dcp.source_format == "dcp" and rep_dcp.source_tensors == len(model.state_dict())
    td, _ = read_export(from_dcp)
    assert set(td) == set(t1) and all(torch.equal(t1[k], td[k]) for k in t1)


def test_each_stored_tensor_is_read_once_in_file_order(root, moe, monkeypatch):
    model, hf_dir = moe
    q = quant_config("tensor", "static")
    cal = make_calibration(model, q)
    reads: list[str] = []
    real = SafetensorsSource.read

    def counting(self, entry):
        reads.append(entry.name)
        return real(self, entry)

    real_span = SafetensorsSource.read_span

    def counting_span(self, entries, pinned=False):  # a run of adjacent tensors, one read
        reads.extend(e.name for e in entries)
        return real_span(self, entries, pinned)

    monkeypatch.setattr(SafetensorsSource, "read", counting)
    monkeypatch.setattr(SafetensorsSource, "read_span", counting_span)
    seen: list[tuple[int, int]] = []
    export_checkpoint(
        source=hf_dir,
        calibration=cal,
        output=root / "count",
        model_type="qwen3_moe",
        model_config=model.config,
        quant=q,
        export=ExportConfig(),
        progress=lambda i, n, name: seen.append((i, n)),
    )
    stored = SafetensorsSource(hf_dir).entries()
    assert reads == [e.name for e in stored]
    assert seen[-1] == (len(stored), len(stored))


# -- KV-cache scales ------------------------------------------------------------------------------


def test_kv_cache_scales_from_kv_proj_output_amax(root, dense):
    model, hf_dir = dense
    q = quant_config("tensor", "static", kv=True)
    cal = make_calibration(model, q)
    out = root / "kv"
    run_export(model, hf_dir, cal, out, q)
    tensors, _ = read_export(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (
        qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    )
    for layer in range(2):
        a = f"model.layers.{layer}.self_attn"
        for kv in ("k", "v"):
            want = cal.amax[f"{a}.{kv}_proj.output_amax"].item() / 448
            assert tensors[f"{a}.{kv}_scale"].float().item() == pytest.approx(want, rel=2**-7)
    mo = root / "kv-mo"
    run_export(model, hf_dir, cal, mo, q, fmt="modelopt")
    tm, _ = read_export(mo)
    assert (
        json.loads((mo / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"]
        == "FP8"
    )
    assert tm["model.layers.1.self_attn.v_proj.v_scale"].item() == pytest.approx(
        cal.amax["model.layers.1.self_attn.v_proj.output_amax"].item() / 448, rel=1e-6
    )
    # without the k/v output amax the export refuses instead of writing a made-up scale
    del cal.amax["model.layers.1.self_attn.k_proj.output_amax"]
    with pytest.raises(ExportError, match="k_proj.output_amax"):
        run_export(model, hf_dir, cal, root / "kv-missing", q)
    assert not (root / "kv-missing").exists()


# -- refusals: target, calibration ----------------------------------------------------------------


def _no_temp_dirs(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".qckpt-tmp-" in p.name]


def test_existing_target_refused_unless_overwrite(root, dense):
    model, hf_dir = dense
    q = quant_config()
    cal = make_calibration(model, q)
    out = root / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        run_export(model, hf_dir, cal, out, q)
    # overwrite replaces only an export qckpt wrote (it holds the marker); this dir is not one
    with pytest.raises(ExportError, match="not written by qckpt export"):
        run_export(model, hf_dir, cal, out, q, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine" and _no_temp_dirs(root)
    first = root / "replaced"
    run_export(model, hf_dir, cal, first, q)
    assert (first / EXPORT_MARKER).is_file()
    (first / "stale.txt").write_text("from the first export")
    rep = run_export(model, hf_dir, cal, first, q, overwrite=True)
    assert not (first / "stale.txt").exists() and (first / "config.json").is_file()
    assert rep.tensors_written > 0 and _no_temp_dirs(root)
    # through a symlink: the link stays, the export it points to is replaced, nothing left over
    link = root / "latest"
    link.symlink_to(first)
    run_export(model, hf_dir, cal, link, q, overwrite=True)
    assert link.is_symlink() and (first / EXPORT_MARKER).is_file()
    assert _no_temp_dirs(root) and not [p for p in root.iterdir() if ".qckpt-old-" in p.name]


def test_calibration_of_another_model_or_format_is_one_line_error(root, moe, dense):
    model, hf_dir = moe
    q = quant_config("tensor", "static")
    cases = []
    other = make_calibration(dense[0], q)  # another model_type
    cases.append((other, "llama"))
    same_type = make_calibration(model, q)
    same_type.model_fingerprint = "0123456789abcdef"  # same type, other shapes
    cases.append((same_type, "fingerprint"))
    cases.append((make_calibration(model, quant_config("channel", "token")), "granularity"))
    missing = make_calibration(model, q)
    del missing.amax["model.layers.1.mlp.experts.5.down_proj.input_amax"]
    cases.append((missing, "experts.5.down_proj.input_amax"))
    bad_shape = make_calibration(model, q)
    bad_shape.amax["model.layers.0.self_attn.q_proj.weight_amax"] = torch.ones(64)
    cases.append((bad_shape, "q_proj.weight_amax"))
    out = root / "never-written"
    for i, (cal, needle) in enumerate(cases):
        path = save_calibration(cal, root / f"bad-{i}.safetensors")
        with pytest.raises(ExportError, match=needle) as exc:
            run_export(model, hf_dir, path, out, q)
        assert "\n" not in str(exc.value)
        assert not out.exists() and _no_temp_dirs(root)
    with pytest.raises(ExportError, match="not found"):
        run_export(model, hf_dir, root / "nope.safetensors", out, q)
    assert load_calibration(root / "bad-0.safetensors").model_type == "llama"


# -- interrupted exports --------------------------------------------------------------------------


def _child(hf_dir: str, cal: str, out: str, marker: str) -> None:
    import faulthandler

    from qckpt.models.build import load_config

    # a child that does not end on the signal prints where each thread stands when asked
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C as at a terminal: a runner started with `&` from a script passes SIGINT down as
    # ignored (POSIX), and Python then installs no handler, so the interrupt would never come
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def pause(done: int, total: int, name: str) -> None:
        # mid-write, deterministically: say so, then wait for the test's signal
        if done == 5:
            Path(marker).touch()
            while True:
                time.sleep(0.05)

    export_checkpoint(
        source=hf_dir,
        calibration=cal,
        output=out,
        model_type="llama",
        model_config=load_config("tiny-dense"),
        quant=quant_config(),
        export=ExportConfig(max_shard_size="32KB"),
        progress=pause,
    )


def _start_and_pause(hf_dir: Path, cal: Path, out: Path, marker: Path):
    # spawn, not fork: a child forked from this process (after many tests have run torch's
    # thread pools) once hung on the signal in a full CI run; a fresh interpreter costs a few
    # seconds of imports. Its progress callback stops it mid-write
    import multiprocessing as mp

    args = (str(hf_dir), str(cal), str(out), str(marker))
    proc = mp.get_context("spawn").Process(target=_child, args=args)
    proc.start()
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.is_alive(), f"export child exited early ({proc.exitcode})"
        assert time.monotonic() < deadline, "export never reached the pause"
        time.sleep(0.02)
    return proc


def test_interrupted_export_leaves_no_target(root, dense):
    model, hf_dir = dense
    cal = write_calibration(root, model, quant_config(), "calib-int.safetensors")
    out = root / "interrupted"
    for sig in (signal.SIGINT, signal.SIGKILL):
        marker = root / f"paused-{sig.name}"
        proc = _start_and_pause(hf_dir, cal, out, marker)
        temps = [p for p in root.iterdir() if p.name.startswith(".interrupted.qckpt-tmp-")]
        assert len(temps) == 1 and any(temps[0].glob("*.safetensors"))  # mid-write, for real
        os.kill(proc.pid, sig)
        proc.join(timeout=60)
        if proc.exitcode is None:  # hung: its threads' stacks to stderr, then fail
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            proc.join(timeout=10)
            pytest.fail(f"the export did not end within 60 s of {sig.name} (stacks above)")
        assert proc.exitcode != 0
        assert not out.exists()
        left = [p for p in root.iterdir() if p.name.startswith(".interrupted.qckpt-tmp-")]
        if sig == signal.SIGINT:
            assert left == []  # the interrupt removed its temp dir
        else:
            assert len(left) == 1  # a SIGKILL cannot clean up: hidden name, not the target
    # the next export to that target removes the dead process's temp dir and completes
    rep = run_export(model, hf_dir, cal, out, quant_config())
    assert out.is_dir() and rep.shards >= 1
    assert not [p for p in root.iterdir() if p.name.startswith(".interrupted.qckpt-tmp-")]
    assert math.isfinite(rep.gbps) and rep.peak_rss_bytes > 0


def test_scales_are_the_correctly_rounded_quotient_on_any_device():
    """Export scales are ``amax / 448`` (and ``/ 2688``) rounded once, as CPU torch divides;
    CUDA torch would multiply by a rounded reciprocal instead, which differs in the last bit
    for many values: the helper must not."""
    from qckpt.layouts.export_layout import amax_over

    a = torch.rand(1 << 18, generator=torch.Generator().manual_seed(0)) * 1000
    for qmax in (448.0, 2688.0):
        got = amax_over(a, qmax)
        assert torch.equal(got.view(torch.int32), (a / qmax).view(torch.int32))
        exact = (a.double() / qmax).float()
        assert torch.equal(got, exact)
        recip = a * torch.tensor(1 / qmax, dtype=torch.float32)
        assert (recip != got).sum() > 1000  # the reciprocal multiply is not the same number


# -- plan, then write -----------------------------------------------------------------------------


def test_plan_writes_nothing_and_the_writer_executes_it(tmp_path, dense):
    """plan_export decides everything from metadata alone; write_export of that plan gives the
    same files as export_checkpoint, and a refusal found while planning leaves no trace."""
    from qckpt.export.plan import plan_export
    from qckpt.export.writer import write_export

    model, hf_dir = dense
    q = quant_config("channel")
    cal = write_calibration(tmp_path, model, q)
    before = sorted(p.name for p in tmp_path.iterdir())
    kw = dict(
        source=hf_dir,
        calibration=cal,
        model_type=model.config.model_type,
        model_config=model.config,
        quant=q,
    )
    out = tmp_path / "planned"
    plan = plan_export(output=out, export=ExportConfig(format="compressed-tensors"), **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # not a byte yet
    assert plan.quantized_linears == 14 and len(plan.shards.files) >= 1
    assert plan.config["quantization_config"]["quant_method"] == "compressed-tensors"
    rep = write_export(plan)
    ref = tmp_path / "direct"
    run_export(model, hf_dir, cal, ref, q)
    got, want = read_export(out)[0], read_export(ref)[0]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert rep.files == sorted(p.name for p in ref.iterdir())

    other = quant_config("tensor")  # the calibration file was made for channel weights
    with pytest.raises(ExportError, match="granularity=channel"):
        plan_export(output=tmp_path / "refused", export=ExportConfig(), **{**kw, "quant": other})
    assert not (tmp_path / "refused").exists() and _no_temp_dirs(tmp_path)
