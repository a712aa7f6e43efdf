"""Megatron-Core and torchtitan checkpoints as sources.

Real fixtures (tests/fixtures/megatron, tests/fixtures/torchtitan: written by megatron-core
0.16.1 and torchtitan 0.3.0 themselves) are checked against the frameworks' own answers:
Megatron's fp32 logits on fixed tokens, torchtitan's ``to_hf``. Generated fixtures
(tests/training_fixtures.py: plain DCP in the same layouts, from a tiny HF model's weights)
cover the variants the real ones do not (per-layer keys, local norm names, the fc1
weight_w/weight_v split and one key per expert (singleton_local_shards), padded vocab, TP and
EP chunks, DeepSeek-V3's MLA and mixed stacks) and the byte-for-byte export and
bit-for-bit load comparisons against the HF form of the same weights.
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qckpt.errors import CheckpointError
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model, load_config
from qckpt.models.quantize_params import quantize_model_params
from qckpt.read.detect import detect_format
from qckpt.read.readers import open_source
from tests._bits import bits
from tests.export_fixtures import hf_state, quant_config, run_export, write_calibration
from tests.training_fixtures import write_megatron, write_torchtitan

FIX = Path(__file__).resolve().parents[1] / "fixtures"
MEGATRON = FIX / "megatron"
TITAN = FIX / "torchtitan"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Per built-in model: its HF dir, and the layouts written from the same weights."""
    root = tmp_path_factory.mktemp("training")
    out = {}
    for src in ("tiny-dense", "tiny-moe"):
        m = build_model(src, dtype="bfloat16", seed=0)
        hf = hf_state(m)
        m.save_pretrained(root / f"{src}-hf")
        d = {"model": m, "hf": hf, "hf_dir": root / f"{src}-hf"}
        d["stacked"] = write_megatron(hf, m.config, root / f"{src}-mc", trap=root / "PWNED")
        d["per_layer"] = write_megatron(
            hf, m.config, root / f"{src}-mc-pl", stacked=False, te=False, glu_split=True,
            trap=root / "PWNED",
        )  # fmt: skip
        d["titan"] = write_torchtitan(hf, m.config, root / f"{src}-tt")
        out[src] = d
    out["root"] = root
    return out


def _entries(src) -> dict[str, torch.Tensor]:
    return {e.name: t for e, t in src.iter_tensors()}


# ---- detection ----------------------------------------------------------------------------------


def test_each_layout_is_detected(made, tmp_path):
    from qckpt.convert.dcp import save_model_dcp

    assert detect_format(MEGATRON / "dense_tp2") == "megatron"
    assert detect_format(TITAN / "qwen3_moe") == "torchtitan"
    assert detect_format(made["tiny-moe"]["titan"]) == "torchtitan"
    save_model_dcp(made["tiny-dense"]["model"], tmp_path / "own")
    assert detect_format(tmp_path / "own") == "dcp"
    # a Megatron save dir: its latest iteration is read
    save = tmp_path / "save"
    shutil.copytree(MEGATRON / "dense_tp1", save / "iter_0000020")
    (save / "latest_checkpointed_iteration.txt").write_text("20\n")
    assert detect_format(save) == "megatron"
    src = open_source(save, "auto", config=load_config(str(MEGATRON / "dense_hf")))
    assert len(src.entries()) == 21


# ---- real fixtures: the frameworks' own answers ------------------------------------------------


@pytest.mark.parametrize("name", ["dense_tp1", "dense_tp2", "moe_tp1", "moe_ep2"])
def test_megatron_fixture_loads_to_megatrons_own_logits(name):
    arch = name.split("_")[0]
    ref = load_file(str(MEGATRON / f"{arch}_reference.safetensors"))
    got = {}
    for reader in ("plain", "fast"):
        m = build_model(str(MEGATRON / f"{arch}_hf"), dtype="bfloat16", seed=7)
        rep = load_checkpoint(m, MEGATRON / name, reader=reader)
        assert rep.format == "megatron"
        got[reader] = {k: v.clone() for k, v in m.state_dict().items()}
        with torch.no_grad():
            logits = m.float()(ref["ids"]).logits
        # Megatron ran the same bf16 values in fp32: only summation order differs
        assert (logits - ref["logits"]).abs().max() < 1e-5, reader
    for k in got["plain"]:
        assert torch.equal(bits(got["plain"][k]), bits(got["fast"][k])), k


