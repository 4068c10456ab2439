"""One sequence's verification step, for a draft that verifies its own proposals (Ouroboros): a forward over
[root] + tree (+ side branch), the acceptance rule, and the accepted path committed to the cache (`verify`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import acceptance
from .cached_lm import Forward, margins
from .one_slot import Target
from .proposer import Proposal
from .static_lm import Row
from .step import inputs
from .transfer import upload


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


def judge(
    proposal: Proposal,
    out: Forward,
    rule: acceptance.Rule,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[acceptance.Accepted, list[int] | None]:
    """The rule's verdict on a proposal from its forward's output (greedy at T = 0), and at T = 0 every row's argmax
    (the side branch's too, read with the tree if it is still on the device: one read of the device)."""
    tree = proposal.tree
    n = len(tree) + 1
    if temperature == 0:
        picks = tree.read_along(out.logits.argmax(dim=-1) if out.picks is None else out.picks[0])
        return acceptance.greedy(tree, picks[:n]), picks
    return rule(tree, out.logits[:n], proposal.draft_probs, temperature, generator), None


def outcome(
    proposal: Proposal,
    out: Forward,
    accepted: acceptance.Accepted,
    best: list[int] | None,
) -> Verified:
    """What a verdict appends and keeps; at T = 0 the kept rows' picks, their margins gathered before the model's
    next forward writes over a captured one's."""
    kept = [0, *accepted.rows]
    new = [proposal.tree.tokens[r - 1] for r in accepted.rows] + [accepted.token]
    rows = upload(kept, out.logits.device)
    picks = side_picks = None
    if best is not None:
        margin = None if out.picks is None else out.picks[1]
        kept_margins = margins(out.logits[rows]) if margin is None else margin[rows]
        picks = [best[r] for r in kept], kept_margins
        side_picks = best[len(proposal.tree) + 1 :]
    return Verified(accepted, new, out, kept, rows, picks, side_picks)


def verify(
    model: Target,
    root: int,
    proposal: Proposal,
    rule: acceptance.Rule,
    temperature: float,
    generator: torch.Generator | None,
    layers: tuple[int, ...] | None = None,
) -> Verified:
    """One forward of `model` (a batch of one) over [root] + tree (+ side branch), acceptance by `rule` (greedy at
    T = 0), and the accepted path committed into the cache (the rest dropped). At T = 0 the host reads the device
    once: every row's argmax, the side branch's too, with the tree if it is still on the device; a captured forward
    computed them, and the margins the losslessness check compares, inside its graph."""
    past = model.lengths[0]
    greedy = temperature == 0
    (out,) = model.run([Row(0, inputs(root, proposal), proposal.tree, proposal.side)], layers=layers, greedy=greedy)
    accepted, best = judge(proposal, out, rule, temperature, generator)
    model.commit([(0, past, [0, *accepted.rows])])
    return outcome(proposal, out, accepted, best)
