"""Lookahead decoding's lookahead branch: a window of Jacobi iterations verified as side tokens.

The window holds N - 1 levels (past Jacobi iterations) over W columns. The token at level l, column j reads
level 0 up to column j, then column j's tokens at levels 1..l, so each column reads as one causal sequence
and the target's argmax at its top token extends it by one: an n-gram (column j, levels 0..N-2, plus that
prediction) for the pool. Each step the outputs become the newest level and the oldest is dropped: one
Jacobi iteration per target forward. Two layouts:

- `reference` (hao-ai-lab/LookaheadDecoding): column 0 of level 0 is the root itself, so column 0's n-gram is
  keyed on the root; level 0 holds W - 1 guesses, (l, j) sits l + j positions after the root. The window
  starts as W + N - 3 tokens drawn at random from the prompt, as one causal run after the root, and follows
  the root one column per step for N - 2 warm-up steps, each adding a level, until it is N - 1 levels by W.
- `shifted` (this project's first layout): every level holds W tokens and (l, j) sits l + j + 1 positions after
  the root, so no column is keyed on the root; it starts from the context's last W tokens and adds a level
  per warm-up step.
"""

from __future__ import annotations

import torch

from ..core.cached_lm import SideBranch

LAYOUTS = ("reference", "shifted")


def window_cells(levels: int, width: int, root_column: bool) -> list[tuple[int, int]]:
    """The (level, column) cells that are side tokens, level by level; with root_column, (0, 0) is the root."""
    first = 1 if root_column else 0
    return [(0, j) for j in range(first, width)] + [(lv, j) for lv in range(1, levels) for j in range(width)]


def lookahead_mask(levels: int, width: int, root_column: bool = False) -> torch.Tensor:
    """Bool [m, m] over the side cells (window_cells order): entry (r, c) says cell r sees cell c."""
    cells = torch.tensor(window_cells(levels, width, root_column)).reshape(-1, 2)  # [m, 2]
    level, column = cells[:, 0], cells[:, 1]
    base = (level[None, :] == 0) & (column[None, :] <= column[:, None])  # the level-0 triangle
    band = (level[None, :] >= 1) & (level[None, :] <= level[:, None]) & (column[None, :] == column[:, None])
    return base | band


def lookahead_offsets(levels: int, width: int, root_column: bool = False) -> list[int]:
    """Positions of the side cells after the root's: (l, j) at l + j, plus one without the root column."""
    shift = 0 if root_column else 1
    return [level + column + shift for level, column in window_cells(levels, width, root_column)]


class JacobiWindow:
    def __init__(self, levels: int, width: int, layout: str = "reference") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"lookahead layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if layout == "reference" and levels < 2:
            raise ValueError("the reference lookahead layout needs ngram_size >= 3 (window levels >= 2)")
        self.levels = levels
        self.width = width
        self.root_column = layout == "reference"
        self.rows: list[list[int]] = []  # oldest level first; level 0 without the root column

    def reset(self, context: list[int], generator: torch.Generator | None = None) -> None:
        """Start from a first guess only; the other levels fill up over the first N - 2 steps."""
        if self.root_column:  # as the reference: tokens drawn at random from the prompt (here seeded)
            size = self.width + self.levels - 2  # W + N - 3
            device = generator.device if generator is not None else "cpu"
            picks = torch.randint(len(context), (size,), generator=generator, device=device).tolist()
            self.rows = [[context[i] for i in picks]]
        else:  # the context's last W tokens, cycled when shorter
            self.rows = [[context[(len(context) - self.width + j) % len(context)] for j in range(self.width)]]

    @property
    def ready(self) -> bool:
        """Warm-up done: every level is filled and each step harvests n-grams."""
        return len(self.rows) == self.levels

    @property
    def columns(self) -> int:
        return len(self.rows[0]) + self.root_column

    @property
    def reach(self) -> int:
        """Largest position offset from the root the window uses (the reference's first guess is its widest)."""
        return self.levels + self.width - 1 - self.root_column

    def side(self, tree_size: int) -> SideBranch:
        """The window as side tokens after [root] + a tree of `tree_size` nodes: they see the root, not the tree."""
        levels, width = len(self.rows), self.columns
        tokens = [token for row in self.rows for token in row]
        m = len(tokens)
        allowed = torch.zeros(m, 1 + tree_size + m, dtype=torch.bool)
        allowed[:, 0] = True
        allowed[:, 1 + tree_size :] = lookahead_mask(levels, width, self.root_column)
        return SideBranch(tokens, lookahead_offsets(levels, width, self.root_column), allowed)

    def advance(self, side_picks: list[int], root: int) -> list[list[int]]:
        """One Jacobi iteration from the target's argmax at the side tokens [m] of a step verified from `root`;
        returns the finished n-grams."""
        outputs = side_picks[-len(self.rows[-1]) :]  # the newest level's predictions
        if not self.ready:
            if not self.root_column:
                self.rows.append(outputs)
            elif len(self.rows) == 1:  # level 0 lacks column 0: its outputs already align one column left
                self.rows = [self.rows[0][1:], outputs]
            else:  # the window follows the root one column: every level drops its first column
                self.rows = [*(row[1:] for row in self.rows), outputs[1:]]
            return []
        columns = [[root, *self.rows[0]] if self.root_column else self.rows[0], *self.rows[1:]]
        ngrams = [[row[j] for row in columns] + [outputs[j]] for j in range(self.width)]
        self.rows = [*self.rows[1:], outputs]
        if self.root_column:  # column 0 of the new level 0 is the next root
            self.rows[0] = self.rows[0][1:]
        return ngrams
