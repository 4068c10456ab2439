"""Medusa: extra heads on the target's last hidden state each guess one more future token; their top-k
candidates are arranged in a static tree (each node's token is the k-th guess of the head at its depth).

With `sampled` (T > 0 only), a node's children are instead drawn without replacement from the distribution
of the head at their depth (at the run's temperature), the k-th draw taking the place of the k-th guess,
and each is verified against the law it was drawn from (recursive rejection sampling), as the sampled EAGLE
trees are. Every parent's children must then have ranks 0..k-1: a skipped draw would change its later
siblings' laws.

Under --graphs the heads' forward and the pick of each node's candidate run as one CUDA graph on a GPU."""

from __future__ import annotations

import torch
from torch import nn

from ..core import choices
from ..core.capture import Replays
from ..core.proposer import NO_PROPOSAL, Drafter, Feedback, Proposal, Turn, tree_prefix
from ..core.sampling import draw_distinct, probabilities
from ..core.static_lm import BUCKETS
from ..core.tree import DeviceTree, Tree, from_choices
from ..errors import SpecbenchError
from ..heads.medusa import MedusaHeads
from ..registry import implementation, unless_sampled
from .resources import Resources


class Medusa(Drafter):
    feature_layers = (-1,)

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head: nn.Linear,
        choices: list[list[int]],
        sampled: bool = False,
        graphs: bool = False,  # top-k candidates picked in a captured graph (on a GPU)
    ) -> None:
        vocab, hidden = lm_head.weight.shape
        # (a head is an nn.Sequential of ResBlocks, then its own projection unless it shares the target's)
        width = heads[0][0].linear.in_features  # type: ignore[index]
        own = None if heads.shared_lm_head else heads[0][-1].out_features  # type: ignore[index]
        if width != hidden or own not in (None, vocab):
            raise SpecbenchError(
                f"the Medusa heads are for hidden size {width} and vocabulary "
                f"{own or vocab}, the target has {hidden} and {vocab}: use heads trained for this target"
            )
        self.choices = choices  # as listed (`tree_prefix` keeps a prefix of them)
        self.template = from_choices(choices, max_rank=vocab)  # tokens: each node's rank in its head's top-k
        self.paths = [
            tuple(self.template.tokens[r - 1] for r in self.template.path(i + 1)) for i in range(len(self.template))
        ]  # each node's path of ranks
        self.depth = self.template.max_depth()
        if self.depth > len(heads):
            raise SpecbenchError(
                f"the Medusa tree is {self.depth} deep but the checkpoint has {len(heads)} heads: use a tree of "
                f"depth <= {len(heads)} (choices) or heads trained with more"
            )
        self.heads = heads
        self.lm_head = lm_head
        self.sampled = sampled
        depths, ranks = self.template.depths(), self.template.tokens
        kids_of: dict[int, list[int]] = {}
        for child, parent in enumerate(self.template.parents):  # siblings come in rank order
            kids_of.setdefault(parent, []).append(child)
        self.families = sorted(kids_of.items())  # (parent, its children); parent -1 is the root
        self.family_depth = torch.tensor([depths[p] if p >= 0 else 0 for p, _ in self.families])  # children's head
        if sampled and any([ranks[c] for c in kids] != list(range(len(kids))) for _, kids in self.families):
            raise ValueError("a sampled Medusa tree needs each node's children to have ranks 0..k-1")
        device = lm_head.weight.device
        self.pick = (
            torch.tensor([d - 1 for d in self.template.depths()], device=device),  # which head
            torch.tensor(self.template.tokens, device=device),  # which of its candidates
        )
        self.hidden: dict[int, torch.Tensor | None] = {}  # per slot [H]: the target's last state (the root's)
        self.turns: dict[int, Turn] = {}
        self.replays = Replays(device) if graphs else None
        self.static: dict[int, torch.Tensor] = {}  # by bucket: the captured graph's input states [bucket, H]

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        for slot, turn in zip(slots, turns, strict=True):
            self.turns[slot] = turn
            self.hidden[slot] = turn.features[-1] if turn.features is not None and len(turn.features) else None

    @torch.inference_mode()
    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """Every slot's top-k tree in one heads forward over their last states; sampled trees (T > 0 with
        `sampled`) are drawn one slot after another, each from its own generator."""
        found = [NO_PROPOSAL] * len(slots)
        ready = []
        for i, slot in enumerate(slots):
            hidden, turn = self.hidden[slot], self.turns[slot]
            if hidden is not None and self.sampled and turn.temperature > 0:
                found[i] = self._sampled(probabilities(self._logits(hidden), turn.temperature), turn.generator)
            elif hidden is not None:
                ready.append(i)
        if ready:
            picked = self._top(torch.stack([self.hidden[slots[i]] for i in ready]))  # type: ignore[misc]
            for i, row in zip(ready, picked, strict=True):  # [n, nodes]
                found[i] = Proposal(DeviceTree(row, self.template.parents, self.depth))
        return found

    def _top(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each template node's token [n, nodes] for the states `hidden` [n, H]; under --graphs one captured graph
        per bucket of n (padded with zero states)."""
        if self.replays is None:
            return self._picked(hidden)
        n = len(hidden)
        bucket = next((b for b in BUCKETS if b >= n), n)
        if bucket not in self.static:
            self.static[bucket] = hidden.new_zeros(bucket, hidden.shape[1])
        self.static[bucket][:n] = hidden
        picked = self.replays.run(("tree", bucket), lambda: self._picked(self.static[bucket]))
        return picked[:n].clone()  # (the next replay writes over it)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.heads(hidden.to(self.lm_head.weight.dtype), self.lm_head)[: self.depth]  # [depth, ..., V]

    def _picked(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each template node's token [n, nodes] for the states [n, H]: the candidate of its rank among its head's
        top-k."""
        top = self._logits(hidden).topk(max(self.template.tokens) + 1, dim=-1).indices  # [depth, n, k]
        return top[self.pick[0], :, self.pick[1]].T  # [nodes, n] -> [n, nodes]

    def _sampled(self, q: torch.Tensor, generator: torch.Generator | None) -> Proposal:
        """Every family's children drawn at once from q [depth, V] of the head at their depth. A row with less
        mass than a family is wide gives fewer draws: the nodes past them are dropped with their subtrees."""
        widest = max(len(kids) for _, kids in self.families)
        drawn, laws = draw_distinct(q[self.family_depth], widest, generator)
        tokens, law = list(self.template.tokens), {}
        for (_, kids), row, rows in zip(self.families, drawn, laws, strict=True):
            for rank, child in enumerate(kids[: len(row)]):
                tokens[child], law[child] = row[rank], rows[rank]
        kept: set[int] = set()
        for i, parent in enumerate(self.template.parents):  # parents come first
            if i in law and (parent < 0 or parent in kept):
                kept.add(i)
        keep = sorted(kept)
        return Proposal(Tree(tokens, self.template.parents).subtree(keep), torch.stack([law[i] for i in keep]))

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        for slot, fed in zip(slots, feedback, strict=True):
            assert fed.features is not None  # the target returns the feature_layers' states
            self.hidden[slot] = fed.features[-1]


def _paths(drafter: Drafter, slot: int, proposal: Proposal) -> tuple[list[tuple], list[list[int]]]:
    """Each proposed node's path of ranks (a greedy proposal is the whole template) and the tree's paths."""
    assert isinstance(drafter, Medusa)
    return drafter.paths if len(proposal.tree) else [], drafter.choices


@implementation("medusa", nested=tree_prefix("nodes", _paths), graphed=unless_sampled, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    tree = choices.first(choices.resolve(params.pop("tree", "medusa_mc_sim_7b_63")), params.pop("nodes", None))
    head = res.head("medusa")
    return Medusa(head, res.target_model.get_output_embeddings(), tree, **params, graphs=res.graphs)
