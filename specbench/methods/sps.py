"""Chain speculative sampling: a small draft model sharing the tokenizer drafts k tokens autoregressively, every
slot of a batch in one draft forward per depth."""

from __future__ import annotations

import torch

from ..core.cached_lm import CachedLM
from ..core.lanes import Lanes
from ..core.proposer import NO_PROPOSAL, Drafter, Feedback, Proposal, Turn, chain_prefix
from ..core.sampling import drawn
from ..core.static_lm import BatchedLM, Row
from ..core.tree import chain
from ..registry import implementation
from .resources import Resources


class DraftModel(Drafter):
    """`draft`: the draft's caches for the batch (`Lanes`, or what makes them)."""

    def __init__(self, draft: Lanes | BatchedLM | CachedLM | torch.nn.Module, num_draft_tokens: int = 4) -> None:
        if num_draft_tokens < 1:
            raise ValueError("sps needs num_draft_tokens >= 1")
        self.draft = draft if isinstance(draft, Lanes) else Lanes(draft)
        self.k = num_draft_tokens
        self.turns: dict[int, Turn] = {}

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        self.turns.update(zip(slots, turns, strict=True))
        self.draft.prefill(slots, [turn.prompt for turn in turns])

    @torch.inference_mode()
    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """One draft forward over every slot's new tokens, then one per depth, each slot's token fed back on the
        device (the host never waits): at T = 0 its argmax, at T > 0 its draw from its own generator (`drawn`). At
        T = 0 a slot near its token budget drafts all k with the others (the loop cuts its chain on the device), so
        every chain is one row of a block."""
        turns = [self.turns[s] for s in slots]
        greedy = all(turn.temperature == 0 for turn in turns)
        ks = self.draft.chains(self.k, tokens, max_depths, whole=greedy)
        feeding: list[tuple[int, list[int] | torch.Tensor]] = [
            (i, t[self.draft.cached(s) :]) for i, (s, t, k) in enumerate(zip(slots, tokens, ks, strict=True)) if k
        ]
        drafted: list[list[torch.Tensor]] = [[] for _ in slots]  # per slot: each depth's token [1] on the device
        laws: list[list[torch.Tensor]] = [[] for _ in slots]  # per slot at T > 0: each draw's law [V]
        depths: list[torch.Tensor] = []  # greedy: each depth's argmax of every drafting slot [m]
        for depth in range(max(ks, default=0)):
            if depth:
                feeding = [(i, d[-1]) for i, d in enumerate(drafted) if ks[i] > depth]
            rows = [Row(slots[i], fed) for i, fed in feeding]
            if greedy:  # every slot's argmax in one gather, each fed back as a view of it
                picked = self.draft.picks(rows)[:, 0]
                depths.append(picked)
                for j, (i, _) in enumerate(feeding):
                    drafted[i].append(picked[j : j + 1])
                continue
            fed = [turns[i] for i, _ in feeding]
            picked, q = drawn(self.draft.last_logits(rows), [t.temperature for t in fed], [t.generator for t in fed])
            for j, (i, _) in enumerate(feeding):
                drafted[i].append(picked[j : j + 1])
                if turns[i].temperature > 0:
                    laws[i].append(q[j])
        if greedy and len({k for k in ks if k}) == 1:  # every drafting slot's chain a row of one [m, k] block
            block = iter(torch.stack(depths, 1))
            return [Proposal(chain(next(block))) if k else NO_PROPOSAL for k in ks]
        return [
            NO_PROPOSAL if not d else Proposal(chain(torch.cat(d)), torch.stack(q) if q else None)
            for d, q in zip(drafted, laws, strict=True)
        ]

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        for slot, t in zip(slots, tokens, strict=True):
            self.draft.follow(slot, t)


@implementation("sps", nested=chain_prefix("num_draft_tokens"), batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    return DraftModel(res.draft_lanes(slots), **params)
