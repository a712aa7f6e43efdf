"""Export on the GPU: byte-identical files to the CPU export for every layout; skipped without CUDA.

The tiny models of tests/dist/test_export_dist.py (every export layout, an HF and a DCP source,
KV scales), and one larger dense layer set so that the quantize kernels run over several row
chunks and the GPU's Triton/compiled paths take real sizes:

    pytest -q tests/gpu/test_export_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHARD = "24KB"


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _export(case, src, cal, out, device, shard=SHARD, config=None):
    from qckpt.export.writer import WriteOptions, export_checkpoint
    from qckpt.models.build import load_config
    from qckpt.recipe import ExportConfig
    from tests.export_fixtures import quant_config

    fmt, qkw, model, _ = case
    cfg = config if config is not None else load_config(model)
    return export_checkpoint(
        source=src,
        calibration=cal,
        output=out,
        model_type=cfg.model_type,
        model_config=cfg,
        quant=quant_config(**qkw),
        export=ExportConfig(format=fmt, output=str(out), max_shard_size=shard),
        options=WriteOptions(device=device),
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("export_gpu")


def test_gpu_export_equals_cpu_export_for_every_layout(root):
    import torch.distributed.checkpoint as dcp

    from tests.dist.test_export_dist import CASES
    from tests.export_fixtures import quant_config, saved_model, write_calibration

    models = {m: saved_model(root, m) for m in ("tiny-dense", "tiny-moe")}
    dcp_dir = root / "tiny-moe-dcp"
    dcp.save(models["tiny-moe"][0].state_dict(), checkpoint_id=str(dcp_dir), no_dist=True)
    for name, case in CASES.items():
        model, hf_dir = models[case[2]]
        cal = write_calibration(root, model, quant_config(**case[1]), f"cal-{name}.safetensors")
        src = dcp_dir if case[3] == "dcp" else hf_dir
        cpu = _export(case, src, cal, root / f"{name}-cpu", "cpu")
        gpu = _export(case, src, cal, root / f"{name}-gpu", "cuda")
        assert cpu.device == "cpu" and gpu.device.startswith("cuda")
        one, other = _tree(root / f"{name}-cpu"), _tree(root / f"{name}-gpu")
        assert sorted(one) == sorted(other), name
        for f in one:
            assert one[f] == other[f], (name, f)


def _big_dense(root: Path):
    """A 2-layer Llama with 4096 x 4096 and 11008 x 4096 weights (several row chunks each)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # a few outliers, so that the scales are not all alike
        for p in model.parameters():
            p.view(-1)[::4099].mul_(40)
    d = root / "big-dense"
    model.save_pretrained(d)
    return model.cpu(), d, cfg


@pytest.mark.parametrize(
    "case",
    [
        ("compressed-tensors", {}, None, "hf"),
        ("compressed-tensors", {"weights": "block", "inputs": "group"}, None, "hf"),
        ("compressed-tensors", {"fmt": "nvfp4"}, None, "hf"),
        ("modelopt", {}, None, "hf"),
        ("modelopt", {"weights": "channel", "inputs": "token"}, None, "hf"),
        ("modelopt", {"fmt": "nvfp4"}, None, "hf"),
    ],
    ids=["ct-tensor", "ct-block", "ct-nvfp4", "mo-fp8", "mo-pcpt", "mo-nvfp4"],
)
def test_gpu_export_of_real_sizes_equals_cpu(root, case):
    from tests.export_fixtures import quant_config, write_calibration

    if not (root / "big-dense").exists():
        _big_dense(root)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(root / "big-dense")
    model = AutoModelForCausalLM.from_pretrained(root / "big-dense", dtype=torch.bfloat16)
    tag = "-".join(map(str, [case[0], *case[1].values()]))
    cal = write_calibration(root, model, quant_config(**case[1]), f"cal-big-{tag}.safetensors")
    src = root / "big-dense"
    _export(case, src, cal, root / f"big-{tag}-cpu", "cpu", "200MB", cfg)
    _export(case, src, cal, root / f"big-{tag}-gpu", "cuda", "200MB", cfg)
    one, other = _tree(root / f"big-{tag}-cpu"), _tree(root / f"big-{tag}-gpu")
    assert sorted(one) == sorted(other)
    for f in one:
        assert one[f] == other[f], f


