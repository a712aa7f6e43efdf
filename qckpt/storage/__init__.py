"""Bytes in files, both directions, no quantization: safetensors headers and shards, DCP
metadata through the allow-list unpickler, ``torch.save`` archives located without
``torch.load``, the small files a model dir carries (see docs/ARCHITECTURE.md)."""
