"""The proposer interface: what every method implements to plug into the shared decode loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..acceptance import Accepted
from ..tree import EMPTY, Tree


@dataclass(frozen=True)
class Proposal:
    tree: Tree
    draft_probs: torch.Tensor | None = None  # [n, V]: the distribution each node was drawn from; None = point mass

    def pruned(self, max_depth: int) -> Proposal:
        """Drop nodes deeper than max_depth (drafting past the token budget is wasted work)."""
        if self.tree.max_depth() <= max_depth:
            return self
        keep = [i for i, d in enumerate(self.tree.depths()) if d <= max_depth]
        probs = self.draft_probs[keep] if self.draft_probs is not None else None
        return Proposal(self.tree.subtree(keep), probs)


NO_PROPOSAL = Proposal(EMPTY)


class Proposer:
    """A method: proposes a token tree each step and learns what the target accepted.

    `tokens` passed to propose/update is the committed sequence (prompt and generated tokens); its last
    element is the root of the next verification, not yet in the target's cache.
    """

    name = "base"
    lossless = True  # False for rules such as typical acceptance; results are labelled with it

    def start(self, prompt: list[int], temperature: float, generator: torch.Generator | None) -> None:
        """A new turn begins with this prompt."""
        self.temperature = temperature
        self.generator = generator

    def propose(self, tokens: list[int]) -> Proposal:
        return NO_PROPOSAL

    def update(self, tokens: list[int], proposal: Proposal, accepted: Accepted) -> None:
        """`tokens` now include the accepted path and the target's own token."""
