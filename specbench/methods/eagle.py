"""EAGLE-1, EAGLE-2 and EAGLE-3: a one-layer draft head autoregresses over the target's features and grows a
token tree level by level. One drafting loop serves all three; the head is pluggable (EAGLE-1/2: the target's
final state and lm_head; EAGLE-3: three fused target states, its own readout over a draft vocabulary whose ids
map to target ids) and an expansion policy (`methods.eagle_trees`: EAGLE-1's static tree of ranks, EAGLE-2/3's
dynamic tree) decides which candidates become nodes, which nodes grow children, and which nodes are sent to the
target.

Candidates are the draft's deterministic top-k, so at T > 0 they go to verification as point masses
(draft_probs None): accept x with probability p(x), else zero p(x) and try the next sibling. That is lossless.

With `sampled` (T > 0 only), each grown node's children are instead drawn from the draft's distribution at
the run's temperature without replacement (`sampling.draw_distinct_padded`), and each is verified against the
law it was drawn from (recursive rejection sampling: the shared exact rule with those rows as draft_probs), which
keeps far more acceptance when sampling. Exactness needs every node's place in the tree to be decided
without looking at its own token: siblings are tested in draw order, a node's children may depend on its
score, but EAGLE-2's final pick of the best-scoring nodes would bias the draws, so a sampled dynamic tree
keeps the first `total_tokens - 1` candidates in the order they were drawn (level by level) instead.

The candidates live in tensors on the head's device (`Draft`), a whole level at a time: no Python runs per node,
and the host waits on the device only for a count that depends on the draft (how many children a sampled level
admits and grows; a static tree of top-k candidates reads its levels from the template, `StaticTree.fixed`) and
once at the end, for the tree handed to the target. The last proposal's candidates stay on the proposer as
`drafted`. Under --graphs, top-k candidates draft on a static cache, captured on a GPU (`StaticDrafting`), and the
tree stays on the device for the target to verify and read with its picks (`DeviceTree`). A batch's slots
(`run --batch`) share one static cache and draft together: every tensor of a draft has the slots as its first
dimension, and one head forward per level serves them all (`Eagle.propose_all`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers import DynamicCache

from ..core import choices
from ..core.capture import Replays, uncompiled
from ..core.proposer import NO_PROPOSAL, Feedback, Nested, Proposal, Proposer, Turn, tree_prefix
from ..core.sampling import draw_distinct_padded, probabilities
from ..core.static_cache import StaticRows
from ..core.static_lm import MAX_CACHE, SPAN
from ..core.transfer import upload
from ..core.tree import DeviceTree, Tree, additive, additive_mask, ancestors_from
from ..heads import frequencies
from ..heads.eagle import EagleHead
from ..heads.eagle3 import Eagle3Head, feature_layers
from ..models.loading import compile_function
from ..registry import implementation, unless_sampled
from .eagle_trees import Draft, DynamicTree, StaticTree, level_nodes, level_scores
from .resources import Resources

if TYPE_CHECKING:  # (importing heads.mtp registers its family: methods.mtp does)
    from ..heads.mtp import MtpHead


class Ahead(NamedTuple):
    """Where a draft's fed levels sit and their rotary embedding, computed once a draft, not once a level."""

    positions: torch.Tensor  # [B or 1, levels]: level d + 1 is fed at the root's position + d
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [B or 1, levels, head dim]

    @staticmethod
    def of(
        head: EagleHead | Eagle3Head | MtpHead, hidden: torch.Tensor, position: int | torch.Tensor, levels: int
    ) -> Ahead:
        """At the roots' positions: `position` an int (one sequence) or [B] (each sequence's)."""
        root = position[:, None] if isinstance(position, torch.Tensor) else position
        positions = torch.arange(levels, device=hidden.device)[None] + root
        return Ahead(positions, head.rotary(hidden, positions))


