"""Chain speculative sampling: a small draft model sharing the tokenizer drafts k tokens autoregressively."""

from __future__ import annotations

import torch

from ..core.cached_lm import CachedLM
from ..core.proposer import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn, chain_prefix
from ..core.sampling import probabilities, sample
from ..core.tree import chain
from ..registry import implementation
from .resources import Resources


class DraftModel(Proposer):
    def __init__(self, draft_model, num_draft_tokens: int = 4) -> None:
        if num_draft_tokens < 1:
            raise ValueError("sps needs num_draft_tokens >= 1")
        self.draft = draft_model if isinstance(draft_model, CachedLM) else CachedLM(draft_model)
        self.k = num_draft_tokens

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.draft.prefill(turn.prompt)

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        k = min(self.k, max_depth)
        if k < 1 or len(tokens) + k > self.draft.context_length:
            return NO_PROPOSAL
        logits = self.draft.forward(tokens[self.draft.cached :])[-1]
        if self.temperature == 0:  # each argmax feeds the next forward on the device: the host never waits
            drafted = [logits.argmax(-1, keepdim=True)]
            for _ in range(k - 1):
                drafted.append(self.draft.forward(drafted[-1])[-1].argmax(-1, keepdim=True))
            return Proposal(chain(torch.cat(drafted)))
        sampled: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            q = probabilities(logits, self.temperature)
            rows.append(q)
            sampled.append(sample(q, self.generator))
            if i < k - 1:
                logits = self.draft.forward(sampled[-1:])[-1]
        return Proposal(chain(sampled), torch.stack(rows))

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        self.draft.follow(tokens)


@implementation("sps", nested=chain_prefix("num_draft_tokens"))
def build(params: dict, res: Resources) -> Proposer:
    return DraftModel(res.draft_lm(), **params)
