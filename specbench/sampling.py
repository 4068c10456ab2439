"""From logits to token choices: temperature scaling and seeded sampling, shared by targets and drafts."""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of logits / temperature in float32 (rows are distributions); temperature must be > 0."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from a 1D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def uniform(generator: torch.Generator | None, device: torch.device | str) -> float:
    return float(torch.rand((), generator=generator, device=device))
