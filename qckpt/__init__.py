"""qckpt: quantized checkpoints for large transformers."""

__version__ = "0.1.0"
