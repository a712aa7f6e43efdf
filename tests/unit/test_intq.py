"""INT4 codes packed into int32 words as compressed-tensors ``pack-quantized`` stores them."""

from __future__ import annotations

import torch


def test_packing_is_compressed_tensors_bit_for_bit():
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    from qckpt.formats.intq import pack_int32, unpack_int32

    g = torch.Generator().manual_seed(0)
    for cols in (256, 72, 13, 8):  # whole words, a partial last word, less than one word
        codes = torch.randint(-8, 8, (5, cols), generator=g, dtype=torch.int8)
        ours = pack_int32(codes, 4)
        assert torch.equal(ours, pack_to_int32(codes, 4)), cols
        assert torch.equal(unpack_int32(ours, 4, cols), codes)
        assert torch.equal(unpack_from_int32(ours, 4, torch.Size((5, cols))), codes)
