"""One verification step: for a draft that verifies its own proposals (Ouroboros), a forward over [root] + tree
(+ side branch), the acceptance rule, and the accepted path committed to the cache (`verify`); for the decode loop's
batch, every slot's greedy verdict and what it keeps, computed with the forward (`judge_batch`)."""

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


@dataclass
class Judged:
    """Every slot's greedy verdict on one batched verification, on the device (inside its captured graph: written
    over by the next replay): a summary the host reads in one transfer, and the target's picks, margins and features
    at the kept rows (the greedy check's and the drafters')."""

    summary: torch.Tensor | list[list[int]]  # [B, 2 + 3b]: accepted length, tested depth, kept rows [b], new tokens
    # [b], picks [b] (a host list when the verdict was decided there: then no tensor here is a replay's output)
    top1: torch.Tensor  # [B, b]: the target's argmax at the kept rows (each new token's)
    margin: torch.Tensor  # [B, b]: its top-1/top-2 margin there
    features: torch.Tensor | None  # [B, b, F]: the kept rows' features


def judge_batch(
    ids: torch.Tensor,
    seen: torch.Tensor,
    depth: torch.Tensor,
    nodes: torch.Tensor,
    picks: tuple[torch.Tensor, torch.Tensor],
    features: torch.Tensor | None,
) -> Judged:
    """`acceptance.greedy_batch` on a forward's rows (ids [B, b], ancestors [B, b, b], depths [B, b], tree nodes [B],
    picks: argmax and margin [B, b] each), with the kept rows' picks, margins and features gathered: tensor
    operations only, so a captured forward computes them too."""
    v = acceptance.greedy_batch(ids, seen, depth, nodes, picks[0])
    summary = torch.cat([v.length[:, None], v.tested[:, None], v.kept, v.new, picks[0]], 1)
    kept_features = None
    if features is not None:
        kept_features = features.gather(1, v.kept[..., None].expand(-1, -1, features.shape[-1]))
    return Judged(summary, picks[0].gather(1, v.kept), picks[1].gather(1, v.kept), kept_features)


def inputs(root: int, proposal: Proposal) -> list[int] | torch.Tensor:
    """A verification's tokens: [root] + tree (+ side branch)."""
    tree, side = proposal.tree, proposal.side
    return tree.rows(root) if side is None else [root, *tree.tokens, *side.tokens]


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
    greedy = temperature == 0
    out = model.run(inputs(root, proposal), proposal.tree, layers=layers, side=proposal.side, greedy=greedy)
    accepted, best = judge(proposal, out, rule, temperature, generator)
    model.commit(past, [0, *accepted.rows])
    return outcome(proposal, out, accepted, best)
