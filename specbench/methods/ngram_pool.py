"""The n-gram pool Lookahead and Ouroboros draft from: continuations seen after a token, newest first.

Keyed by an n-gram's first token; each key keeps at most `capacity` continuations of `length` tokens with
least-recently-added eviction, so the pool follows the text being generated (Lookahead's `token_map`).
"""

from __future__ import annotations


class NgramPool:
    def __init__(self, length: int, capacity: int) -> None:
        self.length = length
        self.capacity = capacity
        self.entries: dict[int, dict[tuple[int, ...], None]] = {}  # key -> continuations, oldest first

    def clear(self) -> None:
        self.entries = {}

    def add(self, ngram: list[int]) -> None:
        """Store ngram[1:] under ngram[0]; adding a stored continuation again makes it the newest."""
        if len(ngram) != self.length + 1:
            raise ValueError(f"expected an n-gram of {self.length + 1} tokens, got {len(ngram)}")
        kept = self.entries.setdefault(ngram[0], {})
        value = tuple(ngram[1:])
        kept.pop(value, None)
        kept[value] = None
        if len(kept) > self.capacity:
            del kept[next(iter(kept))]

    def add_sequence(self, tokens: list[int]) -> None:
        """Every n-gram of a token sequence, in order (the last occurrence ends up newest)."""
        for start in range(len(tokens) - self.length):
            self.add(tokens[start : start + self.length + 1])

    def candidates(self, key: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations stored under `key`, newest first."""
        kept = list(self.entries.get(key, ()))
        return [list(c) for c in kept[: -limit - 1 : -1]]
