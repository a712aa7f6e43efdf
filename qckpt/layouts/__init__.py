"""The on-disk quantized layouts, one module per family holding both directions (reading a
source dir, writing an export), the table that picks a family (``registry``), their names and
numbers (``names``) and the torch-free check of an export (``check``); the training
frameworks' layouts mapped onto HF names (``training``). See docs/ARCHITECTURE.md.

Nothing is imported here: ``qckpt check`` imports ``qckpt.layouts.check`` without torch."""
