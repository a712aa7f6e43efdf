"""``--nproc-per-node`` against the GPUs: how ``qckpt.cli.gpu_use`` counts and judges them (the
commands' one-line refusals are in tests/e2e/test_one_recipe.py)."""

from __future__ import annotations

from qckpt.cli import gpu_use


def test_the_cpu_needs_no_gpu_per_rank(monkeypatch):
    monkeypatch.setattr("qckpt.cli._common.visible_gpus", lambda *a, **k: 1)
    use = gpu_use.GpuUse("load.device", "cpu")
    assert gpu_use.check_gpus(use, 4, 1) is None
    assert gpu_use.check_gpus(gpu_use.GpuUse("load.device", "auto"), 4, 0) is None


def test_gpus_are_counted_from_the_device_nodes_and_cuda_visible_devices(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert gpu_use.visible_gpus({}, tmp_path) == 3
    assert gpu_use.visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, tmp_path) == 1
    assert gpu_use.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}, tmp_path) == 2
    assert gpu_use.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == 0
    assert gpu_use.visible_gpus({}, tmp_path / "none") == 0