@pytest.mark.parametrize("arch,resharded", [("dense", "dense_tp2"), ("moe", "moe_ep2")])
def test_megatron_resharded_fixture_gives_the_one_rank_tensors(arch, resharded):
    cfg = load_config(str(MEGATRON / f"{arch}_hf"))
    one = _entries(open_source(MEGATRON / f"{arch}_tp1", config=cfg))
    two = _entries(open_source(MEGATRON / resharded, config=cfg))
    assert one.keys() == two.keys()
    for k in one:
        assert torch.equal(bits(one[k]), bits(two[k])), k


@pytest.mark.parametrize("arch", ["llama3", "qwen3_moe"])
def test_torchtitan_fixture_equals_torchtitans_own_to_hf(arch, capfd):
    ref = load_file(str(TITAN / f"{arch}_hf.safetensors"))
    src = open_source(TITAN / arch, config=load_config(str(TITAN / f"{arch}_hf")))
    got = _entries(src)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(bits(got[k]), bits(ref[k])), k
    err = capfd.readouterr().err
    if arch == "qwen3_moe":  # torchtitan's expert bias has no Qwen3 HF tensor: named, not read
        assert "stored tensor layers.0.moe.expert_bias_E maps to no HF tensor" in err


# ---- generated variants: bit for bit against the HF weights ------------------------------------


@pytest.mark.parametrize("src", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("kind", ["stacked", "per_layer", "titan"])
def test_generated_layout_reads_the_hf_tensors(made, src, kind):
    d = made[src]
    got = _entries(open_source(d[kind], config=d["model"].config))
    assert got.keys() == d["hf"].keys()
    for k, v in d["hf"].items():
        assert torch.equal(bits(got[k]), bits(v)), k


@pytest.mark.parametrize("fmt", ["none", "fp8", "nvfp4"])
@pytest.mark.parametrize("kind", ["stacked", "per_layer"])
def test_load_equals_the_hf_load_bit_for_bit(made, fmt, kind):
    d = made["tiny-moe"]
    models = []
    for path in (d["hf_dir"], d[kind]):
        m = build_model("tiny-moe", dtype="bfloat16", seed=3)
        quantize_model_params(m, fmt, ignore=["lm_head"])
        rep = load_checkpoint(m, path, reader="fast")
        models.append((m, rep))
    (a, ra), (b, rb) = models
    assert rb.format == "megatron" and rb.inline_items == 0
    # only each destination's bytes are read: the padded vocab rows and the QKV / fc1 pieces
    # of the stored tensors, not whole chunks
    assert rb.bytes_read == ra.bytes_read
    assert rb.transient_bytes <= rb.predicted_transient_bytes
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    for k, v in sa.items():
        fa = v.fields() if hasattr(v, "fields") else {"t": v.detach()}
        fb = sb[k].fields() if hasattr(sb[k], "fields") else {"t": sb[k].detach()}
        for f in fa:
            assert torch.equal(bits(fa[f]), bits(fb[f])), (k, f)


@pytest.mark.parametrize(
    "src,fmt,weights,qfmt",
    [
        ("tiny-moe", "compressed-tensors", "channel", "fp8"),
        ("tiny-moe", "modelopt", "tensor", "nvfp4"),
        ("tiny-dense", "modelopt", "tensor", "fp8"),
    ],
)
def test_export_straight_from_megatron_equals_the_export_from_hf(
    made, tmp_path, src, fmt, weights, qfmt
):
    d = made[src]
    q = quant_config(weights, fmt=qfmt, group=16)
    cal = write_calibration(tmp_path, d["model"], q)
    outs = []
    for i, path in enumerate((d["hf_dir"], d["stacked"])):
        out = tmp_path / f"out{i}"
        run_export(d["model"], path, cal, out, q, fmt=fmt)
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    for n in names:
        assert (outs[0] / n).read_bytes() == (outs[1] / n).read_bytes(), n


# ---- never unpickled: .metadata, common.pt, byte entries ----------------------------------------


def _repickle(md_path: Path, change) -> None:  # noqa: ANN001
    md = pickle.loads(md_path.read_bytes())  # our own file, written by the test
    change(md)
    md_path.write_bytes(pickle.dumps(md))


def test_pickles_in_the_checkpoint_never_run(made, tmp_path):
    root = made["root"]
    d = made["tiny-moe"]
    # common.pt, common_state and _extra_state hold traps: loaded, exported, inspected above
    # and here; nothing ran them
    from qckpt.inspect import inspect_path

    info = inspect_path(d["stacked"], "tiny-moe")
    assert info["mapped_tensors"] == len(d["hf"]) and info["leftover"] == []
    assert not (root / "PWNED").exists()
    # a trap in .metadata itself is refused, naming the file
    bad = tmp_path / "bad"
    shutil.copytree(d["stacked"], bad)
    _repickle(bad / ".metadata", lambda md: setattr(md, "planner_data", _Trap(tmp_path / "X")))
    with pytest.raises(CheckpointError, match=r"\.metadata: unsafe or corrupt DCP metadata"):
        open_source(bad, config=d["model"].config).entries()
    assert not (tmp_path / "X").exists()


class _Trap:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


@contextlib.contextmanager
def _fake_megatron():
    """Stand-in ``megatron.core...strategies.torch`` modules, for the dump only (megatron is
    not installed here): a pickle then names Megatron's classes as the real one does."""
    import types

    mods = ["megatron", "megatron.core", "megatron.core.dist_checkpointing",
            "megatron.core.dist_checkpointing.strategies",
            "megatron.core.dist_checkpointing.strategies.torch"]  # fmt: skip
    saved = {m: sys.modules.get(m) for m in mods}
    for m in mods:
        sys.modules[m] = types.ModuleType(m)

    def cls(name: str) -> type:
        c = type(name, (), {"__module__": mods[-1], "__qualname__": name})
        setattr(sys.modules[mods[-1]], name, c)
        return c

    try:
        yield cls
    finally:
        for m, old in saved.items():
            if old is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = old


def _with_megatron_object(path: Path, name: str, payload: object) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())
    with _fake_megatron() as cls:
        obj = cls(name)()
        obj.payload = payload
        md.mcore_data = {"decoder.layers.x": {"nd_reformulated_orig_global_shape": (2, 3)}}
        md.planner_data = obj
        (path / ".metadata").write_bytes(pickle.dumps(md))


