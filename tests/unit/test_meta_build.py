"""Meta builds (issue 17): a model is made on meta and allocated straight into its quantized
parameters, and a checkpoint load then gives exactly what today's seeded build + load gives,
without a BF16 copy of a quantized weight ever existing."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qckpt.pipeline.load as pipeline_load
from qckpt import formats
from qckpt.convert.dcp import dcp_to_hf_dir, save_model_dcp
from qckpt.errors import CheckpointError
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model, load_config
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.model import build
from qckpt.recipe import recipe_from_dict
from tests._bits import bits
from tests.toy import FMTS, assert_same_model, same_tensor

IGNORE = ["lm_head", "*.mlp.gate"]  # the recipe's default quant.ignore

CASES = [
    ("fp8", {}),
    ("fp8", {"granularity": "channel"}),
    ("fp8", {"pow2_scale": True, "dtype": "e5m2"}),
    ("fp8_delayed", {"history_len": 4}),
    ("mxfp8", {}),
    ("mxfp8", {"scale_rounding": "rceil"}),
    ("fp8_block", {}),
    ("fp8_block", {"block_size": [32, 16]}),
    ("nvfp4", {}),
]


# ---- formats: a fresh tensor is defined, and on meta it is shapes only ---------------------------


@pytest.mark.parametrize("fmt,opts", CASES)
@pytest.mark.parametrize("shape", [(3, 40), (2, 5, 33), (130, 260), (7,)])
def test_empty_is_what_quantizing_zeros_gives(fmt, opts, shape):
    want = formats.quantize(torch.zeros(shape, dtype=torch.bfloat16), fmt, **opts)
    fresh = formats.empty(shape, fmt, **opts)
    meta = formats.empty(shape, fmt, device="meta", **opts)
    allocated = torch.empty_like(meta, device="cpu")  # what Module.to_empty calls
    for q in (fresh, meta, allocated):
        assert formats.is_quantized(q) and tuple(q.shape) == shape and q.dtype == torch.bfloat16
        assert q.opts == want.opts
    assert meta.is_meta and all(f.is_meta for f in meta.fields().values())
    assert same_tensor(fresh, want) and same_tensor(allocated, want)
    for k, f in meta.fields().items():
        assert (f.shape, f.dtype) == (want.fields()[k].shape, want.fields()[k].dtype), k


def test_empty_refuses_bad_formats_and_dtypes():
    with pytest.raises(formats.FormatError, match="unknown quantization format 'int3'"):
        formats.empty((4, 4), "int3")
    with pytest.raises(formats.FormatError, match="nominal dtype"):
        formats.empty((4, 4), "fp8", nominal_dtype=torch.int8)
    with pytest.raises(formats.FormatError, match="unknown options"):
        formats.empty((4, 4), "fp8", block=3)


def test_fresh_delayed_tensor_takes_its_first_scale_from_its_value():
    x = torch.randn(32, 16) * 0.02  # a weight's magnitude: a scale of 1.0 would crush it
    q = formats.empty((32, 16), "fp8_delayed", nominal_dtype=torch.float32)
    assert q.quant_state() == {}  # nothing a load must keep yet
    q.quantize_(x, update_state=False)
    assert same_tensor(q, formats.quantize(x, "fp8_delayed"))
    # from now on it has a history, which a load leaves as it is
    kept = q.quant_state()
    assert set(kept) == {"amax_history", "quant_scale"}
    q.quantize_(x * 4, update_state=False)
    assert all(torch.equal(bits(v), bits(getattr(q, k))) for k, v in kept.items())
    assert torch.equal(q.scale, kept["quant_scale"])


# ---- builds: meta + load == seeded + load ------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def ckpt(request, tmp_path_factory):
    """(source, {"dcp": dir, "hf": dir}, the checkpoint's values) of a seeded model."""
    source = request.param
    root = tmp_path_factory.mktemp(source)
    src = build_model(source, seed=5)
    save_model_dcp(src, root / "dcp")
    dcp_to_hf_dir(root / "dcp", root / "hf", src.config)
    return source, {"dcp": root / "dcp", "hf": root / "hf"}, src.state_dict()


def _built(source, fmt, *, seeded):
    return build(source, Mesh(), seed=1, seeded=seeded, sharded=False, params=fmt, ignore=IGNORE)


@pytest.mark.parametrize("kind", ["dcp", "hf"])
@pytest.mark.parametrize("fmt", FMTS)
def test_meta_build_loads_what_a_seeded_build_loads(ckpt, kind, fmt):
    source, dirs, values = ckpt
    seeded, meta = _built(source, fmt, seeded=True), _built(source, fmt, seeded=False)
    assert seeded.quantized == meta.quantized and set(meta.quantized.values()) == {fmt}
    load_checkpoint(seeded.model, dirs[kind])
    load_checkpoint(meta.model, dirs[kind])
    got = meta.model.state_dict(keep_vars=True)
    if fmt == "fp8_delayed":
        # the seeded build's history holds its random weights' amax, which the load keeps and
        # quantizes with; a fresh tensor takes its scale from the checkpoint's own value
        for name in meta.quantized:
            assert same_tensor(got[name], formats.quantize(values[name], fmt)), name
        plain = {k: v for k, v in got.items() if k not in meta.quantized}
        ref = seeded.model.state_dict(keep_vars=True)
        assert all(same_tensor(v, ref[k]) for k, v in plain.items())
    else:
        assert_same_model(meta.model, seeded.model)  # every field of every param and buffer
    if source != "tiny-dense":
        return  # quantized fused experts have no forward (calibration runs a BF16 model)
    # the same logits: the non-persistent buffers (rotary inv_freq) were rebuilt too
    ids = torch.arange(12).view(2, 6)
    with torch.no_grad():
        a, b = seeded.model(ids).logits, meta.model(ids).logits
    if fmt != "fp8_delayed":
        assert torch.equal(bits(a), bits(b))
    assert torch.isfinite(b).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_meta_build_stream_and_bulk_loads_agree(ckpt, fmt):
    source, dirs, _ = ckpt
    a, b = _built(source, fmt, seeded=False), _built(source, fmt, seeded=False)
    load_checkpoint(a.model, dirs["dcp"], stream=True)
    load_checkpoint(b.model, dirs["dcp"], stream=False)
    assert_same_model(a.model, b.model)


def test_non_persistent_buffers_equal_a_seeded_builds(ckpt):
    source = ckpt[0]
    seeded, meta = _built(source, "fp8", seeded=True), _built(source, "fp8", seeded=False)
    want = dict(seeded.model.named_buffers())
    got = dict(meta.model.named_buffers())
    assert got.keys() == want.keys() and got  # inv_freq at least
    for k, v in want.items():
        assert torch.equal(bits(got[k]), bits(v)), k


# ---- no BF16 copy of a quantized weight, no random init ----------------------------------------


_RANDOM_INIT = {"normal_", "uniform_", "random_", "randn", "rand", "trunc_normal_", "bernoulli_"}


class _BuildSpy(TorchDispatchMode):
    """Records, off the meta device, every random init (``randn``, ``normal_``, ...) and every
    plain high-precision tensor whose shape is one of ``shapes`` (the quantized parameters'):
    what a seeded build does and makes, a meta build not."""

    def __init__(self, shapes: set[tuple[int, ...]] = frozenset()) -> None:
        super().__init__()
        self.shapes = shapes
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        self.random: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in (out if isinstance(out, (list, tuple)) else [out])]
        real = [t for t in outs if isinstance(t, torch.Tensor) and not t.is_meta]
        if real and func.__name__.split(".")[0] in _RANDOM_INIT:
            self.random.append(str(func))
        for t in real:
            if (
                not formats.is_quantized(t)
                and t.is_floating_point()
                and t.element_size() >= 2
                and tuple(t.shape) in self.shapes
            ):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _quantized_shapes(source: str, fmt: str) -> set[tuple[int, ...]]:
    built = build(source, Mesh(), sharded=False, params=fmt, ignore=IGNORE)
    params = built.model.state_dict(keep_vars=True)
    return {tuple(params[n].shape) for n in built.quantized}


