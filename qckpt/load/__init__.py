"""Tensors into a model's quantized, sharded parameters: the preflight, the streaming-dequant
planner, the load itself, shard scales and the layer-by-layer weights of offloaded
calibration. See docs/ARCHITECTURE.md."""
