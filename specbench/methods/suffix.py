"""Suffix decoding (Oliaro et al. 2024; Snowflake ArcticInference, vLLM `method: suffix`): model-free drafts
from what followed the context's suffix in this request's prompt and in earlier answers.

Two indexes, as the reference's `SuffixDecodingCache`: a local one over this turn's prompt and the tokens
committed so far, and a global one over the answers of earlier requests (and the growing answer of this one),
at most `max_cached_requests` of them, oldest evicted first (0 turns the global one off). Each step drafts
from both and keeps the better-scoring draft (`suffix_index.speculate`); candidates are point masses, so the
shared rules keep greedy output identical and sampling exact.

Scope of the global index, so that no answer leaks into its own timing: it lives in one proposer, that is one
method (variants included) in one run, and sees the answers of the questions that method already answered,
in the run's question order. A request is `Turn.request`, (question, turn number) (the prompt as a one-turn
question when the caller names none). Answering a question again restarts its conversation: the cached
answers of that turn and the later ones are evicted first, as the reference does for a reused request id. So
neither the warm-up nor an earlier repeat of a question feeds its timed answer, while a later turn still sees
the earlier turns, and two questions that share a prompt feed each other. A resumed run starts empty. A batch's
slots (`run --batch`) share one global index, as a serving engine's requests share its cache: a slot drafts from
its batch-mates' answers too, those in progress included, so suffix decoding's acceptance moves with B.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ..core.proposer import NO_PROPOSAL, Drafter, Feedback, PerSlot, Proposal, Proposer, Turn
from ..core.tree import Tree
from ..registry import implementation
from .resources import Resources
from .suffix_index import SuffixIndex, speculate

LOCAL = 0  # the local index's one sequence id


class Answers:
    """The global index: the answers of earlier requests and the growing ones, one sequence each, at most `most` of
    them (oldest evicted first)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.index = SuffixIndex()
        self.requests: dict[tuple[Hashable, int], int] = {}  # (question, turn) -> its answer's id, oldest first
        self.next_id = 0

    def begin(self, key: tuple[Hashable, int]) -> int:
        """A new answer to request `key`: its id (that turn's and the later turns' earlier answers evicted)."""
        for old in [k for k in self.requests if k[0] == key[0] and k[1] >= key[1]]:  # answered again: restart
            self.index.remove(self.requests.pop(old))
        while len(self.requests) >= self.most:
            self.index.remove(self.requests.pop(next(iter(self.requests))))
        self.requests[key] = self.next_id
        self.next_id += 1
        return self.next_id - 1

    def extend(self, answer: int, tokens: list[int]) -> None:
        """Tokens of an answer in progress (none once it is evicted)."""
        if answer in self.requests.values():
            self.index.extend(answer, tokens)


class SuffixDecoding(Proposer):
    def __init__(
        self,
        max_spec_tokens: int = 32,
        max_tree_depth: int = 24,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = 10000,
        tree: bool = True,
    ) -> None:
        if max_spec_tokens < 1 or max_tree_depth < 2 or max_spec_factor < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError(
                "suffix needs max_spec_tokens >= 1, max_tree_depth >= 2, max_spec_factor >= 0 and "
                "0 <= min_token_prob <= 1"
            )
        if max_cached_requests < 0:
            raise ValueError("suffix needs max_cached_requests >= 0 (0 turns the global index off)")
        self.options: dict[str, Any] = dict(  # `speculate`'s keywords
            depth=max_tree_depth, factor=max_spec_factor, offset=max_spec_offset, min_prob=min_token_prob, tree=tree
        )
        self.max_spec_tokens = max_spec_tokens
        self.answers = Answers(max_cached_requests)

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.local = SuffixIndex()
        self.local.extend(LOCAL, turn.prompt)
        self.seen = len(turn.prompt)
        self.current: int | None = None
        if self.answers.most > 0:
            self.current = self.answers.begin(turn.request if turn.request is not None else (tuple(turn.prompt), 0))

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        limit = min(self.max_spec_tokens, max_depth)
        if limit < 1:
            return NO_PROPOSAL
        indexes = (self.local, self.answers.index)
        drafts = [speculate(index, tokens, max_tokens=limit, **self.options) for index in indexes]
        best = max(drafts, key=lambda d: d.score)  # the local draft on a tie, as the reference
        return Proposal(Tree(best.tokens, best.parents)) if best.tokens else NO_PROPOSAL

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        new = tokens[self.seen :]
        self.seen = len(tokens)
        self.local.extend(LOCAL, new)
        if self.current is not None:
            self.answers.extend(self.current, new)


@implementation("suffix", batched=True)
def build(params: dict, res: Resources | None, slots: int) -> Drafter:
    proposers = [SuffixDecoding(**params) for _ in range(slots)]
    for proposer in proposers[1:]:  # a batch's slots share one pool of answers
        proposer.answers = proposers[0].answers
    return PerSlot(proposers)