@pytest.mark.parametrize("source", ["tiny-moe", "tiny-dense"])
def test_qckpt_load_never_makes_a_bf16_copy_of_a_quantized_weight(tmp_path, monkeypatch, source):
    save_model_dcp(build_model(source, seed=5), tmp_path / "c")
    spy = _BuildSpy(_quantized_shapes(source, "fp8"))
    real = pipeline_load.build_for_load
    built = []

    def spying_build_for(*args, **kwargs):
        with spy:
            b = real(*args, **kwargs)
        built.append(b)
        return b

    monkeypatch.setattr(pipeline_load, "build_for_load", spying_build_for)
    recipe = recipe_from_dict(
        {
            "model": {"source": source},
            "checkpoint": {"path": str(tmp_path / "c")},
            "load": {"params": "fp8"},
        }
    )
    res = pipeline_load.load(recipe, Mesh())
    assert len(built) == 1 and res.reports[0].tensors_per_format["fp8"] == len(built[0].quantized)
    assert spy.seen == [] and spy.random == []
    # the check can fail: a seeded build makes exactly those tensors (its random init)
    with spy:
        _built(source, "fp8", seeded=True)
    assert spy.seen and spy.random


def test_qckpt_calibrate_builds_on_meta(tmp_path, monkeypatch):
    import qckpt.pipeline.calibrate as pipeline_calibrate

    save_model_dcp(build_model("tiny-moe", seed=5), tmp_path / "c")
    # with weights held in FP8 (bf16-resident weights are plain BF16 by design, same build)
    resident = "fp8"
    spy = _BuildSpy(_quantized_shapes("tiny-moe", resident))
    real = pipeline_calibrate.build_for

    def spying_build_for(*args, **kwargs):
        with spy:
            return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_calibrate, "build_for", spying_build_for)
    recipe = recipe_from_dict(
        {
            "model": {"source": "tiny-moe"},
            "checkpoint": {"path": str(tmp_path / "c")},
            "calibrate": {
                "weights_resident": resident,
                "output": str(tmp_path / "calib.safetensors"),
                "data": {"source": "synthetic", "num_samples": 4, "seq_len": 8, "batch_size": 2},
            },
        }
    )
    res = pipeline_calibrate.calibrate(recipe, Mesh())
    assert (tmp_path / "calib.safetensors").is_file() and res.report
    assert spy.random == [] and spy.seen == []


