"""DFlash: a block-diffusion drafter fills a block of mask tokens after the last committed token in one forward,
conditioned on the target's states of everything committed before it; its rows are verified as a chain.

At T > 0 each row is drawn from the drafter's distribution at the run's temperature and verified against it by
the shared rejection rule (the official code does the same); at T = 0 the rows are the drafter's argmax.
"""

from __future__ import annotations

import torch

from ..core.proposer import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn, chain_prefix
from ..core.sampling import probabilities
from ..core.tree import chain
from ..heads.dflash import Context, DFlashDraft
from ..registry import implementation
from .resources import Resources


class DFlash(Proposer):
    def __init__(self, draft: DFlashDraft, embedding: torch.nn.Module, readout: torch.nn.Module,
                 num_draft_tokens: int, block_size: int | None = None) -> None:  # fmt: skip
        self.block = draft.block_size if block_size is None else block_size
        if not isinstance(self.block, int) or self.block < 2:
            raise ValueError("dflash needs block_size >= 2 (the root and at least one mask)")
        if not isinstance(num_draft_tokens, int) or not 1 <= num_draft_tokens < self.block:
            raise ValueError(f"dflash drafts 1 to block_size - 1 = {self.block - 1} tokens per block, not "
                             f"num_draft_tokens {num_draft_tokens}")  # fmt: skip
        self.draft = draft
        self.embedding = embedding
        self.readout = readout
        self.k = num_draft_tokens
        self.feature_layers = draft.feature_layers
        self.device = draft.fc.weight.device

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
        ids = torch.full((1, self.block), self.draft.mask_token_id, device=self.device)
        ids[0, 0] = tokens[-1]
        block = self.draft.embed(ids, self.embedding)  # [1, n, H]
        positions = torch.arange(self.read, root + self.block, device=self.device)[None]
        hidden, self.context = self.draft(block, self.pending[None, :new], positions, None, self.context)
        self.pending, self.read = self.pending[new:], root
        logits = self.draft.logits(hidden[0, 1 : 1 + k], self.readout)  # [k, V]: row i guesses token root + i
        if self.temperature == 0:
            return Proposal(chain(logits.argmax(-1).tolist()))
        q = probabilities(logits, self.temperature)
        drafted = torch.multinomial(q, 1, generator=self.generator).squeeze(1)
        return Proposal(chain(drafted.tolist()), q)


@implementation("dflash", color="#e377c2", nested=chain_prefix("num_draft_tokens"))
def build(params: dict, res: Resources) -> Proposer:
    dtype = res.draft_dtype(params.pop("draft_dtype", None))
    draft = res.head("dflash", dtype)
    return DFlash(draft, res.target_model.get_input_embeddings(), res.readout(dtype), **params)
