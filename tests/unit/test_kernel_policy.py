"""The kernel policy: a value the CLI builds from the environment, scoped, never a global."""

from __future__ import annotations

import pytest
import torch

from qckpt.formats import quantize
from qckpt.kernel_policy import KernelPolicy, current_policy, kernel_policy


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, KernelPolicy()),
        ({"QCKPT_COMPILE": "1"}, KernelPolicy(compile="always")),
        ({"QCKPT_COMPILE": "0", "QCKPT_TRITON": "off"}, KernelPolicy(compile="never", triton=False)),
        ({"QCKPT_TRITON": "FALSE", "QCKPT_TRITON_SOFT_CVT": "1"},
         KernelPolicy(triton=False, soft_fp8_cast=True)),
        ({"QCKPT_COMPILE": "sometimes", "QCKPT_TRITON": "yes"}, KernelPolicy()),
    ],
)  # fmt: skip
def test_from_env(env, want):
    assert KernelPolicy.from_env(env) == want


def test_the_library_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("QCKPT_TRITON", "0")
    monkeypatch.setenv("QCKPT_COMPILE", "1")
    assert current_policy() == KernelPolicy()


def test_a_policy_is_scoped_and_restored():
    eager = KernelPolicy(compile="never", triton=False)
    with kernel_policy(eager):
        assert current_policy() is eager
        assert not current_policy().compiles(torch.device("cuda"))
    assert current_policy().compiles(torch.device("cuda"))
    assert not current_policy().compiles(torch.device("cpu"))
    seen = []

    def spy(*_a, **_k):
        seen.append(current_policy())
        raise RuntimeError("stop")

    # quantize(policy=) holds the policy for its own call only, also when it raises
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("qckpt.formats._base.FORMATS", {"fp8": type("F", (), {"parse_opts": spy})()})
        mp.setattr("qckpt.formats.functions.FORMATS", {"fp8": type("F", (), {"parse_opts": spy})()})
        with pytest.raises(RuntimeError, match="stop"):
            quantize(torch.ones(4), "fp8", policy=eager)
    assert seen == [eager] and current_policy() == KernelPolicy()


def test_a_bad_compile_mode_is_named():
    with pytest.raises(ValueError, match="KernelPolicy.compile"):
        KernelPolicy(compile="1")
