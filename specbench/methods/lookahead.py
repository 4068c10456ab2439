"""Lookahead decoding (Fu et al. 2024): the target drafts for itself, no extra model or head.

One target forward carries three branches: the root, the verification branch (up to G pooled (N-1)-grams
that start with the root, merged into a tree) and the lookahead branch (the Jacobi window, as side tokens
whose cache rows the commit drops). The window's predictions become the n-grams of later verification
branches; as in the reference, nothing is verified until the window has warmed up. Every candidate is a
point mass, so sampling with the shared residual rule stays lossless.

One deliberate deviation: when all N - 1 tokens of a pooled n-gram match, lade (release 0.0.4, `decoding.py`
1078-1084, and its main branch at eed010d) commits them without the target's own next token; the shared loop
always commits that token too. So does commit 0e9f02d, an unmerged pull request to lade
(hao-ai-lab/LookaheadDecoding #68): this module matches 0e9f02d step for step, not lade's main.
"""

from __future__ import annotations

from ..core.proposer import Feedback, Proposal, Proposer, Turn
from ..core.tree import EMPTY, trie
from ..registry import implementation
from .jacobi import JacobiWindow
from .ngram_pool import NgramPool
from .resources import Resources


class Lookahead(Proposer):
    def __init__(
        self,
        ngram_size: int = 5,
        window_size: int = 7,
        guess_set_size: int = 7,
        pool_from_prompt: bool = False,
        layout: str = "reference",
    ) -> None:
        if ngram_size < 2 or window_size < 1 or guess_set_size < 1:
            raise ValueError("lookahead needs ngram_size >= 2, window_size >= 1 and guess_set_size >= 1")
        self.window = JacobiWindow(ngram_size - 1, window_size, layout)
        self.pool = NgramPool(ngram_size - 1, guess_set_size)
        self.guess_set_size = guess_set_size
        self.pool_from_prompt = pool_from_prompt

    @property
    def reach(self) -> int:
        """Largest position offset from the root a proposal uses."""
        return max(self.pool.length, self.window.reach)

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.pool.clear()
        if self.pool_from_prompt:
            self.pool.add_sequence(turn.prompt)
        self.window.reset(turn.prompt, turn.generator)

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        self.root = tokens[-1]
        tree = trie(self.pool.candidates(self.root, self.guess_set_size)) if self.window.ready else EMPTY
        return Proposal(tree, side=self.window.side(len(tree)))

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        if feedback.side_logits is None:  # the loop dropped the window (token budget nearly spent)
            return
        picks = feedback.side_picks
        if picks is None:  # sampling: the verification did not read them
            picks = feedback.side_logits.argmax(dim=-1).tolist()
        for ngram in self.window.advance(picks, self.root):
            self.pool.add(ngram)


@implementation("lookahead")
def build(params: dict, res: Resources) -> Proposer:
    return Lookahead(**params)