def _moe_export_counting_waits(root: Path, src: Path, cal, out: Path):
    """A GPU export of the tiny MoE with CUDA's sync debug mode on: (the waits for the device
    made by the quantize threads, the items of each quantize job on the device, the waits seen
    from a control thread that makes one)."""
    import threading
    import warnings

    from qckpt.export.stages import Pipeline

    case = ("compressed-tensors", {}, "tiny-moe", "hf")
    waits: list[str] = []
    jobs: list[int] = []
    real, real_run = Pipeline._process, Pipeline._process_run

    def process(self, batch):
        if self._on_device(batch[0][0]):  # the others (norms, KV scales) stay on the host
            jobs.append(len(batch))
        return real(self, batch)

    def process_run(self, run, fut):  # a run of adjacent experts: one job
        jobs.append(len(run.items))
        return real_run(self, run, fut)

    def show(message, *a, **k):
        if threading.current_thread().name.startswith("qckpt-quantize"):
            if "synchronizing" in str(message):
                waits.append(str(message))

    Pipeline._process = process
    Pipeline._process_run = process_run
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            _export(case, src, cal, out, "cuda")
            seen = len(waits)
            # the control: a wait made on a thread so named is counted (else the count above
            # could be 0 because nothing reached showwarning)
            t = threading.Thread(
                target=lambda: torch.ones(1, device="cuda").sum().item(),
                name="qckpt-quantize-control",
            )
            t.start()
            t.join()
            control = len(waits) - seen
    finally:
        torch.cuda.set_sync_debug_mode(0)
        Pipeline._process = real
        Pipeline._process_run = real_run
    return waits[:seen], jobs, control


def test_gpu_export_waits_for_the_device_once_per_quantize_job(root):
    """The per-tensor waits (the source-weight guard's host reads, a blocking copy per output)
    were most of a small tensor's time: a quantize job (one or several consecutive items)
    now waits once, for all its outputs and guard verdicts together."""
    from tests.export_fixtures import quant_config, saved_model, write_calibration

    model, hf_dir = saved_model(root, "tiny-moe")
    cal = write_calibration(root, model, quant_config(), "cal-waits.safetensors")
    waits, jobs, control = _moe_export_counting_waits(root, hf_dir, cal, root / "waits-gpu")
    assert control >= 1  # a wait on such a thread is seen
    assert jobs and len(waits) <= len(jobs), (len(waits), len(jobs), waits[:3])
    assert max(jobs) > 8  # the experts of a layer went as runs (the bulk path)
    print(f"{sum(jobs)} items in {len(jobs)} jobs, {len(waits)} waits")


def test_gpu_export_refuses_a_bad_weight_with_the_cpu_exports_message(root):
    from safetensors.torch import load_file, save_file

    from qckpt.errors import ExportError
    from tests.export_fixtures import quant_config, saved_model, write_calibration

    model, hf_dir = saved_model(root, "tiny-moe")
    cal = write_calibration(root, model, quant_config(), "cal-refuse.safetensors")
    bad = root / "tiny-moe-bad"
    bad.mkdir(exist_ok=True)
    for p in hf_dir.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    files = sorted(bad.glob("*.safetensors"))
    sd = load_file(str(files[0]))
    name = next(n for n in sd if n.endswith("experts.1.down_proj.weight"))
    sd[name][2].mul_(5.0)
    sd[name][0, 0] = float("nan")
    save_file(sd, str(files[0]), metadata={"format": "pt"})
    case = ("compressed-tensors", {}, "tiny-moe", "hf")
    msgs = []
    for device in ("cpu", "cuda"):
        with pytest.raises(ExportError) as e:
            _export(case, bad, cal, root / f"refused-{device}", device)
        msgs.append(str(e.value))
        assert not (root / f"refused-{device}").exists()
    assert msgs[0] == msgs[1]
    assert msgs[1] == (
        f"{name[: -len('.weight')]}.weight: not finite (NaN or Inf in row 0) in the checkpoint; "
        "refusing to quantize it"
    )


