"""DSpark (DeepSeek, arXiv 2607.05147): DFlash's block drafting (`methods.dflash`: one forward fills a block of the
last committed token and mask tokens, every slot's together, captured under --graphs) with the drafter's own
embedding and readout, every row a draft (the anchor's included), and each row's logits corrected left to right by
its Markov head from the token drafted before it (`heads.dspark`). The rows are drafted one after another over the
whole batch at once: the argmax at T = 0, else a draw from the corrected law at the run's temperature from the
slot's own generator, verified against that law by the shared rejection rule (each row's law depends on the drafts
before it only, as a chain's may).

`confidence_threshold` (DeepSpec's evaluator `--confidence-threshold`, `eval/dspark/draft_ops.py`): a slot verifies
only the rows before the first whose confidence head predicts acceptance below it (none: the whole block; 0, the
default, verifies every row). `verify: adaptive` (the paper's confidence-scheduled verification): every drafting
slot's verified rows chosen together from the confidences' running products and the target's profiled step costs
at the batch's size (`core.schedule`). Either reads the confidences to the host, one read a step; each proposal
records the rows drafted beside those verified.
"""

from __future__ import annotations

import torch

from ..core.best_tree import best_trees
from ..core.proposer import Drafter, Proposal, Turn, chain_prefix
from ..core.sampling import next_rows
from ..core.schedule import prefix_lengths
from ..core.transfer import upload
from ..core.tree import EMPTY, Tree, chain
from ..heads.dspark import FAMILY, DSparkDraft
from ..registry import implementation
from .dflash import DFlash
from .resources import Resources


class DSpark(DFlash):
    first = 0  # every row of the block is a draft
    whole = False  # its schedule decides on the rows the token budget leaves (what it verifies is recorded)

    def __init__(
        self,
        draft: DSparkDraft,
        num_draft_tokens: int,
        confidence_threshold: float = 0.0,
        verify: str = "all",
        costs: dict[int, float] | None = None,  # verify adaptive: the target's T(rows) at the batch's size
        **options,
    ) -> None:
        super().__init__(draft, draft.embed_tokens, draft.lm_head, num_draft_tokens, **options)
        if not isinstance(confidence_threshold, (int, float)) or not 0 <= confidence_threshold < 1:
            raise ValueError(f"dspark's confidence_threshold is from 0 (off) up to 1, not {confidence_threshold}")
        if verify not in ("all", "adaptive"):
            raise ValueError(f"dspark's verify is all or adaptive, not {verify!r}")
        if (confidence_threshold or verify == "adaptive") and draft.confidence_head is None:
            raise ValueError("dspark's confidence_threshold and verify=adaptive need a drafter with a confidence head")
        if options.get("tree") is not None and (confidence_threshold or verify == "adaptive"):
            raise ValueError("dspark's tree is verified whole: drop confidence_threshold and verify=adaptive")
        if confidence_threshold and verify == "adaptive":
            raise ValueError("dspark's verify=adaptive schedules the rows itself: drop confidence_threshold")
        if verify == "adaptive" and not costs:
            raise ValueError("dspark's verify=adaptive needs the target's profiled step costs (a run profiles them)")
        self.draft: DSparkDraft = draft
        self.threshold = float(confidence_threshold)
        self.costs = costs if verify == "adaptive" else None

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # (the Markov head reads each row's state)

    def _trees(self, ks: list[int], drafted: list[torch.Tensor], roots: torch.Tensor, budget: int) -> list[Tree]:
        """DDTree over the Markov-corrected rows: a node's children are the likeliest tokens of its row's law given
        the node's token (and, for the `rnn` head, the state along its path), every frontier node's in one product."""
        hidden = torch.stack([rows[: max(ks)] for rows in drafted])  # [m, k, H]
        base = self.draft.lm_head(hidden).float()  # [m, k, V]
        markov = self.draft.markov_head
        states: list[torch.Tensor | None] = [None]  # the frontier's recurrent states, by frontier index

        def children(d: int, before: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
            logits = base[:, d, None]  # [m, 1, V]
            if markov is not None:
                m, f = before.shape
                state = states[0]
                if state is not None:  # each node's path's state: its parent's
                    state = state.gather(1, parent[..., None].expand(-1, -1, state.shape[-1])).flatten(0, 1)
                rows = hidden[:, d, None].expand(-1, f, -1).flatten(0, 1)
                bias, state = markov.step(before.flatten(), rows, state)
                states[0] = None if state is None else state.view(m, f, -1)
                logits = logits + bias.float().view(m, f, -1)
            return torch.log_softmax(logits, -1)

        return best_trees(children, roots, ks, budget, self.tree_top_k)

    def _proposals(
        self, ks: list[int], drafted: list[torch.Tensor], turns: list[Turn], roots: list[int]
    ) -> list[Proposal]:
        """Row by row for every slot at once: the corrected logits, the draft (argmax or each slot's own draw) and
        the law it came from; then each slot's chain, cut by its confidence (a threshold, or the batch's schedule)."""
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
        lengths = ks  # each slot's drafted rows
        if self.threshold or self.costs:  # (one read)
            confidence = self.draft.confidence(hidden, torch.stack(before, dim=1))  # [m, k]
            if self.costs:  # every slot's rows scheduled together
                survival = confidence.cumprod(1).tolist()
                ks = prefix_lengths([row[:k] for row, k in zip(survival, ks, strict=True)], self.costs)
            else:  # the rows before the first unconfident one
                confident = (confidence >= self.threshold).long().cumprod(1).sum(1).tolist()
                ks = [min(k, n) for k, n in zip(ks, confident, strict=True)]
        return [
            Proposal(
                chain(drafts[i, :k]),
                drawn_from[i, :k] if drawn_from is not None and turn.temperature else None,
                drafted=n,
            )
            if k
            else Proposal(EMPTY, drafted=n)
            for i, (k, n, turn) in enumerate(zip(ks, lengths, turns, strict=True))
        ]


@implementation("dspark", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    draft: DSparkDraft = res.head(FAMILY.name, res.draft_dtype(params.pop("draft_dtype", None)))
    if params.get("verify") == "adaptive":
        params["costs"] = res.costs(slots)
    return DSpark(draft, **params, slots=slots, static=res.graphs, capture=res.graphs)
