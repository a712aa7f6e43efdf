"""Quantize / dequantize temporaries stay O(chunk) on CPU, counted with a dispatch mode that
tracks the storages that ops create and that are still referenced (the CUDA version with the
real allocator's peak is tests/gpu/test_formats_gpu.py)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qckpt.formats import numerics, quantize


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created inside the mode (pre-existing ones excluded)."""

    def __init__(self, *exclude: torch.Tensor) -> None:
        super().__init__()
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: dict[tuple[int, int], int] = {}
        self.cur = 0
        self.peak = 0

    def _drop(self, key: tuple[int, int]) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.cur -= key[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key[1] == 0 or key[0] in self.exclude:
                continue
            if key not in self.refs:
                self.refs[key] = 0
                self.cur += key[1]
                self.peak = max(self.peak, self.cur)
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out


@pytest.mark.parametrize("fmt", ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"])
def test_temporaries_are_bounded_by_the_chunk(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "CHUNK_ELEMS", 1 << 15)
    x = torch.randn(1024, 1024).to(torch.bfloat16)
    chunk_f32 = numerics.CHUNK_ELEMS * 4
    # fp8_block chunks whole 128-row tile rows: 128 x 1024 = 4 chunks here
    unit = chunk_f32 * (4 if fmt == "fp8_block" else 1)
    full_f32 = x.numel() * 4  # what an unchunked quantize would allocate (32 chunks)

    with LiveBytes(x) as m:
        q = quantize(x, fmt)
    out = sum(v.numel() * v.element_size() for v in q.fields().values())
    assert 0 < m.peak - out <= 6 * unit and m.peak - out < full_f32 / 2

    with LiveBytes(x, *q.fields().values()) as m:
        q.quantize_(x)
    assert m.peak <= 6 * unit  # in place: nothing output-sized

    with LiveBytes(*q.fields().values()) as m:
        d = q.dequantize(torch.bfloat16)
    assert m.peak - d.numel() * 2 <= 8 * unit
