"""Models: aliases, hub checkpoints at pinned commits, loading into the run's device and dtype, chat prompts, and
the CPU's few-row layout of linear layers, and `--graphs`' two-kernel RMSNorm."""
