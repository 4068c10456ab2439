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
at the batch's size (`core.schedule`); `verify: async`, its asynchronous variant: as many rows as the survivals of
two steps before make best (the paper's section 5.2), this step's taken in the same order. The schedules weigh the
confidences after the checkpoint's Sequential Temperature Scaling (`confidence_temperatures`, from `specbench
calibrate`) unless `calibrated: false`; the threshold reads them raw, as DeepSpec's does. Either reads the
confidences to the host, one read a step; each proposal records the rows drafted beside those verified.
"""

from __future__ import annotations

from collections import deque

import torch

from ..core.best_tree import best_trees
from ..core.proposer import Drafter, Feedback, Proposal, Turn, chain_prefix
from ..core.sampling import next_rows
from ..core.schedule import capacity, prefix_lengths, top_lengths
from ..core.transfer import upload
from ..core.tree import EMPTY, Tree, chain
from ..heads.dspark import FAMILY, DSparkDraft
from ..registry import implementation
from .dflash import DFlash
from .resources import Resources

SCHEDULES = ("adaptive", "async")  # `verify` values that schedule the rows from the confidences and step costs


class DSpark(DFlash):
    first = 0  # every row of the block is a draft

    def __init__(
        self,
        draft: DSparkDraft,
        num_draft_tokens: int,
        confidence_threshold: float = 0.0,
        verify: str = "all",
        calibrated: bool = True,
        record: bool = False,  # `specbench calibrate`'s: every row verified, the confidences kept with the verdicts
        costs: dict[int, float] | None = None,  # verify adaptive or async: the target's T(rows) at the batch's size
        **options,
    ) -> None:
        super().__init__(draft, draft.embed_tokens, draft.lm_head, num_draft_tokens, **options)
        if not isinstance(confidence_threshold, (int, float)) or not 0 <= confidence_threshold < 1:
            raise ValueError(f"dspark's confidence_threshold is from 0 (off) up to 1, not {confidence_threshold}")
        if verify not in ("all", *SCHEDULES):
            raise ValueError(f"dspark's verify is all, adaptive or async, not {verify!r}")
        scheduled = verify in SCHEDULES
        if (confidence_threshold or scheduled) and draft.confidence_head is None:
            raise ValueError(f"dspark's confidence_threshold and verify={verify} need a drafter with a confidence head")
        if options.get("tree") is not None and (confidence_threshold or scheduled):
            raise ValueError(f"dspark's tree is verified whole: drop confidence_threshold and verify={verify}")
        if confidence_threshold and scheduled:
            raise ValueError(f"dspark's verify={verify} schedules the rows itself: drop confidence_threshold")
        if scheduled and not costs:
            raise ValueError(f"dspark's verify={verify} needs the target's profiled step costs (a run profiles them)")
        self.draft: DSparkDraft = draft
        self.threshold = float(confidence_threshold)
        self.costs = costs if scheduled else None
        self.whole = not (self.threshold or self.costs)  # at T = 0 every row drafted, the budget's cut the loop's; a
        # cut by confidence decides on the rows the budget leaves, and records them
        self.calibrated = bool(calibrated)
        self.batch: int = options.get("slots", 1)
        if record and (confidence_threshold or scheduled or draft.confidence_head is None):
            raise ValueError("dspark records the confidences of every row: verify=all, no threshold, a confidence head")
        self.recorded: list[tuple[list[float], int]] | None = [] if record else None  # per slot and step drafted:
        # its rows' confidence logits and the drafts accepted
        self._logits: list[list[float]] = []  # (the last drafting's, by drafting slot)
        self.pending: dict[int, list[float]] = {}  # slot -> its drafted rows' logits, until its verdict
        self.history: deque[list[list[float]]] | None = deque(maxlen=2) if verify == "async" else None  # the
        # survivals of the last two steps: the capacity of this one is taken from the first

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        super().start(slots, turns)
        if self.history is not None and len(slots) == self.batch:  # a new batch: the schedule's history anew
            self.history.clear()

    def _scheduled(self, survival: list[list[float]]) -> list[int]:
        """Rows each drafting slot verifies, from their survivals: Algorithm 1 (`verify: adaptive`), or with a
        history of two steps the capacity those steps' survivals give and this step's rows taken in that number
        (`verify: async`)."""
        assert self.costs is not None
        if self.history is None:
            return prefix_lengths(survival, self.costs)
        lengths = (
            top_lengths(survival, capacity(self.history[0], self.costs))
            if len(self.history) == 2
            else prefix_lengths(survival, self.costs)
        )
        self.history.append(survival)
        return lengths

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
        the law it came from; then each slot's chain, cut to the rows it verifies (`_verified`)."""
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
        verified = self._verified(ks, hidden, before)
        return [
            Proposal(
                chain(drafts[i, :k]),
                drawn_from[i, :k] if drawn_from is not None and turn.temperature else None,
                drafted=None if self.whole else n,  # (a confidence's cut is recorded: drafted beside verified)
            )
            if k
            else Proposal(EMPTY, drafted=n)
            for i, (k, n, turn) in enumerate(zip(verified, ks, turns, strict=True))
        ]

    def _verified(self, ks: list[int], hidden: torch.Tensor, before: list[torch.Tensor]) -> list[int]:
        """Rows each drafting slot verifies of its `ks` drafted, from its rows' states [m, k, H] and the tokens
        before them (k of [m]): every one, or those its confidence allows (a threshold, or the batch's schedule;
        one read). Recording, every one, each slot's confidence logits kept (`record`)."""
        if self.recorded is not None:
            self._logits = self.draft.confidence_logits(hidden, torch.stack(before, dim=1)).tolist()
            return ks
        if self.whole:
            return ks
        confidence = self.draft.confidence(hidden, torch.stack(before, dim=1), self.calibrated)  # [m, k]
        if self.costs:  # every slot's rows scheduled together
            return self._scheduled([row[:k] for row, k in zip(confidence.cumprod(1).tolist(), ks, strict=True)])
        confident = (confidence >= self.threshold).long().cumprod(1).sum(1).tolist()  # (DeepSpec's: raw confidences)
        return [min(k, n) for k, n in zip(ks, confident, strict=True)]

    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        found = super().propose(slots, tokens, max_depths)
        if self.recorded is not None:  # each drafting slot's logits, by slot, until its verdict
            rows = iter(self._logits)
            self.pending = {slot: next(rows) for slot, p in zip(slots, found, strict=True) if len(p.tree)}
        return found

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        super().update(slots, tokens, proposals, feedback)
        if self.recorded is not None:
            for slot, proposal, fed in zip(slots, proposals, feedback, strict=True):
                if slot in self.pending:  # (the rows verified: the loop cuts those past the token budget)
                    self.recorded.append((self.pending.pop(slot)[: len(proposal.tree)], len(fed.accepted.rows)))


@implementation("dspark", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    draft: DSparkDraft = res.head(FAMILY.name, res.draft_dtype(params.pop("draft_dtype", None)))
    if params.get("verify") in SCHEDULES:
        params["costs"] = res.costs(slots)
    return DSpark(draft, **params, slots=slots, static=res.graphs, capture=res.graphs)
