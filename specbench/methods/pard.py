"""PARD: a parallel draft model guesses a chain of k tokens in one forward, reading k - 1 mask tokens appended after
the committed ones; the masks' cache rows are dropped at once, so the drafter's cache holds committed tokens only.

At T > 0 each row is drawn from the drafter's distribution at the run's temperature and verified against it by
the shared rejection rule (the official code drafts greedily; vLLM samples with draft_sample_method probabilistic).
"""

from __future__ import annotations

import torch

from ..core.cached_lm import CachedLM
from ..core.lanes import Lanes
from ..core.proposer import NO_PROPOSAL, Drafter, Feedback, Proposal, Turn, chain_of_rows, chain_prefix
from ..core.static_lm import BatchedLM, Row
from ..core.tree import chain
from ..heads.pard import FAMILY
from ..registry import implementation
from .resources import Resources


class Pard(Drafter):
    """`drafter`: its caches for the batch (`Lanes`, or what makes them)."""

    def __init__(
        self,
        drafter: Lanes | BatchedLM | CachedLM | torch.nn.Module,
        mask_token: int,
        vocab: int,
        num_draft_tokens: int = 8,
    ) -> None:
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError("pard needs num_draft_tokens >= 1")
        self.drafter = drafter if isinstance(drafter, Lanes) else Lanes(drafter)
        self.mask = mask_token
        self.vocab = vocab  # the target's: a smaller drafter vocabulary is padded with zero probability
        self.k = num_draft_tokens
        self.turns: dict[int, Turn] = {}

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        self.turns.update(zip(slots, turns, strict=True))
        self.drafter.prefill(slots, [turn.prompt for turn in turns])

    @torch.inference_mode()
    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """One forward over every slot's new tokens and masks, each slot's chain then read from its own rows."""
        greedy = all(self.turns[s].temperature == 0 for s in slots)
        ks = self.drafter.chains(self.k, tokens, max_depths, whole=greedy)
        working = [i for i, k in enumerate(ks) if k]
        self._masks([slots[i] for i in working], [len(tokens[i]) - 1 for i in working], [ks[i] for i in working])
        fed = [Row(slots[i], tokens[i][self.drafter.cached(slots[i]) :] + [self.mask] * (ks[i] - 1)) for i in working]
        found = [NO_PROPOSAL] * len(slots)
        if fed and greedy:
            deepest = max(ks[i] for i in working)  # every slot's chain in one gather: the last k of its row
            picks = iter(self.drafter.picks(fed, last=deepest))
            for i in working:
                self.drafter.crop(slots[i], len(tokens[i]))
                found[i] = Proposal(chain(next(picks)[deepest - ks[i] :]))
            return found
        for i, out in zip(working, self.drafter.run(fed) if fed else [], strict=True):
            self.drafter.crop(slots[i], len(tokens[i]))  # the masks' rows go; the committed tokens' stay
            turn = self.turns[slots[i]]
            found[i] = chain_of_rows(out.logits[-ks[i] :], turn.temperature, turn.generator, self.vocab)
        return found

    def _masks(self, slots: list[int], roots: list[int], ks: list[int]) -> None:
        """Before a forward: each of `slots` drafts `ks` tokens past its root at position `roots` (PARD-2 readies
        its mask rows' inputs here)."""

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        for slot, t in zip(slots, tokens, strict=True):
            self.drafter.follow(slot, t)


@implementation("pard", nested=chain_prefix("num_draft_tokens"), batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    dtype = res.draft_dtype(params.pop("draft_dtype", None))
    model = res.head(FAMILY.name, dtype)  # importing heads.pard registers the family
    vocab = res.target_model.get_output_embeddings().weight.shape[0]
    return Pard(res.lanes(model, "PARD draft", slots), model.pard_token, vocab, **params)
