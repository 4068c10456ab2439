"""P-EAGLE (Hui et al., arXiv 2602.01469): an EAGLE-3 head drafts a chain of K tokens in one forward. The pairs
the last verification committed (each target state and the token after it) are fed as EAGLE-3 feeds them, followed
by K - 1 parallel rows carrying the head's mask token and learned `mask_hidden`; the last pair's output guesses the
first draft and parallel row j the (j + 2)-th, each seeing the committed pairs and the rows before it (causal, as
vLLM's `parallel_drafting` runs it). The parallel rows' keys are written past the committed pairs and overwritten
by the next step's.

At T > 0 each row is drawn from the head's distribution at the run's temperature and verified against it by the
shared rejection rule (PARD's and DFlash's scheme); at T = 0 the rows are its argmax.

The head's keys live in preallocated rows (`StaticRows`), a batch's slots side by side, in both regimes: a step's
forward (every drafting slot's new pairs, padded to the most a step commits, and its parallel rows) has fixed
shapes and is captured on a GPU under --graphs as one CUDA graph per key span. The prompts' pairs, more than a step
commits, run the same forward over their slots alone, uncaptured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.capture import Replays
from ..core.proposer import NO_PROPOSAL, Drafter, Feedback, Proposal, Turn, chain_of_rows, chain_prefix
from ..core.static_cache import StaticRows
from ..core.static_lm import MAX_CACHE, SPAN
from ..core.transfer import appended, padded_rows, upload
from ..core.tree import additive, chain
from ..heads.eagle3 import feature_layers
from ..heads.peagle import FAMILY, PEagleHead
from ..registry import implementation
from .eagle_static import padded_pairs, rows_of
from .resources import Resources


@dataclass
class Inputs:
    """One key span's captured forward reads these, every slot's."""

    features: torch.Tensor  # [B, P, F]: the newly committed pairs' target states, padded
    ids: torch.Tensor  # [B, P]: the token after each
    count: torch.Tensor  # [B] long: how many of the P pairs are real (a slot that does not draft: 1, never kept)
    committed: torch.Tensor  # [B] long: the pairs already in each slot's rows


class PEagle(Drafter):
    def __init__(
        self,
        head: PEagleHead,
        num_draft_tokens: int = 8,
        *,
        feature_layers: tuple[int, ...],  # the target states the head fuses (CachedLM.run's `layers`)
        target_vocab: int,
        slots: int = 1,
        capture: bool = True,  # (the step's forward captured, on a GPU)
    ) -> None:
        if not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool) or num_draft_tokens < 1:
            raise ValueError(f"peagle needs num_draft_tokens >= 1, not {num_draft_tokens}")
        self.head = head
        self.k = num_draft_tokens
        self.feature_layers = feature_layers
        self.vocab = target_vocab
        self.readable = head.target_ids(torch.arange(head.lm_head.out_features, device=head.fc.weight.device))  # [V']
        self.device = head.fc.weight.device
        self.pad = self.k + 1  # the pairs a step commits at most: the accepted drafts and the root
        self.room = -(-(MAX_CACHE + self.pad + self.k) // SPAN) * SPAN  # rows attended at most; padding goes past
        self.cache = StaticRows(head.config.num_hidden_layers, self.room + self.pad, slots)
        self.batch = slots
        self.lengths = [0] * slots  # each slot's committed pairs in the rows
        self.turns: dict[int, Turn] = {}
        self.pending: dict[int, torch.Tensor] = {}  # [c, F] a slot: target states of committed tokens not yet fed
        self.inputs: dict[int, Inputs] = {}  # by key span
        self.replays = Replays(self.device)
        self.replays.capture = self.replays.capture and capture
        self.alone: int | torch.Tensor | None = None  # the slots a forward runs over alone: one, several [m] (None:
        # every slot)

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        for slot, turn in zip(slots, turns, strict=True):
            self.turns[slot], self.lengths[slot] = turn, 0
            self.pending[slot] = torch.empty(0, self.head.feature_size) if turn.features is None else turn.features

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        for slot, fed in zip(slots, feedback, strict=True):
            assert fed.features is not None  # the target returns the feature_layers' states
            self.pending[slot] = appended(self.pending[slot], fed.features)

    @torch.inference_mode()
    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """Every drafting slot's pairs and parallel rows in one forward (the prompts' in one of their own); each
        slot's chain then its argmax, or drawn from its own generator."""
        members = []  # (index, slot, features [n, F], ids [n], pairs before them, drafts)
        for i, (slot, committed, depth) in enumerate(zip(slots, tokens, max_depths, strict=True)):
            pending, past = self.pending[slot], self.lengths[slot]
            n, k = min(len(pending), len(committed) - 1 - past), min(self.k, depth)
            if n <= 0 or past + n != len(committed) - 1 or k < 1:  # nothing to draft from, or no depth left
                continue
            features, self.pending[slot] = pending[:n], pending[n:]
            self.lengths[slot] = past + n
            members.append((i, slot, features, committed[past + 1 : past + 1 + n], past, k))
        drafted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (logits [K, V'], target ids [K])
        apart = [m for m in members if len(m[3]) > self.pad]  # (the prompts')
        together = [m for m in members if len(m[3]) <= self.pad]
        for run, group in ((self._apart, apart), (self._together, together)):
            if group:
                drafted.update(run([(slot, f, ids, past) for _, slot, f, ids, past, _ in group]))
        found = [NO_PROPOSAL] * len(slots)
        for i, slot, *_, k in members:
            logits, picks = drafted[slot]
            turn = self.turns[slot]
            if turn.temperature == 0:  # all K (the loop cuts a chain past the budget on the device)
                found[i] = Proposal(chain(picks))
            else:
                found[i] = chain_of_rows(self._on_target_vocab(logits[:k]), turn.temperature, turn.generator)
        return found

    def _on_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [k, V'] as the target vocabulary's [k, V] (-inf where the head cannot guess)."""
        if self.head.d2t is None:
            return logits
        full = logits.new_full((len(logits), self.vocab), float("-inf"))
        full[:, self.readable] = logits
        return full

    def _apart(
        self, members: list[tuple[int, torch.Tensor, list[int], int]]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The drafts of the slots `members` ((slot, features [n, F], ids [n], past) each; more pairs than a step
        commits: the prompts') in one uncaptured forward over those slots alone, padded to the most pairs."""
        lanes, count, committed, features, ids = padded_pairs(members, self.device)
        self.cache.span = self._span(max(len(t) + past for _, _, t, past in members))
        self.alone = members[0][0] if len(members) == 1 else lanes  # (one: its rows as a view)
        try:
            logits, picks = self._draft(features, ids, count, committed)
        finally:
            self.alone = self.cache.slot = None
        return {slot: (row, top) for (slot, *_), row, top in zip(members, logits, picks, strict=True)}

    def _together(
        self, members: list[tuple[int, torch.Tensor, list[int], int]]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The drafts of the slots `members` ((slot, features [n, F], ids [n], past) each) in one forward padded
        to the captured shapes (the other slots write past their own pairs, read by nothing), every member's pairs
        written in one copy of the features and one of the host's values."""
        past, count = list(self.lengths), [1] * self.batch
        for slot, _, ids, before in members:
            past[slot], count[slot] = before, len(ids)
        span = self._span(max(past[slot] + count[slot] for slot, *_ in members))
        inputs = self.inputs.get(span)
        if inputs is None:
            width = members[0][1].shape[1]
            zeros = torch.zeros(self.batch, self.pad, dtype=torch.long, device=self.device)
            inputs = self.inputs[span] = Inputs(
                members[0][1].new_zeros(self.batch, self.pad, width),
                zeros,
                torch.ones(self.batch, dtype=torch.long, device=self.device),
                torch.zeros(self.batch, dtype=torch.long, device=self.device),
            )
        at = padded_rows([m[0] for m in members], [len(m[2]) for m in members], self.pad)
        host = upload(count + past + at + [t for _, _, ids, _ in members for t in ids], self.device)
        values, rows, ids = host.split([2 * self.batch, len(at), len(at)])
        inputs.features.view(-1, inputs.features.shape[-1])[rows] = torch.cat([m[1] for m in members])
        inputs.ids.view(-1)[rows] = ids
        inputs.count.copy_(values[: self.batch])
        inputs.committed.copy_(values[self.batch :])
        self.cache.span = span
        logits, picks = self.replays.run(
            span, lambda: self._draft(inputs.features, inputs.ids, inputs.count, inputs.committed)
        )
        logits, picks = logits.clone(), picks.clone()  # (once for every slot: the next replay writes over them)
        return {slot: (logits[slot], picks[slot]) for slot, *_ in members}

    def _span(self, end: int) -> int:
        """The key rows a forward attends over: the pairs up to `end`, then the parallel rows, rounded up to SPAN."""
        return min(-(-(end + self.k - 1) // SPAN) * SPAN, self.room)

    def _draft(
        self, features: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, committed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's first `count` pairs (features [B, P, F], ids [B, P]) at rows committed, committed + 1, ...
        (its padding in scratch rows past `room`), then K - 1 parallel rows after them, causal over the slot's rows:
        the K drafts' logits [B, K, V'] (the last pair's row, then the parallel rows') and their argmax as target
        ids [B, K]."""
        head, batch, width = self.head, *ids.shape
        ahead = torch.arange(width, device=ids.device)  # [P]
        parallel = (committed + count)[:, None] + torch.arange(self.k - 1, device=ids.device)  # [B, K - 1]
        positions = torch.cat([committed[:, None] + ahead, parallel], dim=1)  # [B, P + K - 1]
        scratch = self.room + (ahead if width <= self.pad else ahead.clamp(max=self.pad - 1))  # (the prompts' wider
        # padding shares the last)
        pairs = torch.where(ahead < count[:, None], committed[:, None] + ahead, scratch)
        self.cache.write_rows(torch.cat([pairs, parallel], dim=1), self.alone)
        visible = torch.arange(self.cache.span, device=ids.device) <= positions[..., None]  # [B, n, span]
        mask_features, mask_ids = head.masks(batch, self.k - 1)
        out = head(
            torch.cat([features, mask_features.to(features.dtype)], dim=1),
            torch.cat([ids, mask_ids], dim=1),
            positions,
            additive(visible, head.fc.weight.dtype)[:, None],
            self.cache,
        )  # [B, P + K - 1, H]
        parallel_rows = width + torch.arange(self.k - 1, device=ids.device)
        rows = torch.cat([(count - 1)[:, None], parallel_rows[None].expand(batch, -1)], dim=1)  # [B, K]
        logits = head.logits(rows_of(out, rows))  # [B, K, V']
        return logits, head.target_ids(logits.argmax(-1))


@implementation("peagle", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    head: PEagleHead = res.head(FAMILY.name, res.draft_dtype(params.pop("draft_dtype", None)))
    text = res.target_model.config.get_text_config()
    return PEagle(
        head,
        **params,
        feature_layers=head.layer_ids or feature_layers(text.num_hidden_layers),
        target_vocab=text.vocab_size,
        slots=slots,
        capture=res.graphs,
    )
