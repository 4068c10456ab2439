"""Ouroboros (Zhao et al. 2024): a draft model that drafts phrases, itself accelerated by lookahead decoding.

Drafting: the draft model runs Lookahead decoding on itself (its own Jacobi window and the phrase pool),
so one draft forward can add several tokens, until at least gamma are drafted. Verification: one target
forward over a tree, the draft chain plus up to topk pooled phrases that continue its last token. The pool is
shared: the draft's lookahead fills it, and every token the target commits refreshes it.

Sampling stays lossless: the draft samples its chain with the shared rejection rule against its own
distribution q (pool phrases are point masses there), so each drafted token is an exact draw from q given
its prefix and its row of draft_probs is that q; the pooled phrases after the chain are point masses
(one-hot rows). Each draft is cut to exactly gamma tokens, as the reference does (a phrase can overshoot).

One deliberate deviation: the reference (greedy only) also rewrites pool entries from the target's logits at
rejected positions; the loop gives proposers the committed tokens only (the target's token at a rejection is
committed, so the corrected n-gram still enters the pool, one step later). On the bundled tiny family the
appended counts equal the reference's at all 131 roots both runs verify from (tests/test_reference_traces.py).
"""

from __future__ import annotations

import torch

from ..core import acceptance
from ..core.cached_lm import CachedLM
from ..core.one_slot import single
from ..core.own_step import verify
from ..core.proposer import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn
from ..core.sampling import probabilities
from ..core.static_lm import Row
from ..core.tree import trie
from ..registry import implementation
from .lookahead import Lookahead
from .resources import Resources


class Ouroboros(Proposer):
    def __init__(
        self,
        draft_model,
        num_draft_tokens: int = 12,
        ngram_size: int = 7,
        window_size: int = 20,
        guess_set_size: int = 20,
        topk: int = 3,
        pool_from_prompt: bool = False,
        layout: str = "reference",
    ) -> None:
        if num_draft_tokens < 1 or topk < 0:
            raise ValueError("ouroboros needs num_draft_tokens >= 1 and topk >= 0")
        self.draft = single(CachedLM(draft_model) if isinstance(draft_model, torch.nn.Module) else draft_model)
        self.drafter = Lookahead(ngram_size, window_size, guess_set_size, pool_from_prompt, layout)
        self.gamma = num_draft_tokens
        self.topk = topk

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.drafter.start(turn)
        self.verified = len(turn.prompt)  # tokens the pool has learned from
        self.draft.prefill([0], [turn.prompt])

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        gamma = min(self.gamma, max_depth)
        if gamma < 1 or len(tokens) + gamma + self.drafter.reach > self.draft.context_length:
            return NO_PROPOSAL
        cached = self.draft.lengths[0]
        if cached < len(tokens) - 1:
            self.draft.run([Row(0, tokens[cached:-1])], last_only=True)
        drafted: list[int] = []
        q_rows: list[torch.Tensor] = []
        while len(drafted) < gamma:
            new, q = self._draft_step([*tokens, *drafted])
            drafted.extend(new)
            q_rows.extend(q)
        drafted, q_rows = drafted[:gamma], q_rows[:gamma]  # a phrase can overshoot: the reference cuts at gamma
        phrases = self.drafter.pool.candidates(drafted[-1], self.topk)
        tree = trie([drafted, *(drafted + phrase for phrase in phrases)])
        if self.temperature == 0:
            return Proposal(tree)
        chain_q = torch.stack(q_rows)  # [len(drafted), V]
        phrase_q = torch.nn.functional.one_hot(
            torch.tensor(tree.tokens[len(drafted) :], dtype=torch.long), chain_q.shape[-1]
        )
        return Proposal(tree, torch.cat([chain_q, phrase_q.to(chain_q)]))

    def _draft_step(self, seq: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """One draft forward over its own lookahead proposal after seq[-1]: the tokens it keeps (at least one)
        and, when sampling, the draft distribution each was drawn from (q [V] per token)."""
        proposal = self.drafter.propose(seq, self.drafter.reach)
        step = verify(self.draft, seq[-1], proposal, acceptance.EXACT, self.temperature, self.generator)
        n = len(proposal.tree) + 1
        q_rows = [] if self.temperature == 0 else list(probabilities(step.output.logits[step.kept], self.temperature))
        new = step.new
        self.drafter.update(
            [*seq, *new],
            proposal,
            Feedback(step.accepted, side_logits=step.output.logits[n:], side_picks=step.side_picks),
        )
        return new, q_rows

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        self.draft.rewind(0, min(self.draft.lengths[0], len(tokens) - 1))  # valid up to the last accepted token
        self.drafter.pool.add_sequence(tokens[max(0, self.verified - self.drafter.pool.length) :])
        self.verified = len(tokens)


@implementation("ouroboros")
def build(params: dict, res: Resources) -> Proposer:
    return Ouroboros(res.draft_lm(), **params)
