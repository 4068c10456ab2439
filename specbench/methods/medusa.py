"""Medusa: extra heads on the target's last hidden state each guess one more future token; their top-k
candidates are arranged in a static tree (each node's token is the k-th guess of the head at its depth)."""

from __future__ import annotations

import torch
from torch import nn

from .. import choices
from ..errors import SpecbenchError
from ..heads.medusa import MedusaHeads
from ..registry import implementation
from ..tree import Tree, from_choices
from .base import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn
from .resources import Resources


class Medusa(Proposer):
    feature_layers = (-1,)

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head: nn.Module,
        choices: list[list[int]],
    ) -> None:
        vocab, hidden = lm_head.weight.shape
        own = None if heads.shared_lm_head else heads[0][-1].out_features
        if heads[0][0].linear.in_features != hidden or own not in (None, vocab):
            raise SpecbenchError(
                f"the Medusa heads are for hidden size {heads[0][0].linear.in_features} and vocabulary "
                f"{own or vocab}, the target has {hidden} and {vocab}: use heads trained for this target"
            )
        self.template = from_choices(choices, max_rank=vocab)  # tokens: each node's rank in its head's top-k
        self.depth = self.template.max_depth()
        if self.depth > len(heads):
            raise SpecbenchError(
                f"the Medusa tree is {self.depth} deep but the checkpoint has {len(heads)} heads: use a tree of "
                f"depth <= {len(heads)} (choices) or heads trained with more"
            )
        self.heads = heads
        self.lm_head = lm_head
        self.slot = (
            torch.tensor([d - 1 for d in self.template.depths()]),  # which head
            torch.tensor(self.template.tokens),  # which of its candidates
        )
        self.hidden: torch.Tensor | None = None  # [H]: the target's last state, the one that produced the root

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.hidden = turn.features[-1] if turn.features is not None and len(turn.features) else None

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        if self.hidden is None:
            return NO_PROPOSAL
        logits = self.heads(self.hidden.to(self.lm_head.weight.dtype), self.lm_head)[: self.depth]  # [depth, V]
        top = logits.topk(max(self.template.tokens) + 1, dim=-1).indices.cpu()  # [depth, k]
        return Proposal(Tree(top[self.slot].tolist(), self.template.parents))

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        self.hidden = feedback.features[-1]


@implementation("medusa", color="#e377c2")
def build(params: dict, res: Resources) -> Proposer:
    tree = choices.resolve(params.pop("tree", "medusa_mc_sim_7b_63"))
    return Medusa(res.head("medusa"), res.target_model.get_output_embeddings(), tree, **params)
