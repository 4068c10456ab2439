"""Acceptance rules: which drafted tokens the target keeps, and the token it adds itself. Pure functions.

Each rule takes the proposal's tree and the target's rows for the verification input ([root] + nodes)
and returns the accepted root-to-node path plus the target's own next token (bonus or correction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample, uniform
from .tree import Tree


@dataclass(frozen=True)
class Accepted:
    rows: list[int]  # input rows of the accepted draft nodes, in path order (root excluded)
    token: int  # the target's own token after the accepted path
    tested: int  # draft depth examined along the path: len(rows), plus 1 if a drafted child was rejected


def greedy(tree: Tree, logits: torch.Tensor) -> Accepted:
    """Longest path whose every token is the target's argmax at its parent. logits: [n+1, V]."""
    best = logits.argmax(dim=-1).tolist()
    children = tree.children()
    rows: list[int] = []
    row = 0
    while True:
        match = next((c for c in children[row] if tree.tokens[c - 1] == best[row]), None)
        if match is None:
            return Accepted(rows, best[row], len(rows) + (1 if children[row] else 0))
        rows.append(match)
        row = match


def speculative_sampling(
    tree: Tree,
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Accepted:
    """Lossless rejection sampling over a tree (Leviathan et al. for chains, SpecInfer for siblings).

    probs: [n+1, V] target distributions per input row. draft_probs: [n, V], row i the distribution node i
    was drawn from; None means every node is a point-mass (deterministic) proposal, as for n-gram drafts.
    At each node the children are tried in order: child x is accepted with probability min(1, p(x)/q(x));
    on rejection p becomes norm(max(0, p - q)). If no child is accepted the token is drawn from the final p;
    past the last accepted node with no children it is drawn from that node's p (the bonus token).
    """
    children = tree.children()
    rows: list[int] = []
    row = 0
    while True:
        p = probs[row]
        for child in children[row]:
            x = tree.tokens[child - 1]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft_probs[child - 1]
            px, qx = float(p[x]), float(q[x])
            if qx > 0 and uniform(generator, p.device) * qx < px:
                rows.append(child)
                row = child
                break
            residual = torch.clamp(p - q, min=0.0)
            total = float(residual.sum())
            p = residual / total if total > 0 else p
        else:
            return Accepted(rows, sample(p, generator), len(rows) + (1 if children[row] else 0))
