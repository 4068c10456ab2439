"""DDTree's token tree (arXiv 2604.12989) for a batch of block drafts: each slot's `budget` best-scoring paths from
its root, a path scoring the sum of its tokens' log-probabilities, where a row's law may depend on the path above it
(DSpark's Markov head, DFlash2's candidate selector; a DFlash row's does not).

Built level by level on the device for every slot at once; the trees stay there (`DeviceTree`s whose shape is
drafted), read with the target's picks, so a step still reads the device once. Each depth keeps only its
`budget` best nodes as the frontier to expand: a node outside them has at least `budget` better nodes at its own
depth, so it is in no best tree. A child scores at most its parent (a log-probability is at most 0), so the
`budget` best nodes overall, ties going to the shallower, are closed under parents: they are the tree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .transfer import upload
from .tree import EMPTY, DeviceTree, Tree

# (depth d, the frontier's choices [m, F], each one's parent as an index into the frontier before [m, F]) ->
# log-probabilities [m, F, C] of the choices at row d under each frontier node
Children = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# (depth d, choices [m, F]) -> their token ids [m, F]
Names = Callable[[int, torch.Tensor], torch.Tensor]


def best_trees(
    children: Children,
    roots: torch.Tensor,
    depths: list[int],
    budget: int,
    top_k: int,
    names: Names | None = None,
) -> list[Tree]:
    """Each slot's tree of at most `budget` nodes and `depths[i]` levels, every node among its parent's `top_k`
    likeliest choices. `roots` [m] are the choices the roots stand for; `names` turns choices into tokens (none:
    a choice is its token). Nodes come depth by depth, best first within a depth."""
    m = len(depths)
    if not m or budget < 1:
        return [EMPTY] * m
    device = roots.device
    rows = upload(depths, device)[:, None]  # [m, 1]
    score = torch.zeros(m, 1, device=device)
    choice = roots[:, None].long()
    parent = torch.zeros_like(choice)
    scores, parents, tokens = [], [], []
    previous = total = 0  # where the frontier's level starts among all nodes, and how many there are
    for d in range(max(depths)):
        logp = children(d, choice, parent).float()  # [m, F, C]
        top = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        candidates = (score[..., None] + top.values).flatten(1)  # [m, F * t]
        candidates = candidates.masked_fill(rows <= d, -torch.inf)  # (past a slot's rows)
        kept = candidates.topk(min(budget, candidates.shape[1]), dim=-1)
        parent = kept.indices.div(top.values.shape[-1], rounding_mode="floor")  # [m, F']
        choice = top.indices.flatten(1).gather(1, kept.indices)
        score = kept.values
        scores.append(score)
        parents.append(parent + previous if d else parent.new_full(parent.shape, -1))
        tokens.append(names(d, choice) if names is not None else choice)
        previous, total = total, total + score.shape[1]
    everything = torch.cat(scores, dim=1)  # [m, N]: depth by depth
    n = everything.shape[1]
    sizes = [level.shape[1] for level in scores]
    counts = [min(budget, sum(sizes[:k])) for k in depths]  # the nodes each slot has (its rows' levels)
    best = everything.sort(dim=1, descending=True, stable=True).indices[:, :budget]  # ties: the shallower first
    best = best.masked_fill(torch.arange(best.shape[1], device=device) >= upload(counts, device)[:, None], n)
    keep = best.sort(dim=1).values  # [m, W]: each slot's nodes depth by depth, then padding (n)
    at = torch.full((m, n + 1), -1, dtype=torch.long, device=device)
    at.scatter_(1, keep, torch.arange(keep.shape[1], device=device).expand(m, -1))  # a node's place in its tree
    real = keep.clamp(max=n - 1)
    above = torch.cat(parents, 1).gather(1, real)  # [m, W]: each kept node's parent among all nodes
    links = torch.where(above >= 0, at.gather(1, above.clamp(min=0)), -1)
    ids = torch.cat(tokens, 1).gather(1, real)
    return [
        DeviceTree(ids[i, :c], links[i, :c], k) if c else EMPTY
        for i, (c, k) in enumerate(zip(counts, depths, strict=True))
    ]
