"""``qckpt convert``'s writers: a model or an HF dir to DCP and back, a quantized HF dir
dequantized. See docs/ARCHITECTURE.md."""
