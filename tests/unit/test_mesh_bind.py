"""A CUDA rank keeps to its GPU's NUMA node's CPUs (``parallel.mesh.bind_near_gpu``)."""

import os

import torch

from qckpt.parallel import mesh


def test_cpulist_format():
    assert mesh.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert mesh.parse_cpulist("") == set()


def test_cpu_rank_is_left_alone():
    before = os.sched_getaffinity(0)
    assert mesh.bind_near_gpu(torch.device("cpu")) is None
    assert os.sched_getaffinity(0) == before


def test_binds_to_the_gpus_node(monkeypatch, tmp_path):
    # a fake GPU at 0000:1a:00.0 whose node holds CPU 0 only (always allowed here)
    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x1A, 0

    before = os.sched_getaffinity(0)
    opened = []
    real_open = open

    def fake_open(path, *a, **k):
        if str(path).startswith("/sys/bus/pci/devices/"):
            opened.append(str(path))
            f = tmp_path / "local_cpulist"
            f.write_text(f"{min(before)}\n")
            return real_open(f, *a, **k)
        return real_open(path, *a, **k)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props())
    monkeypatch.setattr("builtins.open", fake_open)
    try:
        assert mesh.bind_near_gpu(torch.device("cuda", 0)) == {min(before)}
        assert os.sched_getaffinity(0) == {min(before)}
        assert opened == ["/sys/bus/pci/devices/0000:1a:00.0/local_cpulist"]
        os.sched_setaffinity(0, before)
        monkeypatch.setenv("QCKPT_NO_CPU_BIND", "1")
        assert mesh.bind_near_gpu(torch.device("cuda", 0)) is None
    finally:
        os.sched_setaffinity(0, before)
