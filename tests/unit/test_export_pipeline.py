"""The export's overlapped writer: same files whatever the threads, bounded host memory, balanced
shard assignment, positional shard writes, one-line refusals of its settings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from qckpt.checkpoint.export import WriteOptions, export_checkpoint
from qckpt.errors import RecipeError, UsageError
from qckpt.recipe import ExportConfig
from tests.unit._export_fixtures import make_calibration, quant_config, saved_model

MiB = 2**20


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_files_are_the_same_whatever_the_threads(tmp_path):
    model, hf_dir = saved_model(tmp_path, "tiny-moe")
    q = quant_config("channel", "token")
    cal = make_calibration(model, q)
    outs = []
    for i, (readers, writers, quantizers) in enumerate([(1, 1, 1), (4, 8, 3), (2, 3, None)]):
        out = tmp_path / f"out-{i}"
        rep = export_checkpoint(
            source=hf_dir,
            calibration=cal,
            output=out,
            model_type="qwen3_moe",
            model_config=model.config,
            quant=q,
            export=ExportConfig(max_shard_size="20KB"),
            options=WriteOptions(readers=readers, writers=writers, quantizers=quantizers),
        )
        assert rep.shards > 5 and rep.tensors_written > 100
        outs.append(_tree(out))
    assert outs[0] == outs[1] == outs[2]


def test_host_memory_in_flight_is_bounded(tmp_path):
    """256 MiB of weights, the largest tensor 16 MiB: the write holds about 2 x 16 MiB of
    tensors at a time (reading everything first would hold > 256 MiB)."""
    from bench.export import make_checkpoint
    from qckpt.models.build import load_config

    info = make_checkpoint(tmp_path, 0.25, 1024, 4096, 8192)
    largest = info["largest_tensor_bytes"]
    assert largest == 16 * MiB and info["source_bytes"] > 14 * largest
    cfg = load_config(info["src"])
    rep = export_checkpoint(
        source=info["src"],
        calibration=info["calib"],
        output=tmp_path / "out",
        model_type="llama",
        model_config=cfg,
        quant=quant_config(),
        export=ExportConfig(max_shard_size="64MB"),
        options=WriteOptions(unmap_large_allocations=True),  # as the command runs it
    )
    # every tensor read once (the files' headers are not tensor data)
    assert rep.largest_tensor_bytes == largest
    assert 0.999 * info["source_bytes"] < rep.bytes_read < info["source_bytes"]
    assert rep.host_bound_bytes == 2 * largest + 256 * MiB
    print(f"anon rise during the write {rep.write_rss_anon_bytes / MiB:.0f} MiB")
    assert 0 < rep.write_rss_anon_bytes <= 2 * largest + 64 * MiB
    shutil.rmtree(tmp_path / "out")


def test_assign_files_balances_bytes_and_is_deterministic():
    from types import SimpleNamespace

    from qckpt.checkpoint.export_pipeline import assign_files
    from qckpt.checkpoint.export_plan import OutSpec

    sizes = [9, 1, 5, 5, 3, 7, 2, 8]
    specs = [[OutSpec(f"t{i}", torch.uint8, (n,))] for i, n in enumerate(sizes)]
    plan = SimpleNamespace(shards=SimpleNamespace(specs=specs))
    for world in (1, 2, 3, 5, 9):
        got = assign_files(plan, world)
        assert got == assign_files(plan, world)
        assert sorted(f for fs in got for f in fs) == list(range(len(sizes)))
        loads = [sum(sizes[f] for f in fs) for fs in got]
        assert max(loads) - min(loads) <= max(sizes)
    # the largest first, each to the emptier rank: 9 1 5 5 | 3 7 2 8, 20 bytes each
    assert assign_files(plan, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_shard_file_written_out_of_order_equals_front_to_back(tmp_path):
    from qckpt.checkpoint.export_plan import OutSpec
    from qckpt.checkpoint.safetensors_io import ShardFile, ShardWriter

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        "c": torch.randn(4, generator=g),
    }
    specs = [OutSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    w = ShardWriter(tmp_path / "front.safetensors", specs, {"format": "pt"})
    for k, t in tensors.items():
        w.write(k, t)
    w.close()
    f = ShardFile(tmp_path / "any.safetensors", specs, {"format": "pt"})
    for k in reversed(tensors):
        f.write(k, tensors[k])
    f.close()
    assert (tmp_path / "front.safetensors").read_bytes() == (
        tmp_path / "any.safetensors"
    ).read_bytes()
    half = ShardFile(tmp_path / "half.safetensors", specs, {})
    half.write("a", tensors["a"])
    with pytest.raises(AssertionError, match="wrote 1 of 3"):
        half.close()
    half.abort()


def test_bad_writer_settings_are_one_line(tmp_path):
    from qckpt.recipe import recipe_from_dict

    for bad in ("0", "65"):
        with pytest.raises(RecipeError, match=rf"^export.writers: must be in 1 .. 64, got {bad}$"):
            recipe_from_dict({}, [f"export.writers={bad}"])
    with pytest.raises(RecipeError, match="export.device"):
        recipe_from_dict({}, ["export.device=tpu"])
    if not torch.cuda.is_available():
        from qckpt.pipeline.export import export

        r = recipe_from_dict({}, ["export.device=cuda", f"export.output={tmp_path / 'never'}"])
        with pytest.raises(UsageError, match="^export.device: cuda asked for but no CUDA device"):
            export(r)
        assert not (tmp_path / "never").exists()


def test_worker_threads_use_the_callers_kernel_policy(tmp_path, monkeypatch):
    """The CLI scopes the kernel policy (QCKPT_COMPILE, ...) in a context variable; the quantize
    threads must see it, as the one thread of a plain export did."""
    import qckpt.checkpoint.export_layouts as layouts
    from qckpt.kernel_policy import KernelPolicy, current_policy, kernel_policy

    model, hf_dir = saved_model(tmp_path, "tiny-dense")
    q = quant_config()
    seen = []
    real = layouts.check_source_weight

    def spy(module, w, amax):
        seen.append(current_policy().compile)
        return real(module, w, amax)

    import qckpt.checkpoint.export_pipeline as pipe

    monkeypatch.setattr(pipe, "check_source_weight", spy)
    with kernel_policy(KernelPolicy(compile="never")):
        export_checkpoint(
            source=hf_dir,
            calibration=make_calibration(model, q),
            output=tmp_path / "out",
            model_type="llama",
            model_config=model.config,
            quant=q,
            export=ExportConfig(),
            options=WriteOptions(quantizers=2),
        )
    assert len(seen) == 14 and set(seen) == {"never"}
