"""Suffix decoding's statistics: where a context's suffix occurred before and what followed it, how often.

The reference (Snowflake ArcticInference `SuffixTree`, used by vLLM's `method: suffix`) keeps a compressed
suffix tree whose suffixes are cut at `depth` tokens; a node's count is the number of suffixes through it,
that is the number of occurrences of its string that fit in `depth` tokens from their start. The same counts
come from the occurrences themselves: `SuffixIndex` keeps the sequences and, per token, where it occurs;
the occurrences of a pattern are those of its last token filtered one token further back at a time, and a
continuation's count is the number of those occurrences it follows. `speculate` then scores drafts exactly as
the reference does: for every match length m, up to min(max_tokens, m * factor + offset) tokens grown from
the matched occurrences, each with probability the product of count(child) / count(parent) along its path,
kept while at least `min_prob`; the draft with the highest score (sum of probabilities) wins, a longer match
winning ties.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

Occurrence = tuple[int, int]  # (sequence id, index of the occurrence's last token)


class SuffixIndex:
    """Token sequences by id, and every position of every token in them."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.where: dict[int, list[Occurrence]] = defaultdict(list)

    def extend(self, sid: int, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(sid, [])
        for token in tokens:
            self.where[token].append((sid, len(seq)))
            seq.append(token)

    def remove(self, sid: int) -> None:
        for token in set(self.seqs.pop(sid, ())):
            kept = [o for o in self.where[token] if o[0] != sid]
            if kept:
                self.where[token] = kept
            else:
                del self.where[token]

    def token(self, occurrence: Occurrence, offset: int) -> int | None:
        """The token `offset` places after the occurrence's position, None past either end of its sequence."""
        sid, pos = occurrence
        seq, at = self.seqs[sid], pos + offset
        return seq[at] if 0 <= at < len(seq) else None


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index of each token's parent in `tokens`, -1: the root
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected number of accepted tokens if the estimated probabilities were right."""
        return sum(self.probs)


def _children(index: SuffixIndex, occurrences: list[Occurrence], offset: int) -> dict[int, list[Occurrence]]:
    """The occurrences that continue `offset` tokens on, grouped by that token (in first-seen order)."""
    groups: dict[int, list[Occurrence]] = {}
    for occurrence in occurrences:
        token = index.token(occurrence, offset)
        if token is not None:
            groups.setdefault(token, []).append(occurrence)
    return groups


def _grow(index: SuffixIndex, matched: list[Occurrence], limit: int, min_prob: float, tree: bool) -> Draft:
    """Up to `limit` tokens continuing the matched occurrences: the most probable nodes first (a tree), or the
    most frequent child at every step (a path)."""
    draft = Draft()
    order = 0  # ties in the heap go to the node found first
    heap: list[tuple[float, int, int, list[Occurrence], int, int]] = []  # (-prob, order, token, occ, offset, parent)

    def push(prob: float, occurrences: list[Occurrence], offset: int, parent: int) -> None:
        nonlocal order
        groups = _children(index, occurrences, offset)
        options = sorted(groups.items(), key=lambda kv: -len(kv[1]))[: None if tree else 1]
        for token, group in options:
            p = prob * len(group) / len(occurrences)
            if p >= min_prob:
                heapq.heappush(heap, (-p, order, token, group, offset, parent))
                order += 1

    push(1.0, matched, 1, -1)
    while heap and len(draft.tokens) < limit:
        neg_prob, _, token, group, offset, parent = heapq.heappop(heap)
        draft.tokens.append(token)
        draft.parents.append(parent)
        draft.probs.append(-neg_prob)
        if len(draft.tokens) < limit:
            push(-neg_prob, group, offset + 1, len(draft.tokens) - 1)
    return draft


def speculate(
    index: SuffixIndex,
    context: list[int],
    *,
    max_tokens: int,
    depth: int,
    factor: float = 1.0,
    offset: float = 0.0,
    min_prob: float = 0.1,
    tree: bool = True,
) -> Draft:
    """The best-scoring draft over all match lengths m < len(context) (at most `depth`), each of up to
    min(max_tokens, m * factor + offset, depth - m) tokens; an empty draft when the last token never occurred."""
    pattern = context[-depth:]
    best = Draft()
    matched = list(index.where.get(pattern[-1], ())) if pattern else []
    for m in range(1, len(pattern)):
        if m > 1:
            matched = [o for o in matched if index.token(o, 1 - m) == pattern[-m]]
        if not matched:
            break
        limit = min(max_tokens, int(m * factor + offset + 1e-6), depth - m)  # the reference's suffixes end at depth
        draft = _grow(index, matched, limit, min_prob, tree)
        if draft.score >= best.score:
            best = draft
            best.match_len = m
    return best
