"""DFlash: a block-diffusion drafter fills a block of mask tokens after the last committed token in one forward,
conditioned on the target's states of everything committed before it; its rows are verified as a chain.

At T > 0 each row is drawn from the drafter's distribution at the run's temperature and verified against it by
the shared rejection rule (the official code does the same); at T = 0 the rows are the drafter's argmax.

Under --graphs the context's keys and values live in preallocated rows (`heads.dflash.Slots`), and a step's forward
(the newly committed context rows, padded to the most a step commits, and the block) has fixed shapes: captured on
a GPU as one CUDA graph per key span and replayed. The prompt's first block runs it uncaptured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.capture import Replays
from ..core.proposer import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn, chain_of_rows, chain_prefix
from ..core.static_lm import MAX_CACHE, SPAN
from ..core.transfer import upload
from ..heads.dflash import Context, DFlashDraft, slots
from ..registry import implementation
from .resources import Resources


@dataclass
class BlockInputs:
    """One key span's captured block forward reads these."""

    features: torch.Tensor  # [P, F]: the newly committed rows' target states, padded
    count: torch.Tensor  # 0-d long: how many of the P rows are real
    read: torch.Tensor  # 0-d long: the context rows already in the slots
    token: torch.Tensor  # 0-d long: the last committed token, the block's first


class DFlash(Proposer):
    def __init__(
        self,
        draft: DFlashDraft,
        embedding: torch.nn.Module,
        readout: torch.nn.Module,
        num_draft_tokens: int,
        block_size: int | None = None,
        graphs: bool = False,
    ) -> None:
        self.block = draft.block_size if block_size is None else block_size
        if not isinstance(self.block, int) or self.block < 2:
            raise ValueError("dflash needs block_size >= 2 (the root and at least one mask)")
        if not isinstance(num_draft_tokens, int) or not 1 <= num_draft_tokens < self.block:
            raise ValueError(
                f"dflash drafts 1 to block_size - 1 = {self.block - 1} tokens per block, not "
                f"num_draft_tokens {num_draft_tokens}"
            )
        self.draft = draft
        self.embedding = embedding
        self.readout = readout
        self.k = num_draft_tokens
        self.feature_layers = draft.feature_layers
        self.device = draft.fc.weight.device
        self.pad = self.k + 1  # the context rows a step commits at most: the accepted drafts and the root
        self.room = -(-(MAX_CACHE + self.block) // SPAN) * SPAN  # rows attended at most; padding is written past it
        self.slots = slots(draft, self.room + self.pad) if graphs else None
        self.inputs: dict[int, BlockInputs] = {}  # by key span
        self.replays = Replays(self.device)

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.context: Context | None = None  # keys and values of the committed rows the drafter has read
        self.read = 0  # how many committed rows that is
        self.pending = turn.features if turn.features is not None else torch.empty(0, self.draft.feature_size)

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        self.pending = torch.cat([self.pending.to(feedback.features), feedback.features])

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        k = min(self.k, max_depth)
        root = len(tokens) - 1  # the block's first position; rows before it are the context
        new = root - self.read
        if k < 1 or len(self.pending) < new:
            return NO_PROPOSAL
        features, self.pending, read, self.read = self.pending[:new], self.pending[new:], self.read, root
        if self.slots is not None:
            logits = self._static(features, read, tokens[-1])[:k]
        else:
            ids = torch.full((1, self.block), self.draft.mask_token_id, device=self.device)
            ids[0, 0] = tokens[-1]
            block = self.draft.embed(ids, self.embedding)  # [1, n, H]
            positions = torch.arange(read, root + self.block, device=self.device)[None]
            hidden, self.context = self.draft(block, features[None], positions, None, self.context)
            logits = self.draft.logits(hidden[0, 1 : 1 + k], self.readout)  # [k, V]: row i guesses token root + i
        return chain_of_rows(logits, self.temperature, self.generator)

    def _static(self, features: torch.Tensor, read: int, token: int) -> torch.Tensor:
        """Logits [num_draft_tokens, V] of the block after `read` context rows and the new ones `features` [c, F],
        on the slots: the padded, captured forward where c fits the padding, else the same forward at c rows."""
        span = min(-(-(read + len(features) + self.block) // SPAN) * SPAN, self.room)
        if len(features) > self.pad:
            return self._block(
                features, *(upload(torch.tensor(v), self.device) for v in (len(features), read, token)), span
            )
        inputs = self.inputs.get(span)
        if inputs is None:
            counts = torch.zeros(3, dtype=torch.long, device=self.device)
            inputs = self.inputs[span] = BlockInputs(features.new_zeros(self.pad, features.shape[1]), *counts)
        inputs.features[: len(features)] = features
        inputs.count.fill_(len(features))
        inputs.read.fill_(read)  # (capture's warm-up runs write past the context's rows only)
        inputs.token.fill_(token)
        return self.replays.run(
            span, lambda: self._block(inputs.features, inputs.count, inputs.read, inputs.token, span)
        ).clone()

    def _block(
        self, features: torch.Tensor, count: torch.Tensor, read: torch.Tensor, token: torch.Tensor, span: int
    ) -> torch.Tensor:
        """The block forward on the slots: context rows `count` of `features` [P, F] written after `read` (the rest
        into scratch rows past `room`), the block after them; attention over the first `span` rows up to the
        block's end. Logits [num_draft_tokens, V]."""
        rows, cells = torch.arange(len(features), device=self.device), torch.arange(self.block, device=self.device)
        root = read + count
        context = torch.where(rows < count, read + rows, self.room + rows)  # [P]: padding goes to scratch rows
        at = torch.cat([context, root + cells])
        for layer in self.slots:
            layer.at, layer.span = at, span
        ids = torch.full((1, self.block), self.draft.mask_token_id, device=self.device)
        ids[0, :1] = token
        block = self.draft.embed(ids, self.embedding)  # [1, n, H]
        positions = torch.cat([read + rows, root + cells])[None]
        mask = (torch.arange(span, device=self.device) < root + self.block)[None, None, None]  # [1, 1, 1, span]
        hidden, _ = self.draft(block, features[None], positions, mask, self.slots)
        return self.draft.logits(hidden[0, 1 : 1 + self.k], self.readout)


@implementation("dflash", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True)
def build(params: dict, res: Resources) -> Proposer:
    dtype = res.draft_dtype(params.pop("draft_dtype", None))
    draft = res.head("dflash", dtype)
    return DFlash(draft, res.target_model.get_input_embeddings(), res.readout(dtype), **params, graphs=res.graphs)
