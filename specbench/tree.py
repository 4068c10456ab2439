"""The token tree a proposer hands to the target, and what is derived from it (mask, positions, paths).

Indexing: the verification input is [root] + tree tokens, where the root is the last committed token
(not yet in the target's KV cache). Node i of the tree is input row i + 1; `parents[i]` is the parent's
tree index, or -1 for a child of the root. Parents always come before their children.
A chain is a tree whose node i has parent i - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: list[int]
    parents: list[int]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede children")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def max_depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self) -> list[list[int]]:
        """Input-row indices of the children of every input row (row 0 = root)."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i + 1)
        return kids

    def path(self, row: int) -> list[int]:
        """Input rows from the first node under the root down to `row` (empty for the root)."""
        rows: list[int] = []
        while row > 0:
            rows.append(row)
            row = self.parents[row - 1] + 1
        return rows[::-1]

    def subtree(self, keep: list[int]) -> Tree:
        """The tree of nodes `keep` (ascending, closed under parents), re-indexed."""
        new_index = {old: new for new, old in enumerate(keep)}
        return Tree(
            [self.tokens[i] for i in keep],
            [new_index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
        )


def chain(tokens: list[int]) -> Tree:
    return Tree(list(tokens), list(range(-1, len(tokens) - 1)))


EMPTY = Tree([], [])


def ancestor_matrix(tree: Tree) -> torch.Tensor:
    """Bool [n+1, n+1]: entry (i, j) says input row i may attend to row j (j is i or an ancestor)."""
    n = len(tree) + 1
    allowed = torch.zeros(n, n, dtype=torch.bool)
    allowed[0, 0] = True
    for i, p in enumerate(tree.parents):
        allowed[i + 1] = allowed[p + 1]
        allowed[i + 1, i + 1] = True
    return allowed


def attention_mask(
    tree: Tree,
    past_len: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    side: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive 4D mask [1, 1, n+1+m, past_len+n+1+m]: 0 where attention is allowed, the dtype's min elsewhere.

    `side` (bool [m, n+1+m]) appends m side-branch rows that see the cached prefix plus the new rows it marks;
    tree rows never see side rows, so the tree's logits are exactly those of a tree-only forward.
    """
    n = len(tree) + 1
    m = 0 if side is None else side.shape[0]
    allowed = torch.ones(n + m, past_len + n + m, dtype=torch.bool)
    allowed[:n, past_len:] = False
    allowed[:n, past_len : past_len + n] = ancestor_matrix(tree)
    if side is not None:
        allowed[n:, past_len:] = side
    mask = torch.zeros(n + m, past_len + n + m, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def position_ids(tree: Tree, past_len: int, device: torch.device | str = "cpu", side: list[int] | None = None):
    """Positions [1, n+1+m]: the root sits at past_len, a node at past_len + its depth, a side token at
    past_len + its given offset."""
    offsets = [0, *tree.depths(), *(side or [])]
    return torch.tensor([[past_len + d for d in offsets]], device=device)