class Children(NamedTuple):
    """The candidate children of each growing node, in rank order."""

    tokens: torch.Tensor  # [B, F, k] target ids
    logps: torch.Tensor  # [B, F, k] float32 draft log-probabilities
    valid: torch.Tensor | None  # [1, F, k] bool when sampled: the row had mass for that many draws; None: all
    laws: torch.Tensor | None  # [1, F, k, V] when sampled: the law each was drawn from, over the target vocabulary


class Eagle(Proposer):
    def __init__(
        self,
        head: EagleHead | Eagle3Head | MtpHead,
        lm_head: Callable[[torch.Tensor], torch.Tensor],  # head output [n, H] -> draft-vocabulary logits [n, V']
        expansion: StaticTree | DynamicTree,
        *,
        feature_layers: tuple[int, ...] = (-1,),  # the target states the head reads (CachedLM.run's `layers`)
        target_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,  # draft ids -> target ids; None: equal
        target_vocab: int | None = None,  # the target's vocabulary size when the draft's differs
        sampled: bool = False,  # at T > 0, draw children from the draft without replacement (module docstring)
        drafting: Callable[[Eagle], StaticDrafting] | None = None,  # top-k candidates draft on a static cache
        slot: int = 0,  # this proposer's slot of that drafting's batch
    ) -> None:
        self.head = head
        self.lm_head = lm_head
        self.expansion = expansion
        self.feature_layers = feature_layers
        self.target_ids = target_ids
        self.target_vocab = target_vocab
        self.sampled = sampled
        self.device = head.fc.weight.device
        self.dtype = head.fc.weight.dtype  # the head's masks' (additive: 0 where a key is seen, the dtype's min not)
        self.eye = additive(torch.eye(expansion.fed, dtype=torch.bool, device=self.device), self.dtype)  # a level
        # grows at most `fed` nodes; each sees itself
        self.drafted = Draft.empty(self.device)  # the last proposal's candidates, kept or not
        self.constants: dict[tuple[str, int, int], torch.Tensor] = {}  # `_constant`'s
        self.slot = slot
        self.static = drafting(self) if drafting is not None else None

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.sampling = self.sampled and turn.temperature > 0
        self.pending = turn.features if turn.features is not None else torch.empty(0, self.head.feature_size)
        self.root: torch.Tensor | None = None  # [H]: the head's output at the root's position
        if self.static is not None and not self.sampling:  # the prompt's pairs are fed with the first draft
            self.cache: StaticRows | DynamicCache = self.static.cache
            self.static.lengths[self.slot] = 0
            return
        self.cache = DynamicCache(config=self.head.config)  # pairs of committed tokens only
        self._extend(turn.prompt)

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        assert feedback.features is not None  # the target returns the feature_layers' states
        self.pending = torch.cat([self.pending.to(feedback.features), feedback.features])
        if not isinstance(self.cache, StaticRows):
            self._extend(tokens)

    @torch.inference_mode()
    def _extend(self, tokens: list[int]) -> None:
        """Feed the committed pairs (feature of token i, token i + 1) the draft cache lacks."""
        past = self.cache.get_seq_length()
        n = min(len(self.pending), len(tokens) - 1 - past)
        if n <= 0:
            return
        ids = torch.tensor([tokens[past + 1 : past + 1 + n]], device=self.device)
        positions = torch.arange(past, past + n, device=self.device)[None]
        allowed = torch.ones(n, past + n, dtype=torch.bool).tril(past)  # causal over the cache and the new rows
        mask = additive_mask(allowed, self.head.fc.weight.dtype, self.device)
        out = self.head(self.pending[None, :n], ids, positions, mask, self.cache)[0]  # [n, H]
        self.pending = self.pending[n:]
        self.root = out[-1] if past + n == len(tokens) - 1 else None

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        depths = min(self.expansion.max_depth, max_depth)
        self.drafted = Draft.empty(self.device)
        if isinstance(self.cache, StaticRows):
            return self.propose_all([self], [tokens], [max_depth])[0]
        if self.root is None or depths < 1:
            return NO_PROPOSAL
        batch, fed = self._grow(self.root[None], depths, self.cache.get_seq_length())
        draft = batch.row(0)
        if fed:  # tree keys are discarded, the committed prefix stays
            self.cache.crop(-fed)  # (transformers 5 crops by minus the count)
        self.drafted = draft
        keep = self.expansion.select(draft)
        return Proposal(draft.tree(keep), None if draft.laws is None else draft.laws[keep])

    @classmethod
    @torch.inference_mode()
    def propose_all(cls, proposers: list, tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """Slots of one static drafting (a batch's: `Resources.slot_of`) draft together, one head forward per level
        for every slot (`StaticDrafting.propose`); sampled children (the eager cache) one slot after another."""
        static = {id(p.static) if isinstance(p.cache, StaticRows) else None for p in proposers}
        if None in static or len(static) > 1:
            return super().propose_all(proposers, tokens, max_depths)
        depths = [min(p.expansion.max_depth, d) for p, d in zip(proposers, max_depths, strict=True)]
        found = []
        for p, drafted in zip(proposers, proposers[0].static.propose(proposers, tokens, depths), strict=True):
            p.drafted = Draft.empty(p.device) if drafted is None else drafted[0]
            found.append(NO_PROPOSAL if drafted is None else Proposal(drafted[1]))
        return found

    def _grow(self, root: torch.Tensor, depths: int, position: int | torch.Tensor) -> tuple[Draft, int]:
        """The drafts [B, n] of `depths` levels from the head's outputs at the roots [B, H] (a batch's sequences
        drafted together; B = 1 for one, and for sampled children, whose counts depend on the draws), at the
        positions (the committed pairs in the cache) `position` (an int, or [B]); and how many tree rows went into
        each sequence's cache."""
        batch = len(root)
        levels, start = [], 0  # the draft's levels, and the nodes before the newest
        frontier = torch.full((batch, 1), -1, device=self.device)  # the growing nodes [B, F]; -1 is the root
        frontier_slots = None  # StaticTree: the growing nodes' template slots [F], every sequence's (None: the root)
        reached = torch.zeros(batch, 1, dtype=torch.float64, device=self.device)  # [B, F]: their scores
        hidden = root[:, None]  # [B, F, H]: the head's outputs at their positions
        seen = torch.zeros(batch, 1, 0, dtype=self.dtype, device=self.device)  # [B, F, fed]: their fed
        # ancestors-or-self (additive: 0 where seen)
        laws = []  # per level [1, n, V] when sampled
        ahead = Ahead.of(self.head, hidden, position, depths - 1)
        for depth in range(1, depths + 1):
            children = self._children(self.lm_head(hidden))  # [B, F, k] each
            k = children.tokens.shape[-1]
            slots = self.expansion.admits(frontier_slots, k, self.device)  # [F, k] or None
            admitted = children.valid  # [1, F, k] or None (all): which candidates become nodes
            fixed = None if children.valid is not None else self.expansion.fixed(depth, k, self.device)
            if slots is not None:
                admitted = slots >= 0 if admitted is None else admitted & (slots >= 0)
            if admitted is None:  # every candidate is a node: the level is the [F, k] top-k as they come
                picked, rows = None, self._constant("rows", frontier.shape[1], k)
            else:  # (the same candidates in every sequence: a template's, or one sequence's draws)
                picked = fixed[0] if fixed is not None else admitted.flatten().nonzero().squeeze(1)
                rows = picked // k  # each node's parent's row in the frontier
            level = Draft(
                level_nodes(children.tokens, picked),
                frontier[:, rows],
                level_scores(reached, children.logps, rows, picked),
                _per_slot(self._constant("depths", len(rows), depth), batch),
                None if slots is None else _per_slot(level_nodes(slots, picked), batch),
            )
            if children.laws is not None:
                laws.append(children.laws.flatten(1, 2)[:, picked])
            levels.append(level)
            if depth == depths:
                break
            grown = fixed[1].expand(batch, -1) if fixed is not None else self.expansion.grow(level)  # [B, F']:
            if not grown.shape[-1]:  # positions in the level
                break
            above = rows[grown]  # [B, F']: each grown node's parent's row in the frontier
            eye = self.eye[: grown.shape[-1], : grown.shape[-1]].expand(batch, -1, -1)
            seen = torch.cat([_rows(seen, above), eye], dim=2)
            hidden = self._feed(_rows(hidden, above), level.tokens.gather(1, grown), seen, position, depth, ahead)
            frontier, reached = start + grown, level.scores.gather(1, grown)
            frontier_slots = None if level.slots is None else level.slots[0, grown[0]]
            start += len(level)
        draft = Draft.joined(levels)
        if laws:
            draft.laws = torch.cat(laws, dim=1)
        return draft, seen.shape[-1]

    def _constant(self, kind: str, n: int, value: int) -> torch.Tensor:
        """A level's tensor that depends on its shape only (never written to), made once, so a captured step
        launches nothing for it: "rows" [n * value], each of n parents' `value` candidates' parent row; "depths"
        [n], `value` n times."""
        key = (kind, n, value)
        if key not in self.constants:
            self.constants[key] = (
                torch.arange(n * value, device=self.device) // value
                if kind == "rows"
                else torch.full((n,), value, device=self.device)
            )
        return self.constants[key]

    def _children(self, logits: torch.Tensor) -> Children:
        """The candidate children of each growing node from its row of logits [B, F, V']: the draft's top k, or
        when sampling (one sequence: B = 1) k draws without replacement and their laws."""
        k = min(self.expansion.branch, logits.shape[-1])
        if not self.sampling:
            top = torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(k)  # (the cast inside: one kernel)
            ids = top.indices if self.target_ids is None else self.target_ids(top.indices)
            return Children(ids, top.values, None, None)
        draft_ids = torch.arange(logits.shape[-1], device=logits.device)
        to_target = draft_ids if self.target_ids is None else self.target_ids(draft_ids)  # [V']
        q = probabilities(logits[0], self.temperature)  # [F, V']
        drawn, laws, real = draw_distinct_padded(q, k, self.generator)  # [F, k], [F, k, V'], [F] real draws
        if self.target_ids is not None:  # laws move onto the target vocabulary
            assert self.target_vocab is not None  # given with target_ids
            full = laws.new_zeros(*drawn.shape, self.target_vocab)
            full[..., to_target] = laws
            laws = full
        valid = torch.arange(drawn.shape[1], device=drawn.device) < real[:, None]
        return Children(to_target[drawn][None], torch.log(q.gather(1, drawn))[None], valid[None], laws[None])

    def _feed(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        seen: torch.Tensor,
        root: int | torch.Tensor,
        depth: int,
        ahead: Ahead,
    ) -> torch.Tensor:
        """One draft forward over a level's growing nodes [B, n] from their parents' outputs features [B, n, H], at
        the position of the root (`root`, the committed pairs) + depth - 1; each row sees the committed prefix and
        what `seen` [B, n, fed + n] marks among the fed nodes and the level's own rows (its ancestors and itself;
        additive, 0 where seen). Returns the head's outputs [B, n, H]."""
        batch, n = tokens.shape
        positions = ahead.positions[:, depth - 1 : depth].expand(batch, n)
        rope = tuple(t[:, depth - 1 : depth].expand(batch, n, -1) for t in ahead.rope)
        if isinstance(self.cache, StaticRows):  # tree rows after the committed ones; every key row is masked
            assert self.static is not None  # (its cache)
            mask = self.static.tree_rows(seen, n)
        else:  # (one sequence)
            assert isinstance(root, int)  # (the eager cache's length)
            mask = torch.cat([seen.new_zeros(batch, n, root), seen], dim=2)  # [1, n, committed + fed + n]
        return self.head(features, tokens, positions, mask[:, None], self.cache, rope)


def _per_slot(x: torch.Tensor, batch: int) -> torch.Tensor:
    """x [n], the same for every slot, as [B, n]: a view for one slot, else a copy (a replay's outputs are written
    over in place, and a view of one row repeated cannot be)."""
    return x[None] if batch == 1 else x.repeat(batch, 1)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each sequence's rows `index` [B, m] of x [B, F, ...]: [B, m, ...]."""
    return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand(*index.shape, *x.shape[2:]))


