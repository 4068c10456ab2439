"""The decode loop's verification step over a batch: every slot's greedy verdict and what it keeps, computed with the
forward (`judge_batch`), and a slot's verification rows (`inputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import acceptance

if TYPE_CHECKING:
    from .proposer import Proposal


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
    limit: torch.Tensor | None = None,
) -> Judged:
    """`acceptance.greedy_batch` on a forward's rows (ids [B, b], ancestors [B, b, b], depths [B, b], tree nodes [B],
    picks: argmax and margin [B, b] each, depth limits [B]), with the kept rows' picks, margins and features
    gathered: tensor operations only, so a captured forward computes them too."""
    v = acceptance.greedy_batch(ids, seen, depth, nodes, picks[0], limit)
    summary = torch.cat([v.length[:, None], v.tested[:, None], v.kept, v.new, picks[0]], 1)
    kept_features = None
    if features is not None:
        kept_features = features.gather(1, v.kept[..., None].expand(-1, -1, features.shape[-1]))
    return Judged(summary, picks[0].gather(1, v.kept), picks[1].gather(1, v.kept), kept_features)


def inputs(root: int, proposal: Proposal) -> list[int] | torch.Tensor:
    """A verification's tokens: [root] + tree (+ side branch)."""
    tree, side = proposal.tree, proposal.side
    return tree.rows(root) if side is None else [root, *tree.tokens, *side.tokens]
