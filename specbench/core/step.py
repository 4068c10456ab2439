"""One verification step, shared by the decode loop and by drafts that verify their own proposals (Ouroboros):
a forward over [root] + tree (+ side branch), the acceptance rule, and the accepted path committed to the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import acceptance
from .cached_lm import CachedLM, Forward, margins
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
    picks: tuple[list[int], torch.Tensor] | None = None  # T=0: the target's top-1 [k] and top-1/2 margin [k] at
    # the kept rows, i.e. for each token of `new`; the margins on the device (read once per turn: no extra host sync)
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
    argmax, the side branch's too, with the tree if it is still on the device; a captured forward computed them,
    and the margins the losslessness check compares, inside its graph."""
    past = model.cached
    tree, side = proposal.tree, proposal.side
    tokens = tree.rows(root) if side is None else [root, *tree.tokens, *side.tokens]
    greedy = temperature == 0
    out = model.run(tokens, tree, layers=layers, side=side, greedy=greedy)
    n = len(tree) + 1
    if greedy:
        best = tree.read_along(out.logits.argmax(dim=-1) if out.picks is None else out.picks[0])
        accepted, side_picks = acceptance.greedy(tree, best[:n]), best[n:]
    else:
        accepted, side_picks = rule(tree, out.logits[:n], proposal.draft_probs, temperature, generator), None
    kept = [0, *accepted.rows]
    model.commit(past, kept)
    new = [tree.tokens[r - 1] for r in accepted.rows] + [accepted.token]
    rows = upload(kept, out.logits.device)
    picks = None
    if greedy:  # (the kept rows' margins gathered before the model's next forward writes over a captured one's)
        picks = [best[r] for r in kept], margins(out.logits[rows]) if out.picks is None else out.picks[1][rows]
    return Verified(accepted, new, out, kept, rows, picks, side_picks)
