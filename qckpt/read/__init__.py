"""A checkpoint dir to tensors: sources (entries, then one tensor at a time), DCP storage
readers in the model's state-dict names (plain and fast), and the factory above every reader
(``readers``). See docs/ARCHITECTURE.md."""
