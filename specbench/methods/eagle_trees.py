"""EAGLE's token trees: the candidates a draft holds (`Draft`, tensors on the head's device, a whole level at a time)
and the two expansion policies that decide which candidates become nodes, which nodes grow children, and which
nodes are sent to the target:

- StaticTree (EAGLE-1): the published tree of ranks; a node's children are its parent's top-ranked guesses.
- DynamicTree (EAGLE-2 and EAGLE-3): every grown node offers top_k children scored by cumulative draft
  log-probability; the top_k best of each level grow, and the best `total_tokens - 1` of all candidates are
  verified with the root: `total_tokens` counts the verified rows, root included, as the reference's total_token.
  A sampled dynamic tree keeps the first `total_tokens - 1` candidates in the order they were drawn instead
  (methods.eagle says why)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from ..core.tree import Tree


@dataclass
class Draft:
    """Drafted candidates in creation order: level by level, within a level by parent then by rank, so parents
    come first and the nodes of depth <= d are a prefix. Tensors on the head's device, [n] for one sequence or
    [B, n] for a batch's (drafted together: `row` is one of them)."""

    tokens: torch.Tensor  # target ids (long)
    parents: torch.Tensor  # the parent's index (long); -1 is the root
    scores: torch.Tensor  # cumulative draft log-probability (float64: float32 steps summed in float64)
    depths: torch.Tensor  # long; children of the root have depth 1
    places: torch.Tensor | None = None  # StaticTree: each node's template place (long)
    laws: torch.Tensor | None = None  # sampled: the law each token was drawn from [n, V]

    @staticmethod
    def empty(device: torch.device) -> Draft:
        """No candidates, as a batch of one sequence's [1, 0]."""
        none = torch.empty(1, 0, dtype=torch.long, device=device)
        return Draft(none, none, torch.empty(1, 0, dtype=torch.float64, device=device), none)

    def __len__(self) -> int:
        return self.tokens.shape[-1]

    def _map(self, op: Callable[[torch.Tensor], torch.Tensor]) -> Draft:
        places, laws = self.places, self.laws
        return Draft(
            op(self.tokens),
            op(self.parents),
            op(self.scores),
            op(self.depths),
            None if places is None else op(places),
            None if laws is None else op(laws),
        )

    def row(self, i: int) -> Draft:
        """Sequence i's draft of a batch's."""
        return self._map(lambda t: t[i])

    def upto(self, depth: int) -> Draft:
        """The nodes of depth <= depth (a prefix)."""
        n = int((self.depths <= depth).sum())
        return self._map(lambda t: t[:n])

    @staticmethod
    def joined(levels: list[Draft]) -> Draft:
        """The levels one after the other (each level's parents index the ones before it), joined once."""
        if len(levels) == 1:
            return levels[0]
        return Draft(
            *(  # type: ignore[arg-type]  # (fields() loses which fields may be None)
                None
                if getattr(levels[0], f.name) is None
                else torch.cat([getattr(x, f.name) for x in levels], dim=-2 if f.name == "laws" else -1)
                for f in fields(levels[0])
            )
        )  # (fields of an instance: torch.compile traces it)

    def tree(self, keep: torch.Tensor) -> Tree:
        """The tree of the nodes `keep` (ascending, closed under parents), re-indexed, read in one host transfer."""
        tokens, parents = torch.stack(self.kept(keep)).tolist()
        return Tree(tokens, parents)

    def kept(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens [..., k] and parents [..., k] (indices into `keep`; -1 the root) of the nodes `keep` [..., k]
        (ascending, closed under parents; a batch's: each sequence's own), on the device."""
        index = self.parents.new_full((*self.parents.shape[:-1], len(self) + 1), -1)  # old index + 1 -> new index
        index.scatter_(-1, keep + 1, torch.arange(keep.shape[-1], device=keep.device).expand_as(keep))
        return self.tokens.gather(-1, keep), index.gather(-1, self.parents.gather(-1, keep) + 1)


def level_nodes(candidates: torch.Tensor, picked: torch.Tensor | None) -> torch.Tensor:
    """A level's nodes [B, n] of its candidates [B, F, k]: those `picked` (flat positions), or all of them (None)."""
    flat = candidates.flatten(-2)
    return flat if picked is None else flat[..., picked]


def level_scores(
    reached: torch.Tensor, logps: torch.Tensor, rows: torch.Tensor, picked: torch.Tensor | None
) -> torch.Tensor:
    """A level's node scores [B, n]: each parent's score (`reached` [B, F], float64) plus the node's
    log-probability (`logps` [B, F, k], float32, promoted in the sum: one kernel). With every candidate a node
    (`picked` None), one broadcast sum over the [B, F, k] top-k: no gather of the parents' scores."""
    if picked is None:
        return (reached[..., None] + logps).flatten(-2)
    return reached[..., rows] + logps.flatten(-2)[..., picked]


def best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k highest scores [..., n] (each sequence's), ties to the earlier one (a parent before its
    child), ascending."""
    return torch.sort(scores, descending=True, stable=True).indices[..., :k].sort().values


class StaticTree:
    def __init__(self, choices: list[list[int]]) -> None:
        self.choices = choices  # as listed (`tree_prefix` keeps a prefix of them)
        paths = sorted({tuple(p) for p in choices}, key=lambda p: (len(p), p))  # parents first
        self.branch = 1 + max(r for p in paths for r in p)
        self.max_depth = max(len(p) for p in paths)
        place: dict[tuple[int, ...], int] = {(): -1}  # path of ranks -> template place; -1 is the root
        self.child = torch.full((len(paths) + 1, self.branch), -1)  # [parent place + 1, rank] -> place, -1: none
        for p in paths:
            if p and min(p) >= 0 and p[:-1] in place:  # a path whose parent is not in the tree is never reached
                place[p] = len(place) - 1
                self.child[place[p[:-1]] + 1, p[-1]] = place[p]
        self.paths = list(place)[1:]  # [places]: each place's path of ranks
        self.inner = (self.child[1:] >= 0).any(dim=1)  # [places]: the place has children in the tree
        self.fed = int(self.inner.sum())  # the tree rows a draft feeds at most: every place with children
        self.on: tuple[torch.Tensor, torch.Tensor] | None = None  # child and inner on the drafting device
        self.levels = {self.branch: self._levels(self.branch)}  # by k: read from the template on the host
        self.moved: dict[tuple[int, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by (k, device)

    def _levels(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        levels, frontier = [], torch.full((1,), -1)  # the growing nodes' places; -1 is the root
        while len(frontier):
            places = self.child[frontier + 1, :k]  # [F, k]
            picked = (places >= 0).flatten().nonzero().squeeze(1)
            level = places.flatten()[picked]
            grown = self.inner[level].nonzero().squeeze(1)
            levels.append((picked, grown))
            frontier = level[grown]
        return levels

    def fixed(self, depth: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Level `depth`'s admitted candidates (flat positions in the frontier's [F, k] top-k) and growing nodes
        (positions in the level), on `device`: with top-k candidates the template alone decides both, so a level
        needs no host wait."""
        if k not in self.levels:  # a vocabulary narrower than the tree's branching
            self.levels[k] = self._levels(k)
        if (k, device) not in self.moved:
            self.moved[k, device] = [(picked.to(device), grown.to(device)) for picked, grown in self.levels[k]]
        return self.moved[k, device][depth - 1]

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.on is None or self.on[0].device != device:  # moved once, with the first draft
            self.on = self.child.to(device), self.inner.to(device)
        return self.on

    def admits(self, frontier: torch.Tensor | None, k: int, device: torch.device) -> torch.Tensor | None:
        """The template places [F, k] of the top-k children of the growing nodes, whose places are `frontier` [F]
        (None: the root alone), -1 where the tree has no such child."""
        child, _ = self._on(device)
        places = torch.full((1,), -1, device=device) if frontier is None else frontier
        return child[places + 1, :k]

    def grow(self, level: Draft) -> torch.Tensor:
        """The positions [..., F'] in a level's nodes [..., n] of those that have children in the tree, ascending
        (a level of sampled children, whose count depends on the draws, is one sequence's)."""
        assert level.places is not None  # (a static tree's level)
        _, inner = self._on(level.places.device)
        growing = inner[level.places]
        return growing.nonzero()[:, -1].view(*growing.shape[:-1], -1)

    def select(self, draft: Draft) -> torch.Tensor:
        return torch.arange(len(draft), device=draft.tokens.device)


class DynamicTree:
    def __init__(self, total_tokens: int, depth: int, top_k: int) -> None:
        if total_tokens < 2 or depth < 0 or top_k < 1:
            raise ValueError("a dynamic tree needs total_tokens >= 2 (the root and a draft), depth >= 0, top_k >= 1")
        self.drafts = total_tokens - 1  # total_tokens counts the root, as EAGLE's total_token does
        self.branch = top_k
        self.max_depth = depth + 1  # EAGLE's `depth` counts the expansions after the first level
        self.fed = depth * top_k  # the tree rows a draft feeds at most: top_k grown at each level but the last

    def fixed(self, depth: int, k: int, device: torch.device) -> None:
        return None  # every candidate is a node, and the best grow

    def admits(self, frontier: torch.Tensor | None, k: int, device: torch.device) -> torch.Tensor | None:
        return None  # every candidate is a node

    def grow(self, level: Draft) -> torch.Tensor:
        """The positions [B, top_k] in a level's nodes of its top_k best, ties to the earlier one, ascending."""
        return best(level.scores, self.branch)

    def select(self, draft: Draft) -> torch.Tensor:
        """The nodes verified with the root (ascending, [..., k]: each sequence's): the best `total_tokens - 1` of the
        draft; a smaller depth's tree with the same top_k is its select of `draft.upto(depth + 1)` (those levels
        grow alike)."""
        if draft.laws is not None:  # sampled: which nodes are verified must not depend on their own draws
            return torch.arange(min(self.drafts, len(draft)), device=draft.tokens.device)
        return best(draft.scores, self.drafts)


class Ahead(NamedTuple):
    """Where a draft's fed levels sit and their rotary embedding, computed once a draft, not once a level."""

    positions: torch.Tensor  # [B or 1, levels]: level d + 1 is fed at the root's position + d
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [B or 1, levels, head dim]

    @staticmethod
    def of(head: Any, hidden: torch.Tensor, position: int | torch.Tensor, levels: int) -> Ahead:
        """At the roots' positions: `position` an int (one sequence) or [B] (each sequence's); `head` an EAGLE,
        EAGLE-3 or MTP head (its `rotary`)."""
        root = position[:, None] if isinstance(position, torch.Tensor) else position
        positions = torch.arange(levels, device=hidden.device)[None] + root
        return Ahead(positions, head.rotary(hidden, positions))


class Children(NamedTuple):
    """The candidate children of each growing node, in rank order."""

    tokens: torch.Tensor  # [B, F, k] target ids
    logps: torch.Tensor  # [B, F, k] float32 draft log-probabilities
    valid: torch.Tensor | None  # [1, F, k] bool when sampled: the row had mass for that many draws; None: all
    laws: torch.Tensor | None  # [1, F, k, V] when sampled: the law each was drawn from, over the target vocabulary


def per_slot(x: torch.Tensor, batch: int) -> torch.Tensor:
    """x [n], the same for every slot, as [B, n]: a view for one slot, else a copy (a replay's outputs are written
    over in place, and a view of one row repeated cannot be)."""
    return x[None] if batch == 1 else x.repeat(batch, 1)