# ---- a checkpoint that does not cover every tensor is refused -----------------------------------


def _load_recipe(source: str, path, params: str = "fp8", ignore=None):
    quant = {} if ignore is None else {"quant": {"ignore": ignore}}
    return recipe_from_dict(
        {
            "model": {"source": source},
            "checkpoint": {"path": str(path)},
            "load": {"params": params},
            **quant,
        }
    )


@pytest.mark.parametrize(
    "missing", ["model.layers.1.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"]
)
@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_a_checkpoint_missing_a_tensor_is_refused_in_one_line(tmp_path, missing, kind):
    from safetensors.torch import load_file, save_file

    src = build_model("tiny-dense", seed=5)
    sd = src.state_dict()
    if kind == "hf":
        save_model_dcp(sd, tmp_path / "dcp")
        path = dcp_to_hf_dir(tmp_path / "dcp", tmp_path / "hf", src.config)
        held = load_file(path / "model.safetensors")
        del held[missing]
        save_file(held, path / "model.safetensors", metadata={"format": "pt"})
    else:
        del sd[missing]
        path = tmp_path / "dcp"
        save_model_dcp(sd, path)
    with pytest.raises(CheckpointError) as ei:
        pipeline_load.load(_load_recipe("tiny-dense", path), Mesh())
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{missing}: missing"), msg


def _tied_source(tmp_path):
    cfg = load_config("tiny-dense")
    cfg.tie_word_embeddings = True
    cfg.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_tied_embeddings_load_from_the_embedding_the_checkpoint_holds(tmp_path):
    source = _tied_source(tmp_path)
    src = build_model(source, seed=5)
    sd = src.state_dict()
    del sd["lm_head.weight"]  # as save_pretrained writes a tied model
    save_model_dcp(sd, tmp_path / "c")
    built = {}
    for seeded in (True, False):
        m = _built(source, "fp8", seeded=seeded).model
        assert m.lm_head.weight is m.model.embed_tokens.weight  # the tie survives the build
        load_checkpoint(m, tmp_path / "c")
        assert torch.equal(bits(m.lm_head.weight), bits(sd["model.embed_tokens.weight"]))
        built[seeded] = m
    assert_same_model(built[False], built[True])
    # quantizing lm_head unties it: then the checkpoint must hold it, and this one does not
    with pytest.raises(CheckpointError, match=r"^lm_head\.weight: missing from checkpoint"):
        pipeline_load.load(_load_recipe(source, tmp_path / "c", ignore=["*.mlp.gate"]), Mesh())
