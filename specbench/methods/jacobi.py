"""Lookahead decoding's lookahead branch: a window of Jacobi iterations verified as side tokens.

The window holds `levels` (N - 1) past Jacobi iterations over `width` (W) columns. Level 0 is a guess of the
W tokens after the root; the token at level l, column j sits l + j + 1 positions after the root and continues
column j's trajectory: it sees level 0 up to column j, then column j's tokens at levels 1..l. So each column
reads as one causal sequence and the target's argmax at its top token extends it by one: an n-gram
(column j, levels 0..N-2, plus that prediction) for the pool. Each step the outputs become the newest level
and the oldest is dropped: one Jacobi iteration per target forward.
"""

from __future__ import annotations

import torch

from ..cached_lm import SideBranch


def lookahead_mask(levels: int, width: int) -> torch.Tensor:
    """Bool [levels*W, levels*W] over side rows ordered level by level: entry (r, c) says row r sees row c."""
    level = torch.arange(levels).repeat_interleave(width)  # [L*W]
    column = torch.arange(width).repeat(levels)  # [L*W]
    base = (level[None, :] == 0) & (column[None, :] <= column[:, None])  # the level-0 triangle
    band = (level[None, :] >= 1) & (level[None, :] <= level[:, None]) & (column[None, :] == column[:, None])
    return base | band


def lookahead_offsets(levels: int, width: int) -> list[int]:
    """Positions of the side rows after the root's: level l, column j at l + j + 1."""
    return [level + column + 1 for level in range(levels) for column in range(width)]


class JacobiWindow:
    def __init__(self, levels: int, width: int) -> None:
        self.levels = levels
        self.width = width
        self.rows: list[list[int]] = []  # oldest level first, each W tokens

    def reset(self, context: list[int]) -> None:
        """Start from a first guess only: the context's last W tokens (cycled when shorter); the other levels
        fill up over the first N - 2 steps, which harvest nothing."""
        self.rows = [[context[(len(context) - self.width + j) % len(context)] for j in range(self.width)]]

    @property
    def reach(self) -> int:
        """Largest position offset from the root the window uses."""
        return self.levels + self.width - 1

    def side(self, tree_size: int) -> SideBranch:
        """The window as side tokens after [root] + a tree of `tree_size` nodes: they see the root, not the tree."""
        levels = len(self.rows)
        m = levels * self.width
        allowed = torch.zeros(m, 1 + tree_size + m, dtype=torch.bool)
        allowed[:, 0] = True
        allowed[:, 1 + tree_size :] = lookahead_mask(levels, self.width)
        tokens = [token for row in self.rows for token in row]
        return SideBranch(tokens, lookahead_offsets(levels, self.width), allowed)

    def advance(self, side_logits: torch.Tensor) -> list[list[int]]:
        """One Jacobi iteration from the logits at the side rows [levels*W, V]; returns the finished n-grams."""
        outputs = side_logits[-self.width :].argmax(dim=-1).tolist()
        if len(self.rows) < self.levels:
            self.rows.append(outputs)
            return []
        ngrams = [[row[j] for row in self.rows] + [outputs[j]] for j in range(self.width)]
        self.rows = [*self.rows[1:], outputs]
        return ngrams
