"""``qckpt.formats.sizes`` (torch-free, what ``qckpt plan`` sizes quantized parameters by) is
each format's own layout: its ``field_specs`` and ``scale_block``, shape for shape."""

from __future__ import annotations

import pytest

from qckpt import formats
from qckpt.errors import FormatError
from qckpt.formats.sizes import field_shapes, quantized_nbytes, scale_block

SHAPES = [(), (33,), (64, 48), (130, 257), (3, 40, 130), (2, 5, 7, 17)]
OPTS = {
    "fp8": [{}, {"granularity": "channel"}],
    "fp8_delayed": [{}, {"history_len": 5}],
    "fp8_block": [{}, {"block_size": (16, 48)}, {"block_size": 32}],
    "mxfp8": [{}],
    "nvfp4": [{}],
}


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_the_twin_is_the_formats_own_layout(fmt):
    spec = formats.FORMATS[fmt]
    for opts in OPTS[fmt]:
        parsed = spec.parse_opts(dict(opts))
        for shape in SHAPES:
            own = {
                k: (tuple(f.shape), f.dtype.itemsize)
                for k, f in spec.field_specs(shape, parsed).items()
            }
            assert field_shapes(fmt, shape, opts) == own, (fmt, shape, opts)
            q = formats.empty(shape, fmt, device="meta", **opts)
            assert quantized_nbytes(fmt, shape, opts) == q.quantized_nbytes(), (fmt, shape)
            for dim in range(len(shape)):
                want = spec.scale_block(parsed, dim, len(shape))
                assert scale_block(fmt, opts, dim, len(shape)) == want, (fmt, shape, dim)


def test_every_format_has_a_twin_and_an_unknown_one_is_refused():
    assert sorted(OPTS) == sorted(formats.FORMATS)
    with pytest.raises(FormatError, match="unknown quantization format 'fp9'"):
        quantized_nbytes("fp9", (4, 4))
