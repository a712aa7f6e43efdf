"""Without Transformer Engine, ``load.backend: te`` is a one-line error saying how to install it."""

import importlib.util

import pytest

from tests.conftest import run_qckpt


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE here")
def test_backend_te_without_te_says_how_to_install():
    r = run_qckpt("load", "configs/tiny-dense.yaml", "--set", "load.backend=te")
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line
    assert "load.backend: te needs Transformer Engine" in line and "pip install 'qckpt[te]'" in line
