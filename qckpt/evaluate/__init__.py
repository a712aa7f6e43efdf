"""``qckpt eval``: what an export loses on held-out data, computed from the export's own files
the way a serving stack computes it (see docs/QUALITY.md and docs/ARCHITECTURE.md)."""