def test_megatrons_own_classes_in_metadata_are_inert_stubs(made, tmp_path):
    from qckpt.storage.dcp_metadata import InertStub, read_metadata_file

    d = made["tiny-dense"]
    ok, bad, other = tmp_path / "ok", tmp_path / "bad", tmp_path / "other"
    for p in (ok, bad, other):
        shutil.copytree(d["stacked"], p)
    _with_megatron_object(ok, "MCoreMetadata", {"nd": (2, 3)})
    md = read_metadata_file(ok / ".metadata")
    assert isinstance(md.planner_data, InertStub) and "megatron" not in sys.modules
    assert len(open_source(ok, config=d["model"].config).entries()) == len(d["hf"])
    # the stub's state goes through the same allow-list: a payload inside it is refused
    _with_megatron_object(bad, "MCoreSavePlan", _Trap(tmp_path / "X"))
    with pytest.raises(CheckpointError, match=r"refusing to load (io|builtins)\.open"):
        read_metadata_file(bad / ".metadata")
    assert not (tmp_path / "X").exists()
    # a Megatron class that is no known stub is refused like any other
    _with_megatron_object(other, "SomethingElse", 1)
    with pytest.raises(CheckpointError, match="refusing to load megatron.core"):
        read_metadata_file(other / ".metadata")


# ---- what does not fit is one line ----------------------------------------------------------------


def test_a_leftover_tensor_is_named_and_a_missing_one_is_an_error(made, tmp_path, capfd):
    d = made["tiny-dense"]
    hf = dict(d["hf"])
    cfg = d["model"].config
    extra = write_megatron(hf, cfg, tmp_path / "extra")
    # a stored tensor no HF tensor uses: a training-only module
    import torch.distributed.checkpoint as dcp

    md_tensors = {"decoder.layers.0.mlp.extra_gate.weight": torch.ones(4, 64, dtype=torch.bfloat16)}
    dcp.save(md_tensors, storage_writer=dcp.FileSystemWriter(str(tmp_path / "add")), no_dist=True)
    _merge(extra, tmp_path / "add")
    src = open_source(extra, config=cfg)
    assert len(src.entries()) == len(hf)
    err = capfd.readouterr().err
    assert err.count("decoder.layers.0.mlp.extra_gate.weight maps to no HF tensor") == 1
    # the MoE config against a dense checkpoint: the first HF tensor it cannot fill, named
    with pytest.raises(
        CheckpointError,
        match=r"^model\.layers\.0\.self_attn\.q_norm\.weight: the megatron checkpoint has no tensor for it",
    ):
        open_source(extra, config=made["tiny-moe"]["model"].config).entries()