@dataclass
class DraftInputs:
    """One key span's captured drafting reads these, every slot's."""

    features: torch.Tensor  # [B, P, F]: the committed pairs' target features, padded
    ids: torch.Tensor  # [B, P]: the token after each
    count: torch.Tensor  # [B] long: how many of the P rows are real (a slot that does not draft: 1, never kept)
    committed: torch.Tensor  # [B] long: the pairs already in each slot's cache


class StaticDrafting:
    """EAGLE drafting on a static cache (under --graphs, and for a batch's slots): the head's keys live in
    preallocated rows (`StaticRows`), `batch` slots side by side, and a step's drafting (feed the pairs the last
    verification committed, padded to the most a step commits, then grow every slot's tree and pick the nodes to
    verify) is one function of device tensors with fixed shapes, captured on a GPU (with --graphs) as one CUDA graph
    per key span and tree depth (a shallower tree: the token budget's last steps) and replayed: no Python per level
    and no host wait. A slot with more pairs (the prompt's) runs the same function alone, uncaptured. Drafting
    sampled children (T > 0 with `sampled`) keeps the eager cache. `eagle` is slot 0's proposer: its head, readout
    and tree policy are every slot's."""

    def __init__(self, eagle: Eagle, batch: int = 1, capture: bool = True, compile: bool = False) -> None:
        self.eagle = eagle
        self.draft = compile_function(self._draft) if compile else self._draft  # the captured shapes' drafting
        tree = eagle.expansion
        self.pad = tree.max_depth + 1  # the pairs a step commits at most: the accepted path and the root
        layers = eagle.head.config.get_text_config().num_hidden_layers
        self.cache = StaticRows(layers, -(-(MAX_CACHE + self.pad + tree.fed) // SPAN) * SPAN, batch)
        self.batch = batch
        self.lengths = [0] * batch  # each slot's committed pairs in the cache
        self.inputs: dict[int, DraftInputs] = {}  # by key span
        self.replays = Replays(eagle.device)
        self.replays.capture = self.replays.capture and capture
        self.alone: int | None = None  # the slot a forward runs alone (None: every slot)
        self.before: torch.Tensor | None = None  # [B, span]: the keys every tree row sees (a draft's committed
        # pairs; additive, 0 where seen)
        self.rows: torch.Tensor | None = None  # [B, fed]: the rows a draft's fed nodes go to, in feeding order

    def propose(
        self, slots: list[Eagle], tokens: list[list[int]], depths: list[int]
    ) -> list[tuple[Draft, DeviceTree] | None]:
        """Feed each slot's pending pairs, then its draft and the tree to verify, left on the device; None for a
        slot with nothing to draft from (no new pairs, no depth left, or features missing for some committed token,
        as in the eager cache). The slots drafting to one depth share one forward per level."""
        found: list[tuple[Draft, DeviceTree] | None] = [None] * len(slots)
        together: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, int]]] = {}  # by depth
        for i, (eagle, committed, depth) in enumerate(zip(slots, tokens, depths, strict=True)):
            past = self.lengths[eagle.slot]
            n = min(len(eagle.pending), len(committed) - 1 - past)
            if n <= 0:
                continue
            features, eagle.pending = eagle.pending[:n], eagle.pending[n:]
            ids = upload(committed[past + 1 : past + 1 + n], eagle.device)
            self.lengths[eagle.slot] = past + n
            if past + n != len(committed) - 1 or depth < 1:  # feed them; nothing to draft from
                self._alone(eagle.slot, features, ids, past, 0)
            elif n > self.pad:  # more pairs than a captured step feeds (the prompt's): once, uncaptured
                found[i] = self._alone(eagle.slot, features, ids, past, depth)
            else:
                together.setdefault(depth, []).append((i, features, ids, past))
        for depth, members in together.items():
            drafts = self._together([(slots[i].slot, features, ids, past) for i, features, ids, past in members], depth)
            for (i, *_), drafted in zip(members, drafts, strict=True):
                found[i] = drafted
        return found

    def _alone(
        self, slot: int, features: torch.Tensor, ids: torch.Tensor, past: int, depths: int
    ) -> tuple[Draft, DeviceTree] | None:
        """`slot`'s pairs features [n, F], ids [n] fed after `past` alone, uncaptured (rare: never worth compiling),
        and its draft of `depths` levels from the last one (none: 0)."""
        self.cache.span = self._span(past + len(ids), depths)
        count, committed = (upload([v], self.eagle.device) for v in (len(ids), past))
        self.alone = slot
        try:
            with uncompiled():
                if not depths:
                    self._pairs(features[None], ids[None], committed)
                    return None
                draft, tokens, parents, ancestors = self._draft(features[None], ids[None], count, committed, depths)
        finally:
            self.alone = self.cache.slot = None
        return draft.row(0), DeviceTree(tokens[0], parents[0], depths, ancestors[0])

    def _together(
        self, members: list[tuple[int, torch.Tensor, torch.Tensor, int]], depths: int
    ) -> list[tuple[Draft, DeviceTree]]:
        """The drafts of `depths` levels of the slots `members` ((slot, features [n, F], ids [n], past) each), every
        slot in one forward padded to the captured shapes (the others pad past their own committed pairs)."""
        eagle = self.eagle
        past = list(self.lengths)  # (the members' own are set below; the others' writes land past theirs)
        count = [1] * self.batch
        for slot, _, ids, before in members:
            past[slot], count[slot] = before, len(ids)
        span = self._span(max(past) + self.pad, depths)
        inputs = self.inputs.get(span)
        if inputs is None:
            width = members[0][1].shape[1]
            inputs = self.inputs[span] = DraftInputs(
                members[0][1].new_zeros(self.batch, self.pad, width),
                members[0][2].new_zeros(self.batch, self.pad),
                members[0][2].new_ones(self.batch),
                members[0][2].new_zeros(self.batch),
            )
        for slot, features, ids, _ in members:
            inputs.features[slot, : len(ids)] = features
            inputs.ids[slot, : len(ids)] = ids
        counts = upload(count + past, eagle.device)
        inputs.count.copy_(counts[: self.batch])
        inputs.committed.copy_(counts[self.batch :])  # (capture's warm-up runs write past the committed rows only)
        self.cache.span = span
        full = depths == eagle.expansion.max_depth  # else a shallower tree (the budget's last steps): never compiled
        with contextlib.nullcontext() if full else uncompiled():
            draft, *tree = self.replays.run(
                (span, depths), lambda: self.draft(inputs.features, inputs.ids, inputs.count, inputs.committed, depths)
            )
        tokens, parents, ancestors = tree  # (copied below: the next replay writes over them)
        return [
            (
                draft.row(slot)._map(torch.clone),
                DeviceTree(tokens[slot].clone(), parents[slot].clone(), depths, ancestors[slot].clone()),
            )
            for slot, *_ in members
        ]

    def _span(self, end: int, depths: int) -> int:
        """The key rows a draft attends over: the pairs up to `end`, then its tree rows, rounded up to SPAN."""
        return min(-(-(end + (self.eagle.expansion.fed if depths > 1 else 0)) // SPAN) * SPAN, self.cache.capacity)

    def _draft(
        self, features: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, committed: torch.Tensor, depths: int
    ) -> tuple[Draft, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed each slot's first `count` pairs (features [B, P, F], ids [B, P]) after its `committed`, then grow
        from the last one's output: the drafts [B, n], and the trees to verify as their tokens [B, k], parents
        [B, k] and ancestor matrices [B, k+1, k+1] (all built here, so a captured step launches none of it)."""
        out = self._pairs(features, ids, committed)  # [B, P, H]
        root = _rows(out, (count - 1)[:, None])[:, 0]  # [B, H]
        position = committed + count  # [B]: the trees' first rows
        keys = torch.arange(self.cache.span, device=ids.device)
        self.before = additive(keys < position[:, None], self.eagle.dtype)
        self.rows = position[:, None] + torch.arange(self.eagle.expansion.fed, device=ids.device)
        draft, _ = self.eagle._grow(root, depths, position)
        keep = self.eagle.expansion.select(draft)
        tokens, parents = draft.kept(keep.expand(len(root), -1))
        return draft, tokens, parents, ancestors_from(parents, depths)

    def _pairs(self, features: torch.Tensor, ids: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        """The head over pairs (features [B, P, F], ids [B, P]) at rows committed, committed + 1, ... of each slot
        (causal over its cache): outputs [B, P, H]."""
        rows = committed[:, None] + torch.arange(ids.shape[1], device=ids.device)  # [B, P]
        allowed = torch.arange(self.cache.span, device=ids.device) <= rows[..., None]  # [B, P, span]
        mask = additive(allowed, self.eagle.head.fc.weight.dtype)[:, None]
        self.cache.write_rows(rows, self.alone)
        return self.eagle.head(features, ids, rows, mask, self.cache)

    def tree_rows(self, seen: torch.Tensor, n: int) -> torch.Tensor:
        """Where a level's n rows go in each slot (after its committed pairs, the tree rows fed so far) and which
        keys they see [B, n, span] (additive): the committed pairs, and those tree rows `seen` [B, n, fed + n]
        marks (`_draft` set the rows)."""
        assert self.before is not None and self.rows is not None  # set by `_draft`
        fed = seen.shape[-1]
        mask = self.before[:, None].expand(-1, n, -1).clone()
        mask.scatter_(2, self.rows[:, None, :fed].expand(-1, n, -1), seen)
        self.cache.write_rows(self.rows[:, fed - n : fed], self.alone)
        return mask


def _nested_tree(snapshot: tuple[Draft, int], params: dict) -> Tree:
    """The tree DynamicTree(total_tokens, depth, top_k) proposes, from a deeper draft with the same top_k."""
    draft, top_k = snapshot
    part = draft.upto(params["depth"] + 1)
    return part.tree(DynamicTree(params["total_tokens"], params["depth"], top_k).select(part))


DYNAMIC = Nested(
    ("total_tokens", "depth"),
    snapshot=lambda proposer, proposal: (proposer.drafted, proposer.expansion.branch),
    subtree=_nested_tree,
)


def _static_paths(proposer: Proposer, proposal: Proposal) -> tuple[list[tuple], list[list[int]]]:
    """Each proposed node's path of ranks (the proposal keeps every drafted node, in order) and the tree's paths."""
    assert isinstance(proposer, Eagle) and isinstance(proposer.expansion, StaticTree)  # EAGLE-1's
    tree = proposer.expansion
    slots = proposer.drafted.slots
    return [tree.paths[s] for s in (slots.tolist() if slots is not None else [])], tree.choices


def _shortlist(
    res: Resources, family: str, draft_vocab: float | None, readable: torch.Tensor, what: str
) -> torch.Tensor | None:
    """Positions in `readable` (the target ids [V'] the head reads out, in its readout's order), ascending, of its
    most frequent tokens by the head's token counts (`heads.frequencies`): `draft_vocab` of them, or that share
    when below 1; None: all of them."""
    if draft_vocab is None:
        return None
    count = len(readable)
    size = round(draft_vocab * count) if isinstance(draft_vocab, float) and 0 < draft_vocab < 1 else draft_vocab
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= count:
        raise ValueError(
            f"draft_vocab must be a token count from 1 to {what} {count}, a share of it between 0 and 1, or null"
        )
    folder = res.head_path(family)
    hint = f"count the text the head was trained on with `specbench token-counts --data TEXT --out {folder}`"
    counts = frequencies.read(folder, res.target_model.config.get_text_config().vocab_size, hint)
    return frequencies.most_frequent(counts[readable.cpu()], size).to(readable.device)


def _on_target_head(
    res: Resources,
    expansion: StaticTree | DynamicTree,
    sampled: bool,
    draft_dtype: str | None,
    draft_vocab: float | None,
) -> Eagle:
    """An EAGLE-1/2 head reading out through the target's lm_head, in `draft_dtype`, over the most frequent tokens
    of the head's training text only with `draft_vocab` (`_shortlist`)."""
    dtype = res.draft_dtype(draft_dtype)
    head: EagleHead = res.head("eagle", dtype)
    vocab = head.config.vocab_size
    ids = _shortlist(res, "eagle", draft_vocab, torch.arange(vocab, device=res.device), "the vocabulary's")
    if ids is None:
        return Eagle(head, res.readout(dtype), expansion, sampled=sampled, **static_drafting(res))
    return Eagle(
        head,
        res.readout(dtype, ids),
        expansion,
        target_ids=lambda drafted: ids[drafted],
        target_vocab=vocab,
        sampled=sampled,
        **static_drafting(res),
    )


def static_drafting(res: Resources) -> dict:
    """An Eagle's keywords for drafting on a static cache: under --graphs (captured on a GPU), and in a batch's
    slots, which share one drafting of the batch's size (`Resources.per_batch`) and draft together; none (the eager
    cache) otherwise."""
    slot, slots = res.slot
    if not (res.graphs or slots > 1):
        return {}

    def drafting(eagle: Eagle) -> StaticDrafting:
        return res.per_batch("eagle", lambda: StaticDrafting(eagle, slots, res.graphs, res.graphs and res.compile))

    return dict(drafting=drafting, slot=slot)


def _draft_params(params: dict) -> dict:
    return {k: params.pop(k, None) for k in ("draft_dtype", "draft_vocab")}


@implementation("eagle", nested=tree_prefix("nodes", _static_paths), graphed=unless_sampled)
def build_eagle(params: dict, res: Resources) -> Proposer:
    sampled, draft = params.pop("sampled", False), _draft_params(params)
    listed = choices.first(choices.resolve(params.pop("tree", "eagle_mc_sim_7b_63")), params.pop("nodes", None))
    return _on_target_head(res, StaticTree(listed, **params), sampled, **draft)


@implementation("eagle2", nested=DYNAMIC, graphed=unless_sampled)
def build_eagle2(params: dict, res: Resources) -> Proposer:
    sampled, draft = params.pop("sampled", False), _draft_params(params)
    return _on_target_head(res, DynamicTree(**params), sampled, **draft)


@implementation("eagle3", nested=DYNAMIC, graphed=unless_sampled)
def build_eagle3(params: dict, res: Resources) -> Proposer:
    sampled, draft = params.pop("sampled", False), _draft_params(params)
    head: Eagle3Head = res.head("eagle3", res.draft_dtype(draft["draft_dtype"]))
    if not head.restricted:  # (a batch's slots share one head: restricted with slot 0's build)
        readable = head.target_ids(torch.arange(head.config.draft_vocab_size, device=res.device))
        keep = _shortlist(res, "eagle3", draft["draft_vocab"], readable, "the draft vocabulary's")
        if keep is not None:
            head.restrict(keep)
    text = res.target_model.config.get_text_config()
    return Eagle(
        head,
        head.logits,
        DynamicTree(**params),
        feature_layers=head.layer_ids or feature_layers(text.num_hidden_layers),
        target_ids=head.target_ids,
        target_vocab=text.vocab_size,
        sampled=sampled,
        **static_drafting(res),
    )
