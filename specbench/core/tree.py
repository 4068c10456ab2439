"""The token tree a proposer hands to the target, and what is derived from it (mask, positions, paths).

Indexing: the verification input is [root] + tree tokens, where the root is the last committed token
(not yet in the target's KV cache). Node i of the tree is input row i + 1; `parents[i]` is the parent's
tree index, or -1 for a child of the root. Parents always come before their children.
A chain is a tree whose node i has parent i - 1.

A proposer that drafts on the device may hand over a `DeviceTree`: the target verifies it from there and the host
reads it once, with the target's picks (`Tree.read_along`), so a greedy step waits on the device only once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import cast

import torch

from .transfer import upload


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
        return is_chain(self.parents)

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def max_depth(self) -> int:
        return max(self.depths(), default=0)

    def depth_bound(self) -> int:
        """No node is deeper than this (exact here; a `DeviceTree` whose shape is on the device knows a bound)."""
        return self.max_depth()

    @property
    def home(self) -> torch.device:
        """Where the tree's shape lives: the mask and positions derived from it are built there."""
        return torch.device("cpu")

    def parents_tensor(self) -> torch.Tensor:
        return torch.tensor(self.parents, dtype=torch.long)

    def rows(self, root: int) -> list[int] | torch.Tensor:
        """The verification input's tokens: [root] + the tree's."""
        return [root, *self.tokens]

    def read_along(self, values: torch.Tensor) -> list[int]:
        """`values` (integers) on the host; a tree still on the device comes with them, in the same transfer."""
        return values.tolist()

    @property
    def on_device(self) -> bool:
        """Whether its tokens are still on the device (`read_along` brings them)."""
        return False

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
        return Tree([self.tokens[i] for i in keep], reindexed(self.parents, keep))


class DeviceTree(Tree):
    """A tree whose tokens (and, when they depend on the draft, parents) are still tensors on the device. Its size
    and a depth bound are known on the host; reading `tokens` or `parents` costs one transfer, made once. A tree
    cut to a depth without reading it (`limited`) keeps its deeper nodes as rows that no verdict accepts."""

    ids: torch.Tensor
    links: torch.Tensor | list[int]
    bound: int
    read: tuple[list[int], list[int]] | None
    limit: int | None  # set: nodes deeper than this are verified but never accepted (greedy, inside the forward)

    def __init__(
        self, tokens: torch.Tensor, parents: torch.Tensor | list[int], depth: int, ancestors: torch.Tensor | None = None
    ) -> None:
        object.__setattr__(self, "ids", tokens)  # [n] long
        object.__setattr__(self, "links", parents)  # [n] long on the device, or the host's list
        object.__setattr__(self, "bound", depth)
        object.__setattr__(self, "read", None)  # (tokens, parents) once read
        object.__setattr__(self, "limit", None)
        if ancestors is not None:  # built with the draft (inside its captured graph)
            self.__dict__["ancestors"] = ancestors

    def limited(self, depth: int) -> DeviceTree:
        """This tree cut to `depth` without a read or an index: the same rows, those deeper never accepted (the token
        budget's last steps, verified greedily inside the forward: `acceptance.greedy_batch`'s `limit`)."""
        cut = DeviceTree(self.ids, self.links, self.bound, self.__dict__.get("ancestors"))  # (a chain needs none)
        object.__setattr__(cut, "limit", depth)
        return cut

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and (self.tokens, self.parents) == (other.tokens, other.parents)

    @property
    def tokens(self) -> list[int]:
        return self._host()[0]

    @property
    def parents(self) -> list[int]:
        return self.links if isinstance(self.links, list) else self._host()[1]

    @property
    def shape_on_device(self) -> bool:
        return isinstance(self.links, torch.Tensor) and self.read is None

    @property
    def is_chain(self) -> bool:
        """Whether the tree is known to be a chain without reading it (a drafted shape is not assumed one)."""
        return not self.shape_on_device and super().is_chain

    def depth_bound(self) -> int:
        bound = self.bound if self.shape_on_device else self.max_depth()
        return bound if self.limit is None else min(bound, self.limit)

    @property
    def home(self) -> torch.device:
        return cast(torch.Tensor, self.links).device if self.shape_on_device else torch.device("cpu")

    def parents_tensor(self) -> torch.Tensor:
        return cast(torch.Tensor, self.links) if self.shape_on_device else Tree.parents_tensor(self)

    def rows(self, root: int) -> list[int] | torch.Tensor:
        if self.read is not None:
            return Tree.rows(self, root)
        return torch.cat([self.ids.new_full((1,), root), self.ids])

    @property
    def on_device(self) -> bool:
        return self.read is None

    def read_along(self, values: torch.Tensor) -> list[int]:
        if self.read is not None:
            return values.tolist()
        shape = [self.links] if isinstance(self.links, torch.Tensor) else []  # a drafted shape comes too
        n, m = len(self.ids), len(values)
        flat: list[int] = torch.cat([self.ids, values.to(self.ids.device, torch.long), *shape]).tolist()
        object.__setattr__(self, "read", (flat[:n], flat[n + m :] if shape else self.links))
        return flat[n : n + m]

    def subtree(self, keep: list[int]) -> Tree:
        if not isinstance(self.links, list) or self.read is not None:
            return Tree.subtree(self, keep)
        ids = self.ids[upload(keep, self.ids.device)]
        return DeviceTree(ids, reindexed(self.links, keep), self.bound)  # the shape known here: no read

    @functools.cached_property
    def ancestors(self) -> torch.Tensor:
        """Its ancestor matrix, built on the device once: the verification's mask and positions both read it."""
        return ancestors_from(self.parents_tensor(), self.bound if self.shape_on_device else self.max_depth())

    def _host(self) -> tuple[list[int], list[int]]:
        if self.read is None:
            self.read_along(self.ids[:0])
        assert self.read is not None
        return self.read


