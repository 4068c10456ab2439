"""DFlash2: DFlash's block drafting (`methods.dflash`: one forward fills a block of the last committed token and mask
tokens, every slot's together, captured under --graphs) by a drafter with causal convolutions along the block and a
candidate selector (`heads.dflash2`). Each row offers its `selector_top_k` most likely tokens; the chain walks the
rows left to right, each row's candidates scored given the candidate chosen before (the anchor token for the first),
for every slot at once: the best one at T = 0 (the lowest index among ties), else a draw from softmax(score / T)
over the row's candidates from the slot's own generator, verified against that law, which is zero outside them (the
shared rejection rule is exact for it: a token outside the candidates is never proposed, and the residual takes
the target's mass there). The law travels as its K candidates and their probabilities (`SparseLaws`), never as a
row over the vocabulary.
"""

from __future__ import annotations

import torch

from ..core.best_tree import best_trees
from ..core.proposer import Drafter, Proposal, Turn, chain_prefix
from ..core.sampling import SparseLaws, next_rows
from ..core.transfer import upload
from ..core.tree import Tree, chain
from ..heads.dflash2 import FAMILY, DFlash2Draft
from ..registry import implementation
from .dflash import DFlash
from .resources import Resources


class DFlash2(DFlash):
    def __init__(self, draft: DFlash2Draft, embedding, readout, num_draft_tokens: int, **options) -> None:
        super().__init__(draft, embedding, readout, num_draft_tokens, **options)
        self.draft: DFlash2Draft = draft

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # (the selector reads each row's state)

    def _scores(
        self, drafted: list[torch.Tensor], deepest: int, roots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every drafting slot's candidates [m, k, K] and edge scores [m, k, K, K] (`candidate_selector`'s)."""
        hidden = torch.stack([rows[:deepest] for rows in drafted])  # [m, k, H]
        ids, unary = self.draft.candidates(hidden, self.readout)  # [m, k, K] each
        return ids, self.draft.candidate_selector(ids, unary, hidden, roots)

    def _trees(self, ks: list[int], drafted: list[torch.Tensor], roots: torch.Tensor, budget: int) -> list[Tree]:
        """DDTree over the candidates: a node's children are its row's candidates, scored by log-softmax of the
        edge scores from the node's candidate (the anchor's for the first row)."""
        ids, scores = self._scores(drafted, max(ks), roots)
        top = scores.shape[-1]

        def children(d: int, before: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(scores[:, d].gather(1, before[..., None].expand(-1, -1, top)), -1)  # [m, F, K]

        return best_trees(
            children,
            torch.zeros_like(roots),  # (row 0's scores are the same under every candidate: the anchor's)
            ks,
            budget,
            self.tree_top_k,
            lambda d, choices: ids[:, d].gather(1, choices),
        )

    def _proposals(
        self, ks: list[int], drafted: list[torch.Tensor], turns: list[Turn], roots: list[int]
    ) -> list[Proposal]:
        """Every drafting slot's candidates and edge scores at once, then the walk, row by row over the batch."""
        deepest = max(ks)
        ids, scores = self._scores(drafted, deepest, upload(roots, self.device))
        temperatures, generators = [t.temperature for t in turns], [t.generator for t in turns]
        at = torch.zeros(len(ks), dtype=torch.long, device=self.device)  # each slot's candidate chosen before
        picks: list[torch.Tensor] = []
        laws: list[torch.Tensor] = []
        for j in range(deepest):
            row = scores[:, j].gather(1, at[:, None, None].expand(-1, 1, scores.shape[-1]))[:, 0]  # [m, K]
            at = next_rows(row, temperatures, generators, laws)
            picks.append(at)
        chosen = torch.stack(picks, dim=1)  # [m, k]: indices into each row's candidates
        tokens = ids.gather(2, chosen[..., None])[..., 0]  # [m, k]
        found = []
        for i, (k, turn) in enumerate(zip(ks, turns, strict=True)):
            probs = None
            if laws and turn.temperature:  # the rows' laws over their candidates (zero at every other token)
                probs = SparseLaws(ids[i, :k], torch.stack([step[i] for step in laws[:k]]))  # [k, K] each
            found.append(Proposal(chain(tokens[i, :k]), probs))
        return found


@implementation("dflash2", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    dtype = res.draft_dtype(params.pop("draft_dtype", None))
    draft: DFlash2Draft = res.head(FAMILY.name, dtype)
    embedding, readout = res.target_model.get_input_embeddings(), res.readout(dtype)
    return DFlash2(draft, embedding, readout, **params, slots=slots, static=res.graphs, capture=res.graphs)