def _moe(root: Path, experts: int, inter: int, hidden: int, name: str):
    """A 2-layer Qwen3-MoE saved per expert (each expert's down, gate and up by turns)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * inter,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[::997].mul_(30)
    d = root / name
    model.save_pretrained(d)
    return model, d, cfg


@pytest.fixture(scope="module")
def moe64(root):
    """The 64-expert MoE (saved once) and its calibrations, made once per quant config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.export_fixtures import make_calibration, quant_config

    if not (root / "moe-64").exists():
        _moe(root, 64, 384, 1024, "moe-64")
    cfg = AutoConfig.from_pretrained(root / "moe-64")
    model = AutoModelForCausalLM.from_pretrained(root / "moe-64", dtype=torch.bfloat16)
    cals: dict = {}

    def cal(qkw: dict):
        key = tuple(sorted(qkw.items()))
        if key not in cals:
            cals[key] = make_calibration(model, quant_config(**qkw))
        return cals[key]

    return root / "moe-64", cfg, cal


@pytest.mark.parametrize(
    "case",
    [
        ("compressed-tensors", {}, None, "hf"),
        ("compressed-tensors", {"weights": "channel", "inputs": "token"}, None, "hf"),
        ("modelopt", {"weights": "channel", "inputs": "token"}, None, "hf"),
    ],
    ids=["ct-tensor", "ct-channel", "mo-pcpt"],
)
def test_gpu_bulk_runs_of_experts_equal_the_cpu_and_the_per_item_export(
    root, moe64, case, monkeypatch
):
    """Runs of experts (64 per layer, 384 x 1024, the down/gate/up turns of a MoE file) in one
    read, one copy, one guard and one quantize per stack and one wait, files cut small so that
    a run's writes go to several files: the same bytes as the CPU export and as the GPU export
    one item at a time."""
    from qckpt.export.stages import Pipeline

    src, cfg, make_cal = moe64
    cal = make_cal(case[1])
    tag = "-".join(map(str, [case[0], *case[1].values()]))
    sizes: list[int] = []
    real = Pipeline._process_run

    def process_run(self, run, fut):
        sizes.append(len(run.items))
        return real(self, run, fut)

    monkeypatch.setattr(Pipeline, "_process_run", process_run)
    outs = {}
    for device, bulk in [("cpu", "0"), ("cuda", "1"), ("cuda", "0")]:
        monkeypatch.setenv("QCKPT_EXPORT_BULK", bulk)
        out = root / f"moe-{tag}-{device}-{bulk}"
        rep = _export(case, src, cal, out, device, "20MB", cfg)
        assert (rep.run_sources > 0) == (bulk == "1")
        outs[device, bulk] = _tree(out)
    assert sizes and max(sizes) >= 8  # runs of experts, each of several stacks
    assert len(outs["cuda", "1"]) > 4
    for key in (("cuda", "1"), ("cuda", "0")):
        assert sorted(outs[key]) == sorted(outs["cpu", "0"])
        for f, data in outs["cpu", "0"].items():
            assert outs[key][f] == data, (key, f)


def test_gpu_bulk_run_refuses_the_first_bad_expert_with_the_per_item_message(
    root, moe64, monkeypatch
):
    from safetensors.torch import load_file, save_file

    from qckpt.errors import ExportError

    src, cfg, make_cal = moe64
    cal = make_cal({})
    bad = root / "moe-64-bad"
    bad.mkdir(exist_ok=True)
    for p in src.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    first = "model.layers.1.mlp.experts.3.up_proj.weight"
    second = "model.layers.1.mlp.experts.30.down_proj.weight"
    for f in sorted(bad.glob("*.safetensors")):
        sd = load_file(str(f))
        if first in sd or second in sd:
            if first in sd:
                sd[first][5].mul_(4.0)
            if second in sd:
                sd[second][1, 2] = float("inf")
            save_file(sd, str(f), metadata={"format": "pt"})
    case = ("compressed-tensors", {}, None, "hf")
    msgs = []
    for device, bulk in [("cpu", "0"), ("cuda", "1")]:
        monkeypatch.setenv("QCKPT_EXPORT_BULK", bulk)
        with pytest.raises(ExportError) as e:
            _export(case, bad, cal, root / f"moe-refused-{device}", device, "20MB", cfg)
        msgs.append(str(e.value))
        assert not (root / f"moe-refused-{device}").exists()
    assert msgs[0] == msgs[1] and msgs[1].startswith(f"{first}: amax ")
