"""Chain speculative sampling: a small draft model sharing the tokenizer drafts k tokens autoregressively."""

from __future__ import annotations

import torch

from ..core.cached_lm import CachedLM
from ..core.proposer import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn, chain_prefix
from ..core.sampling import probabilities, sample
from ..core.static_lm import BUCKETS, Row, one_batch
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
            for _ in range(k - 1):  # (forward takes ids on the device too: it runs `run`)
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

    @classmethod
    def propose_all(cls, proposers: list, tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """Slots of one shared draft (`Resources.draft_lm(shared=True)`) draft together: one draft forward over
        every slot's new tokens, then one per depth; at T = 0 each slot's argmax is fed back on the device, at T > 0
        each slot's draw from its own generator, as it draws alone. Otherwise (a draft of its own) one slot after
        another."""
        lm = one_batch([p.draft for p in proposers])
        temperatures = {p.temperature for p in proposers}
        ks = [
            min(p.k, d) if len(t) + min(p.k, d) <= p.draft.context_length else 0
            for p, t, d in zip(proposers, tokens, max_depths, strict=True)
        ]
        feeding = [(i, t[p.draft.cached :]) for i, (p, t, k) in enumerate(zip(proposers, tokens, ks, strict=True)) if k]
        if lm is None or len(temperatures) > 1 or any(len(fed) > BUCKETS[-1] for _, fed in feeding):
            return super().propose_all(proposers, tokens, max_depths)  # (a long catch-up runs alone)
        greedy = temperatures == {0}
        drafted: list[list] = [[] for _ in proposers]  # per slot: argmax ids [1] on the device, or drawn ids
        laws: list[list[torch.Tensor]] = [[] for _ in proposers]  # per slot at T > 0: each draw's law [V]
        for depth in range(max(ks, default=0)):
            if depth:
                feeding = [(i, drafted[i][-1] if greedy else drafted[i][-1:]) for i, k in enumerate(ks) if k > depth]
            outs = lm.run([Row(proposers[i].draft.slot, fed) for i, fed in feeding], greedy=greedy, last_only=True)
            for (i, _), out in zip(feeding, outs, strict=True):
                if greedy:
                    assert out.picks is not None  # (a greedy forward's)
                    drafted[i].append(out.picks[0][-1:].clone())  # [1]: its argmax (the next forward writes over it)
                    continue
                q = probabilities(out.logits[-1], proposers[i].temperature)
                laws[i].append(q)
                drafted[i].append(sample(q, proposers[i].generator))
        if greedy:
            return [Proposal(chain(torch.cat(d))) if d else NO_PROPOSAL for d in drafted]
        return [Proposal(chain(d), torch.stack(q)) if d else NO_PROPOSAL for d, q in zip(drafted, laws, strict=True)]


@implementation("sps", nested=chain_prefix("num_draft_tokens"))
def build(params: dict, res: Resources) -> Proposer:
    return DraftModel(res.draft_lm(shared=True), **params)