def test_fp8_parameters_stored_as_codes_are_refused(made, tmp_path):
    d = made["tiny-dense"]
    hf = dict(d["hf"])
    for i in range(2):  # stacked over the layers: every layer's o_proj
        name = f"model.layers.{i}.self_attn.o_proj.weight"
        hf[name] = hf[name].to(torch.float8_e4m3fn)
    mc = write_megatron(hf, d["model"].config, tmp_path / "fp8")
    with pytest.raises(CheckpointError, match=r"unknown quantized layout: .*float8"):
        open_source(mc, config=d["model"].config).entries()


def _merge(dst: Path, add: Path) -> None:
    """Add ``add``'s one tensor (and data file) to the DCP dir ``dst``."""
    a = pickle.loads((add / ".metadata").read_bytes())
    m = pickle.loads((dst / ".metadata").read_bytes())
    (dst / "extra_0.distcp").write_bytes((add / "__0_0.distcp").read_bytes())
    for k, v in a.state_dict_metadata.items():
        m.state_dict_metadata[k] = v
    for idx, info in a.storage_data.items():
        info.relative_path = "extra_0.distcp"
        m.storage_data[idx] = info
    (dst / ".metadata").write_bytes(pickle.dumps(m))


def test_cli_export_and_inspect_from_a_megatron_fixture(tmp_path):
    """``qckpt export`` with checkpoint.format: megatron, straight from the real fixture."""
    from tests.export_fixtures import write_calibration as wc

    m = build_model(str(MEGATRON / "moe_hf"), dtype="bfloat16", seed=0)
    load_checkpoint(m, MEGATRON / "moe_ep2")
    q = quant_config("tensor")
    cal = wc(tmp_path, m, q)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{source: {MEGATRON / 'moe_hf'}}}\n"
        f"checkpoint: {{path: {MEGATRON / 'moe_ep2'}, format: megatron}}\n"
        "quant:\n  weights: {format: fp8, granularity: tensor}\n"
        "  inputs: {format: fp8, granularity: tensor, dynamic: false}\n  ignore: ['lm_head']\n"
        f"calibrate: {{output: {cal}}}\n"
        f"export: {{format: compressed-tensors, output: {tmp_path / 'out'}}}\n"
    )
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    import os

    env = {**os.environ, **env}
    r = subprocess.run([sys.executable, "-m", "qckpt", "export", str(recipe)], capture_output=True,
                       text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    ref = tmp_path / "ref"
    run_export(m, MEGATRON / "moe_ep2", cal, ref, q, source_dir=MEGATRON / "moe_hf")
    for p in ref.iterdir():
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes(), p.name


# ---- DeepSeek-V3 (MLA, dense then MoE layers, shared experts, expert bias): generated only --------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from transformers import DeepseekV3Config

    root = tmp_path_factory.mktemp("deepseek")
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=False,
        max_position_embeddings=512, rope_scaling=None,
    )  # fmt: skip
    cfg.save_pretrained(root / "cfg")
    m = build_model(str(root / "cfg"), dtype="bfloat16", seed=0)
    with torch.no_grad():  # a bias that is not all zeros
        for k, v in m.named_buffers():
            if k.endswith("e_score_correction_bias"):
                v.copy_(torch.linspace(-1, 1, v.numel()))
    hf = hf_state(m)
    m.save_pretrained(root / "hf")
    # per-layer keys (what Megatron writes for a dense-then-MoE stack) with TE names, and the
    # stacked-where-possible mix with local names
    pl = write_megatron(hf, m.config, root / "mc-pl", stacked=False)
    mixed = write_megatron(hf, m.config, root / "mc-mixed", te=False)
    return {"model": m, "hf": hf, "hf_dir": root / "hf", "per_layer": pl, "mixed": mixed}


@pytest.mark.parametrize("kind", ["per_layer", "mixed"])
def test_deepseek_layout_reads_loads_and_exports_as_the_hf_form(deepseek, kind, tmp_path):
    d = deepseek
    src = open_source(d[kind], config=d["model"].config)
    got = _entries(src)
    assert got.keys() == d["hf"].keys()
    for k, v in d["hf"].items():
        assert torch.equal(bits(got[k]), bits(v)), k
    assert src.checkpoint().mapping.stacking == ("per-layer" if kind == "per_layer" else "mixed")
    q = quant_config("tensor")
    cal = write_calibration(tmp_path, d["model"], q)
    run_export(d["model"], d["hf_dir"], cal, tmp_path / "a", q)
    run_export(d["model"], d[kind], cal, tmp_path / "b", q)
    for p in (tmp_path / "a").iterdir():
        assert (tmp_path / "b" / p.name).read_bytes() == p.read_bytes(), p.name


