"""DFlash: a block-diffusion drafter fills a block of mask tokens after the last committed token in one forward,
conditioned on the target's states of everything committed before it; its rows are verified as a chain.

At T > 0 each row is drawn from the drafter's distribution at the run's temperature and verified against it by
the shared rejection rule (the official code does the same); at T = 0 the rows are the drafter's argmax.

`tree=N` (DDTree, arXiv 2604.12989): the block's rows become a tree of N nodes instead, the N best-scoring paths
through each position's `tree_top_k` most likely tokens (`core.best_tree`: a path scores the sum of its tokens'
log-probabilities, the positions being drafted independently), built for every slot at once and verified in one
forward; its nodes are point masses, so the shared rules stay exact at every temperature. DSpark and DFlash2 build
theirs from rows whose laws depend on the path (`_trees`).

Under --graphs the context's keys and values live in preallocated rows (`heads.dflash.Slots`), and a step's forward
(the newly committed context rows, padded to the most a step commits, and the block) has fixed shapes: captured on
a GPU as one CUDA graph per key span and replayed. The prompt's first block runs it uncaptured. A batch's slots
(`run --batch`) share those rows, side by side, and draft their blocks in one forward (`BlockDrafting`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..core.best_tree import best_trees
from ..core.capture import Replays
from ..core.proposer import NO_PROPOSAL, Drafter, Feedback, Proposal, Turn, chain_of_rows, chain_prefix
from ..core.static_lm import MAX_CACHE, SPAN
from ..core.transfer import appended, padded_rows, upload
from ..core.tree import Tree, chain
from ..heads.dflash import Context, DFlashDraft, Slots, slots
from ..registry import implementation
from .resources import Resources


@dataclass
class BlockInputs:
    """One key span's captured block forward reads these, every slot's."""

    features: torch.Tensor  # [B, P, F]: the newly committed rows' target states, padded
    count: torch.Tensor  # [B] long: how many of the P rows are real
    read: torch.Tensor  # [B] long: the context rows already in the slots
    token: torch.Tensor  # [B] long: the last committed token, the block's first


@dataclass
class Lane:
    """One slot's turn: the committed rows the drafter has read, and the target states it has not yet."""

    turn: Turn
    pending: torch.Tensor  # [c, F]
    read: int = 0
    context: Context | None = None  # keys and values of the rows read (the eager forward's; else in BlockDrafting)


