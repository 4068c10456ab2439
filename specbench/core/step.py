"""One verification step, shared by the decode loop and by drafts that verify their own proposals (Ouroboros):
a forward over [root] + tree (+ side branch), the acceptance rule, and the accepted path committed to the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import acceptance
from .cached_lm import CachedLM, Forward
from .transfer import upload

if TYPE_CHECKING:
    from .proposer import Proposal


@dataclass(frozen=True)
class Verified:
    """One verification of a proposal: what the rule accepted, the tokens it appends, the forward's output."""

    accepted: acceptance.Accepted
    new: list[int]  # accepted draft tokens, then the target's own
    output: Forward  # logits (and features) of every input row, side-branch rows included
    kept: list[int]  # input rows now in the cache: the root and the accepted nodes
    kept_rows: torch.Tensor  # the same [k] on the logits' device
    picks: tuple[torch.Tensor, torch.Tensor] | None = None  # T=0: the target's top-1 [k] and top-1/2 margin [k]
    # at the kept rows, i.e. for each token of `new`, on the device (read once per turn: no extra host sync)
    side_picks: list[int] | None = None  # T=0: the target's argmax at each side-branch token


def verify(
    model: CachedLM,
    root: int,
    proposal: Proposal,
    rule: acceptance.Rule,
    temperature: float,
    generator: torch.Generator | None,
    layers: tuple[int, ...] | None = None,
) -> Verified:
    """One forward of `model` over [root] + tree (+ side branch), acceptance by `rule` (greedy at T = 0), and the
    accepted path committed into the cache (the rest dropped). At T = 0 the host reads the device once: every row's
    argmax, the side branch's too, with the tree if it is still on the device."""
    past = model.cached
    tree, side = proposal.tree, proposal.side
    tokens = tree.rows(root) if side is None else [root, *tree.tokens, *side.tokens]
    out = model.run(tokens, tree, layers=layers, side=side)
    n = len(tree) + 1
    if temperature == 0:
        best = tree.read_along(out.logits.argmax(dim=-1))
        accepted, side_picks = acceptance.greedy(tree, best[:n]), best[n:]
    else:
        accepted, side_picks = rule(tree, out.logits[:n], proposal.draft_probs, temperature, generator), None
    kept = [0, *accepted.rows]
    model.commit(past, kept)
    new = [tree.tokens[r - 1] for r in accepted.rows] + [accepted.token]
    rows = upload(kept, out.logits.device)
    return Verified(accepted, new, out, kept, rows, picks(out.logits[rows]) if temperature == 0 else None, side_picks)


def picks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (as the greedy rule picks) and its top-1 minus top-2 logit: what the losslessness check
    compares with vanilla's one-token steps at a divergence."""
    top = logits.float().topk(2, dim=-1).values
    return logits.argmax(dim=-1), top[:, 0] - top[:, 1]