# ---- calibrate, plan, inspect -----------------------------------------------------------------


def test_calibrate_from_megatron_writes_the_hf_sources_file(made, tmp_path):
    """Layer-by-layer (each layer's weights read through the training reader when it runs);
    a resident calibration's read is the load the tests above check."""
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.calibrate import calibrate
    from qckpt.pipeline.plan import plan
    from qckpt.recipe import load_recipe
    from tests.conftest import ROOT

    d = made["tiny-moe"]
    files = []
    for i, path in enumerate((d["hf_dir"], d["stacked"])):
        sets = [f"checkpoint.path={path}", f"calibrate.output={tmp_path / f'c{i}.safetensors'}",
                "calibrate.offload=layer", "calibrate.data.num_samples=8"]  # fmt: skip
        r = load_recipe(str(ROOT / "configs" / "tiny-moe.yaml"), sets)
        calibrate(r, Mesh())
        files.append(load_file(str(tmp_path / f"c{i}.safetensors")))
        # the plan reads the training checkpoint's pieces: the model's own bytes, as for HF
        reads = plan(r, nproc_per_node=1).rows["load"][0].bytes_read
        if i == 0:
            hf_reads = reads
    assert files[0].keys() == files[1].keys()
    for k in files[0]:
        assert torch.equal(bits(files[0][k]), bits(files[1][k])), k
    assert reads == hf_reads


def test_inspect_names_framework_version_architecture_and_stacking():
    from qckpt.inspect import inspect_path

    info = inspect_path(MEGATRON / "moe_ep2", str(MEGATRON / "moe_hf"))
    assert info["framework"] == "megatron" and info["stacking"] == "stacked"
    assert info["architecture"] == "MoE, q/k norms" and info["routed_experts"] == 8
    assert info["layers"] == 2 and info["mapped_tensors"] == 69 and info["leftover"] == []
    assert info["version"].startswith("torch_dist v1, training args in common.pt (never read)")
    bare = inspect_path(MEGATRON / "dense_tp2")
    assert bare["architecture"] == "dense" and "--model" in bare["mapped_tensors"]
    titan = inspect_path(TITAN / "qwen3_moe", str(TITAN / "qwen3_moe_hf"))
    assert titan["framework"] == "torchtitan" and titan["version"].startswith("0.3 names")
    assert titan["leftover"] == ["layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"]


# ---- the chunks a piece meets, found without a scan of every chunk ---------------------------


def _meets(c, offs, sizes) -> bool:
    return all(
        max(a, int(o)) < min(a + n, int(o) + int(z))
        for a, n, o, z in zip(offs, sizes, c.offsets, c.sizes, strict=True)
    )


@pytest.mark.parametrize("layout", ["grid", "irregular"])
def test_chunk_index_finds_every_chunk_a_region_meets(layout):
    import itertools
    import random

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as C

    from qckpt.read.training_sources import ChunkIndex

    rnd = random.Random(0)
    if layout == "grid":  # [L, E, 2F, H]: one chunk per layer, expert and fc1 fragment
        shape = (3, 5, 8, 4)
        chunks = [C(torch.Size((i, e, f * 4, 0)), torch.Size((1, 1, 4, 4)))
                  for i in range(3) for e in range(5) for f in range(2)]  # fmt: skip
    else:  # rows split unevenly, each row band split in columns its own way
        shape = (10, 12)
        chunks = []
        for r0, r1 in ((0, 3), (3, 4), (4, 10)):
            cuts = sorted({0, 12, *rnd.sample(range(1, 12), 3)})
            chunks += [C(torch.Size((r0, a)), torch.Size((r1 - r0, b - a)))
                       for a, b in itertools.pairwise(cuts)]  # fmt: skip
        rnd.shuffle(chunks)
    index = ChunkIndex(chunks)
    for _ in range(300):
        offs = tuple(rnd.randrange(n) for n in shape)
        sizes = tuple(rnd.randint(1, n - o) for n, o in zip(shape, offs, strict=True))
        near = index.near(offs, sizes)
        assert near == sorted(near)
        assert {i for i, c in enumerate(chunks) if _meets(c, offs, sizes)} <= set(near)
    whole = index.near((0,) * len(shape), shape)
    assert whole == list(range(len(chunks)))