class DFlash(Drafter):
    first = 1  # the block's row the first draft is read from: DFlash's anchor row guesses nothing (DSpark's does)
    whole = True  # at T = 0 a slot near its token budget proposes all k (the loop cuts it on the device)

    def __init__(
        self,
        draft: DFlashDraft,
        embedding: torch.nn.Module,
        readout: torch.nn.Module,
        num_draft_tokens: int,
        block_size: int | None = None,
        tree: int | None = None,
        tree_top_k: int = 4,
        *,
        slots: int = 1,
        static: bool = False,  # the block forward on preallocated rows, every slot's in one (`BlockDrafting`)
        capture: bool = True,  # (and captured, on a GPU)
    ) -> None:
        self.block = draft.block_size if block_size is None else block_size
        if not isinstance(self.block, int) or self.block < 2:
            raise ValueError("dflash needs block_size >= 2 (the root and at least one mask)")
        most = self.block - self.first
        if not isinstance(num_draft_tokens, int) or not 1 <= num_draft_tokens <= most:
            raise ValueError(
                f"{type(self).__name__.lower()} drafts 1 to {most} tokens per block of {self.block} (block_size - "
                f"{self.first} = {most}), not num_draft_tokens {num_draft_tokens}"
            )
        if tree is not None and (not isinstance(tree, int) or tree < 1):
            raise ValueError(f"dflash's tree is a node budget of at least 1 (or null: a chain), not {tree}")
        if not isinstance(tree_top_k, int) or tree_top_k < 1:
            raise ValueError(f"dflash's tree_top_k is the candidates per position, at least 1, not {tree_top_k}")
        self.tree, self.tree_top_k = tree, tree_top_k
        self.draft = draft
        self.embedding = embedding
        self.readout = readout
        self.k = num_draft_tokens
        self.feature_layers = draft.feature_layers
        self.device = draft.fc.weight.device
        self.lanes: dict[int, Lane] = {}
        self.blocks = BlockDrafting(self, slots, capture) if static or slots > 1 else None

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        for slot, turn in zip(slots, turns, strict=True):
            pending = turn.features if turn.features is not None else torch.empty(0, self.draft.feature_size)
            self.lanes[slot] = Lane(turn, pending)

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        for slot, fed in zip(slots, feedback, strict=True):
            assert fed.features is not None  # the target returns the feature_layers' states
            lane = self.lanes[slot]
            lane.pending = appended(lane.pending, fed.features)

    def _new_rows(self, lane: Lane, tokens: list[int], max_depth: int) -> tuple[int, torch.Tensor, int] | None:
        """The rows to draft (k), the newly committed context rows' features [c, F] taken from the pending ones,
        and how many rows were read before them; None when there is nothing to draft or features are missing."""
        k = min(self.k, max_depth)
        root = len(tokens) - 1  # the block's first position; rows before it are the context
        new = root - lane.read
        if k < 1 or len(lane.pending) < new:
            return None
        features, lane.pending, read, lane.read = lane.pending[:new], lane.pending[new:], lane.read, root
        return k, features, read

    @torch.inference_mode()
    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """Every slot's block in one forward (`BlockDrafting.logits`; without it, slot after slot); each slot's
        rows then drawn from its own generator, as it draws alone. At T = 0 (`whole`) a slot near its token budget
        proposes as many tokens as the others, so every chain is a row of one block."""
        found: list[Proposal] = [NO_PROPOSAL] * len(slots)
        members = []
        whole = self.whole and all(self.lanes[slot].turn.temperature == 0 for slot in slots)
        for i, (slot, committed, depth) in enumerate(zip(slots, tokens, max_depths, strict=True)):
            rows = self._new_rows(self.lanes[slot], committed, self.k if whole and depth > 0 else depth)
            if rows is not None:
                members.append((i, rows[0], (slot, rows[1], rows[2], committed[-1])))
        if self.blocks is not None:
            drafted = self.blocks.logits([m for _, _, m in members])
        else:
            drafted = [self._eager(self.lanes[s], f, read, last) for _, _, (s, f, read, last) in members]
        turns = [self.lanes[slots[i]].turn for i, _, _ in members]
        roots = [root for *_, (_, _, _, root) in members]
        ks = [k for _, k, _ in members]
        if not ks:
            return found
        made = (
            [Proposal(tree) for tree in self._trees(ks, drafted, upload(roots, self.device), self.tree)]
            if self.tree is not None
            else self._proposals(ks, drafted, turns, roots)
        )
        for (i, *_), proposal in zip(members, made, strict=True):
            found[i] = proposal
        return found

    def _trees(self, ks: list[int], drafted: list[torch.Tensor], roots: torch.Tensor, budget: int) -> list[Tree]:
        """Every drafting slot's DDTree over its block's rows `drafted[i]` (`_rows`'s) after its last committed
        token `roots[i]`: a row's law is the same under every path (DFlash drafts its rows independently), so each
        row's `tree_top_k` likeliest tokens are found once."""
        logits = torch.stack([rows[: max(ks)] for rows in drafted]).float()  # [m, k, V]
        top = torch.log_softmax(logits, -1).topk(min(self.tree_top_k, logits.shape[-1]), -1)  # [m, k, t] each
        return best_trees(
            lambda d, choices, _: top.values[:, d, None].expand(-1, choices.shape[1], -1),
            torch.zeros_like(roots),
            ks,
            budget,
            self.tree_top_k,
            lambda d, choices: top.indices[:, d].gather(1, choices),
        )

    def _proposals(
        self, ks: list[int], drafted: list[torch.Tensor], turns: list[Turn], roots: list[int]
    ) -> list[Proposal]:
        """Each drafting slot's proposal of `ks[i]` tokens from its block's rows `drafted[i]` (`_rows`'s: logits
        [num_draft_tokens, V]) after the last committed token `roots[i]`."""
        deepest = max(ks)
        if all(turn.temperature == 0 for turn in turns):  # every slot's argmax at once, each chain its first k
            picks = torch.stack([logits[:deepest] for logits in drafted]).argmax(-1)
            return [Proposal(chain(row[:k])) for k, row in zip(ks, picks, strict=True)]
        return [
            chain_of_rows(logits[:k], turn.temperature, turn.generator)
            for k, logits, turn in zip(ks, drafted, turns, strict=True)
        ]

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the drafting keeps of the block's draft rows' states [..., k, H]: their logits through the target's
        readout (DSpark keeps the states: its Markov head reads them)."""
        return self.draft.logits(hidden, self.readout)

    def _eager(self, lane: Lane, features: torch.Tensor, read: int, token: int) -> torch.Tensor:
        """One slot's block forward on its own context (no preallocated rows): logits [num_draft_tokens, V], row i
        guessing token root + i."""
        ids = torch.full((1, self.block), self.draft.mask_token_id, device=self.device)
        ids[0, 0] = token
        block = self.draft.embed(ids, self.embedding)  # [1, n, H]
        positions = torch.arange(read, read + len(features) + self.block, device=self.device)[None]
        hidden, lane.context = self.draft(block, features[None], positions, None, lane.context)
        return self._rows(hidden[0, self.first : self.first + self.k])


class BlockDrafting:
    """DFlash's block forward on preallocated rows (`heads.dflash.Slots`; under --graphs, and for a batch's slots,
    side by side): the newly committed context rows, padded to the most a step commits, and the block, in fixed
    shapes, captured on a GPU (with --graphs) as one CUDA graph per key span and replayed. Slots with more new rows
    (the prompts') run the same forward over themselves, uncaptured. `dflash`'s drafter, embedding, readout and
    block are every slot's."""

    def __init__(self, dflash: DFlash, batch: int = 1, capture: bool = True) -> None:
        self.dflash = dflash
        self.batch = batch
        self.pad = dflash.k + 1  # the context rows a step commits at most: the accepted drafts and the root
        self.room = -(-(MAX_CACHE + dflash.block) // SPAN) * SPAN  # rows attended at most; padding goes past it
        self.slots = slots(dflash.draft, self.room + self.pad, batch)
        self.reads = [0] * batch  # each slot's context rows in the slots
        self.inputs: dict[int, BlockInputs] = {}  # by key span
        self.replays = Replays(dflash.device)
        self.replays.capture = self.replays.capture and capture

    def logits(self, members: list[tuple[int, torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """For each (slot, features [c, F] of its new context rows, rows read before them, last committed token):
        its block's logits [num_draft_tokens, V], the slots whose new rows fit the padding in one forward."""
        out: dict[int, torch.Tensor] = {}
        for slot, features, read, _ in members:
            self.reads[slot] = read + len(features)
        apart = [m for m in members if len(m[1]) > self.pad]  # (the prompts')
        together = [m for m in members if len(m[1]) <= self.pad]
        for run, group in ((self._apart, apart), (self._together, together)):
            if group:
                out.update(run(group))
        return [out[slot] for slot, *_ in members]

    def _apart(self, members: list[tuple[int, torch.Tensor, int, int]]) -> dict[int, torch.Tensor]:
        """The slots `members` (more new rows than a step commits: the prompts') in one uncaptured forward over
        those slots alone, their context rows padded to the most (the padding into scratch rows)."""
        m, device = len(members), self.dflash.device
        counts = [len(features) for _, features, _, _ in members]
        width, size = max(counts), members[0][1].shape[-1]
        at = padded_rows(list(range(m)), counts, width)
        host = upload(
            [s for s, *_ in members] + counts + [r for *_, r, _ in members] + [t for *_, t in members] + at, device
        )
        lanes, count, before, last, rows = host.split([m, m, m, m, len(at)])
        features = members[0][1].new_zeros(m * width, size)
        features[rows] = torch.cat([f for _, f, _, _ in members])
        span = self._span(max(c + r for c, (*_, r, _) in zip(counts, members, strict=True)))
        if self.batch == 1:
            own = self.slots
        elif m == 1:
            own = [layer.slot(members[0][0]) for layer in self.slots]  # (views)
        else:
            own = [layer.over(lanes) for layer in self.slots]
        logits = self._block(features.view(m, width, size), count, before, last, span, own)
        return {slot: row for (slot, *_), row in zip(members, logits, strict=True)}

    def _together(self, members: list[tuple[int, torch.Tensor, int, int]]) -> dict[int, torch.Tensor]:
        """The padded, captured forward over every slot (those not in `members` write past their own rows)."""
        count, read, token = [0] * self.batch, list(self.reads), [0] * self.batch
        for slot, features, before, last in members:
            count[slot], read[slot], token[slot] = len(features), before, last
        span = self._span(max(r + c for r, c in zip(read, count, strict=True)))
        inputs = self.inputs.get(span)
        if inputs is None:
            width = members[0][1].shape[1]
            zeros = torch.zeros(3, self.batch, dtype=torch.long, device=self.dflash.device)
            inputs = self.inputs[span] = BlockInputs(members[0][1].new_zeros(self.batch, self.pad, width), *zeros)
        rows = padded_rows([m[0] for m in members], [len(m[1]) for m in members], self.pad)
        host = upload(count + read + token + rows, self.dflash.device)
        values, at = host[: 3 * self.batch].view(3, self.batch), host[3 * self.batch :]
        inputs.features.view(-1, inputs.features.shape[-1])[at] = torch.cat([m[1] for m in members])
        inputs.count.copy_(values[0])
        inputs.read.copy_(values[1])  # (capture's warm-up runs write past the context's rows only)
        inputs.token.copy_(values[2])
        logits = self.replays.run(
            span, lambda: self._block(inputs.features, inputs.count, inputs.read, inputs.token, span, self.slots)
        ).clone()  # (once for every slot: the next replay writes over them)
        return {slot: logits[slot] for slot, *_ in members}

    def _span(self, end: int) -> int:
        """The key rows a forward attends over: the context up to `end`, then the block, rounded up to SPAN."""
        return min(-(-(end + self.dflash.block) // SPAN) * SPAN, self.room)

    def _block(
        self,
        features: torch.Tensor,
        count: torch.Tensor,
        read: torch.Tensor,
        token: torch.Tensor,
        span: int,
        rows: list[Slots],
    ) -> torch.Tensor:
        """The block forward on `rows`: each slot's context rows `count` of `features` [B, P, F] written after its
        `read` (the rest into scratch rows past `room`), its block after them; attention over the first `span` rows
        up to its block's end. Logits [B, num_draft_tokens, V]."""
        dflash = self.dflash
        device = dflash.device
        ahead = torch.arange(features.shape[1], device=device)  # [P]
        cells = torch.arange(dflash.block, device=device)
        root = read + count  # [B]
        scratch = self.room + (ahead if len(ahead) <= self.pad else ahead.clamp(max=self.pad - 1))  # (the prompts'
        # wider padding shares the last)
        context = torch.where(ahead < count[:, None], read[:, None] + ahead, scratch)  # [B, P]: padding goes to
        at = torch.cat([context, root[:, None] + cells], dim=1)  # scratch rows
        for layer in rows:
            layer.at, layer.span = at, span
        ids = torch.full((len(features), dflash.block), dflash.draft.mask_token_id, device=device)
        ids[:, :1] = token[:, None]
        block = dflash.draft.embed(ids, dflash.embedding)  # [B, n, H]
        positions = torch.cat([read[:, None] + ahead, root[:, None] + cells], dim=1)
        mask = (torch.arange(span, device=device) < (root + dflash.block)[:, None])[:, None, None]  # [B, 1, 1, span]
        hidden, _ = dflash.draft(block, features, positions, mask, rows)
        return dflash._rows(hidden[:, dflash.first : dflash.first + dflash.k])


@implementation("dflash", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True, batched=True)
def build(params: dict, res: Resources, slots: int) -> Drafter:
    dtype = res.draft_dtype(params.pop("draft_dtype", None))
    draft: DFlashDraft = res.head("dflash", dtype)
    embedding, readout = res.target_model.get_input_embeddings(), res.readout(dtype)
    most = (params.get("block_size") or draft.block_size) - DFlash.first
    if isinstance(params["num_draft_tokens"], int) and params["num_draft_tokens"] > most:  # as llama.cpp clamps
        print(
            f"dflash: this drafter's blocks of {most + DFlash.first} rows draft {most} tokens a step, not "
            f"num_draft_tokens {params['num_draft_tokens']}: drafting {most}",
            file=sys.stderr,
        )
        params["num_draft_tokens"] = most
    return DFlash(draft, embedding, readout, **params, slots=slots, static=res.graphs, capture=res.graphs)
