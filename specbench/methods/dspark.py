"""DSpark (DeepSeek, arXiv 2607.05147): DFlash's block drafting (`methods.dflash`: one forward fills a block of the
last committed token and mask tokens, every slot's together, captured under --graphs) with the drafter's own
embedding and readout, every row a draft (the anchor's included), and each row's logits corrected left to right by
its Markov head from the token drafted before it (`heads.dspark`). The rows are drafted one after another over the
whole batch at once: the argmax at T = 0, else a draw from the corrected law at the run's temperature from the
slot's own generator, verified against that law by the shared rejection rule (each row's law depends on the drafts
before it only, as a chain's may).

`confidence_threshold` (DeepSpec's evaluator `--confidence-threshold`, `eval/dspark/draft_ops.py`): a slot verifies
only the rows before the first whose confidence head predicts acceptance below it (none: the whole block; 0, the
default, verifies every row). Deciding it reads the confidences to the host, one read a step.
"""

from __future__ import annotations

import torch

from ..core.proposer import NO_PROPOSAL, Drafter, Proposal, Turn, chain_prefix
from ..core.sampling import next_rows
from ..core.transfer import upload
from ..core.tree import chain
from ..heads.dspark import FAMILY, DSparkDraft
from ..registry import implementation
from .dflash import DFlash
from .resources import Resources


class DSpark(DFlash):
    first = 0  # every row of the block is a draft

    def __init__(self, draft: DSparkDraft, num_draft_tokens: int, confidence_threshold: float = 0.0, **options) -> None:
        super().__init__(draft, draft.embed_tokens, draft.lm_head, num_draft_tokens, **options)
        if not isinstance(confidence_threshold, (int, float)) or not 0 <= confidence_threshold < 1:
            raise ValueError(f"dspark's confidence_threshold is from 0 (off) up to 1, not {confidence_threshold}")
        if confidence_threshold and draft.confidence_head is None:
            raise ValueError("dspark's confidence_threshold needs a drafter with a confidence head; this one has none")
        self.draft: DSparkDraft = draft
        self.threshold = float(confidence_threshold)

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # (the Markov head reads each row's state)

    def _proposals(
        self, ks: list[int], drafted: list[torch.Tensor], turns: list[Turn], roots: list[int]
    ) -> list[Proposal]:
        """Row by row for every slot at once: the corrected logits, the draft (argmax or each slot's own draw) and
        the law it came from; then each slot's chain, cut before its first unconfident row."""
        if not ks:
            return []
        deepest = max(ks)
        hidden = torch.stack([rows[:deepest] for rows in drafted])  # [m, k, H]
        base = self.draft.lm_head(hidden)  # [m, k, V]
        prev = upload(roots, hidden.device)
        temperatures, generators = [t.temperature for t in turns], [t.generator for t in turns]
        state, tokens, before = None, [], []
        laws: list[torch.Tensor] = []
        for j in range(deepest):
            logits = base[:, j]
            if self.draft.markov_head is not None:
                bias, state = self.draft.markov_head.step(prev, hidden[:, j], state)
                logits = logits + bias
            before.append(prev)
            prev = next_rows(logits, temperatures, generators, laws)
            tokens.append(prev)
        drafts = torch.stack(tokens, dim=1)  # [m, k]
        drawn_from = torch.stack(laws, dim=1) if laws else None  # [m, k, V]
        if self.threshold:  # the rows before the first unconfident one (one read)
            confident = self.draft.confidence(hidden, torch.stack(before, dim=1)) >= self.threshold  # [m, k]
            ks = [min(k, n) for k, n in zip(ks, confident.long().cumprod(1).sum(1).tolist(), strict=True)]
        return [
            Proposal(chain(drafts[i, :k]), drawn_from[i, :k] if drawn_from is not None and turn.temperature else None)
            if k
            else NO_PROPOSAL
            for i, (k, turn) in enumerate(zip(ks, turns, strict=True))
        ]


@implementation("dspark", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    draft: DSparkDraft = res.head(FAMILY.name, res.draft_dtype(params.pop("draft_dtype", None)))
    return DSpark(draft, **params, slots=slots, static=res.graphs, capture=res.graphs)
