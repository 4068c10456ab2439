"""PARD: a parallel draft model guesses a chain of k tokens in one forward, reading k - 1 mask tokens appended after
the committed ones; the masks' cache rows are dropped at once, so the drafter's cache holds committed tokens only.

At T > 0 each row is drawn from the drafter's distribution at the run's temperature and verified against it by
the shared rejection rule (the official code drafts greedily; vLLM samples with draft_sample_method probabilistic).
"""

from __future__ import annotations

import torch

from ..core.cached_lm import CachedLM
from ..core.proposer import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn, chain_of_rows, chain_prefix
from ..core.static_lm import BUCKETS, Row, one_batch
from ..heads.pard import FAMILY
from ..registry import implementation
from .resources import Resources


class Pard(Proposer):
    def __init__(self, drafter: CachedLM, mask_token: int, vocab: int, num_draft_tokens: int = 8) -> None:
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError("pard needs num_draft_tokens >= 1")
        self.drafter = drafter
        self.mask = mask_token
        self.vocab = vocab  # the target's: a smaller drafter vocabulary is padded with zero probability
        self.k = num_draft_tokens

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.drafter.prefill(turn.prompt)

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        k = min(self.k, max_depth)
        if k < 1 or len(tokens) + k > self.drafter.context_length:
            return NO_PROPOSAL
        logits = self.drafter.forward(tokens[self.drafter.cached :] + [self.mask] * (k - 1))[-k:]  # [k, V']
        self.drafter.crop(len(tokens))  # the masks' rows go; the committed tokens' stay
        return chain_of_rows(logits, self.temperature, self.generator, self.vocab)

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        self.drafter.follow(tokens)

    @classmethod
    def propose_all(cls, proposers: list, tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """Slots of one shared drafter (`Resources.cached_lm(shared=True)`) draft together: one forward over every
        slot's new tokens and masks, each slot's chain then read from its own rows. Otherwise one after another."""
        lm = one_batch([p.drafter for p in proposers])
        ks = [
            min(p.k, d) if len(t) + min(p.k, d) <= p.drafter.context_length else 0
            for p, t, d in zip(proposers, tokens, max_depths, strict=True)
        ]
        fed = [t[p.drafter.cached :] + [p.mask] * (k - 1) for p, t, k in zip(proposers, tokens, ks, strict=True)]
        working = [i for i, k in enumerate(ks) if k]
        if lm is None or not working or any(len(fed[i]) > BUCKETS[-1] for i in working):
            return super().propose_all(proposers, tokens, max_depths)  # (a long catch-up runs alone)
        with torch.inference_mode():
            outs = lm.run([Row(proposers[i].drafter.slot, fed[i]) for i in working])
        found = [NO_PROPOSAL] * len(proposers)
        for i, out in zip(working, outs, strict=True):
            p = proposers[i]
            p.drafter.crop(len(tokens[i]))  # the masks' rows go; the committed tokens' stay
            found[i] = chain_of_rows(out.logits[-ks[i] :], p.temperature, p.generator, p.vocab)
        return found


@implementation("pard", nested=chain_prefix("num_draft_tokens"))
def build(params: dict, res: Resources) -> Proposer:
    dtype = res.draft_dtype(params.pop("draft_dtype", None))
    model = res.head(FAMILY.name, dtype)  # importing heads.pard registers the family
    vocab = res.target_model.get_output_embeddings().weight.shape[0]
    return Pard(res.cached_lm(model, "PARD draft", shared=True), model.pard_token, vocab, **params)