def is_chain(parents: list[int]) -> bool:
    """Whether a tree of these parents is a chain (each node the child of the one before)."""
    return all(p == i - 1 for i, p in enumerate(parents))


def reindexed(parents: list[int], keep: list[int]) -> list[int]:
    """The parents of nodes `keep` (ascending, closed under parents) as indices into `keep`."""
    new_index = {old: new for new, old in enumerate(keep)}
    return [new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep]


def chain(tokens: list[int] | torch.Tensor) -> Tree:
    """A chain of the tokens: a host list, or ids [n] on the device (a `DeviceTree` whose shape the host knows)."""
    n = tokens.shape[0] if isinstance(tokens, torch.Tensor) else len(tokens)  # (a tensor's len costs more)
    parents = list(range(-1, n - 1))
    return DeviceTree(tokens, parents, n) if isinstance(tokens, torch.Tensor) else Tree(list(tokens), parents)


def trie(sequences: list[list[int]]) -> Tree:
    """Candidate continuations of the root as one tree: sequences sharing a prefix share its nodes, so the
    target reads each distinct prefix once. Nodes keep the order in which the sequences first reach them."""
    tokens: list[int] = []
    parents: list[int] = []
    node: dict[tuple[int, int], int] = {}  # (parent index, token) -> node index
    for seq in sequences:
        parent = -1
        for token in seq:
            if (parent, token) not in node:
                node[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node[parent, token]
    return Tree(tokens, parents)


EMPTY = Tree([], [])


def ancestor_matrix(tree: Tree) -> torch.Tensor:
    """Bool [n+1, n+1] on the tree's home: entry (i, j) says input row i may attend to row j (j is i or an
    ancestor)."""
    if isinstance(tree, DeviceTree) and tree.shape_on_device:
        return tree.ancestors
    return ancestors_from(tree.parents_tensor(), tree.max_depth())  # (every row's, past a `limited` cut too)


def ancestors_from(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """The ancestor matrix [..., n+1, n+1] of the trees whose nodes' parents are `parents` [..., n] (-1: the root;
    a batch's trees [B, n], each its own), none deeper than `depth`, on their device."""
    lead, n, home = parents.shape[:-1], parents.shape[-1] + 1, parents.device
    parent = torch.cat([parents.new_full((*lead, 1), -1), parents], dim=-1) + 1  # each row's parent row; the root's
    node = torch.arange(n, device=home).expand_as(parent)  # is itself
    allowed = torch.eye(n, dtype=torch.bool, device=home).expand(*lead, n, n).clone()
    for _ in range(depth):  # climb one level at a time: whole rows at once, not node by node
        node = parent.gather(-1, node)
        allowed.scatter_(-1, node[..., None], True)  # not `allowed[rows, node] = True`: its value is a host tensor,
    return allowed  # which a CUDA graph's capture refuses to copy


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
    local = new_rows_allowed(tree, side)
    allowed = torch.ones(len(local), past_len + len(local), dtype=torch.bool, device=tree.home)
    allowed[:, past_len:] = local
    return additive_mask(allowed, dtype, device)


def new_rows_allowed(tree: Tree, side: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [n+1+m, n+1+m] on the tree's home: which of a verification's new rows each row sees (a tree row: its
    ancestors and itself; a side row: what `side` marks)."""
    if side is None:
        return ancestor_matrix(tree)
    n, m = len(tree) + 1, side.shape[0]
    allowed = torch.zeros(n + m, n + m, dtype=torch.bool, device=tree.home)
    allowed[:n, :n] = ancestor_matrix(tree)
    allowed[n:] = upload(side, tree.home)
    return allowed


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [..., keys] -> additive, on its device: 0 where allowed, the dtype's min elsewhere, as (allowed - 1) x
    the dtype's max (no host values: a captured graph builds it; arithmetic, where a CPU's masked fill over a
    batch's mask took several times as long)."""
    return allowed.to(dtype).sub_(1).mul_(torch.finfo(dtype).max)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [rows, keys] -> additive [1, 1, rows, keys] on `device`."""
    return upload(additive(allowed, dtype), torch.device(device))[None, None]


def position_ids(tree: Tree, past_len: int, device: torch.device | str = "cpu", side: list[int] | None = None):
    """Positions [1, n+1+m]: the root sits at past_len, a node at past_len + its depth, a side token at
    past_len + its given offset."""
    if isinstance(tree, DeviceTree) and tree.shape_on_device:  # a row's depth: its ancestors, the root's 0
        depths = ancestor_matrix(tree).sum(-1) - 1
        if side:
            depths = torch.cat([depths, upload(side, depths.device)])
        return (depths + past_len).to(device)[None]
    offsets = [0, *tree.depths(), *(side or [])]
    return upload([past_len + d for d in offsets], torch.device(device))[None]


def from_choices(choices: list[list[int]], max_rank: int | None = None) -> Tree:
    """The template tree of a published static tree given as paths of ranks ("choices", Medusa/EAGLE-1 format).

    Path [a, b] is the node reached by taking candidate a under the root, then candidate b under it. The
    template's `tokens` hold each node's last rank; a method fills in the real tokens. Paths are ordered by
    (length, ranks) so parents precede children; with `max_rank` paths using a rank >= max_rank are dropped
    (a vocabulary smaller than the tree's branching).
    """
    paths = sorted({tuple(p) for p in choices}, key=lambda p: (len(p), p))
    if max_rank is not None:
        paths = [p for p in paths if max(p, default=0) < max_rank]
    index = {p: i for i, p in enumerate(paths)}
    parents: list[int] = []
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"tree path {list(p)} must be a non-empty list of ranks >= 0")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return Tree([p[-1] for p in paths], parents)


__all__ = [
    "EMPTY",
    "DeviceTree",
    "Tree",
    "additive",
    "additive_mask",
    "ancestor_matrix",
    "attention_mask",
    "chain",
    "from_choices",
    "position_ids",
    "trie",
]
