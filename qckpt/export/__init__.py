"""An export, from plan to committed dir: the plan, who writes what, one rank's overlapped
read -> quantize -> write, the team of ranks, the writer. See docs/ARCHITECTURE.md.

Nothing is imported here: the CLI's start-up reads ``qckpt.export.model_record`` without torch."""
