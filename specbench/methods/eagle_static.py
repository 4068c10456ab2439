"""EAGLE drafting on a static cache (under --graphs, and for a batch's slots): every slot's committed pairs and tree
rows in preallocated rows, a step's drafting one function of fixed shapes, captured on a GPU and replayed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ..core.capture import Replays, uncompiled
from ..core.static_cache import StaticRows
from ..core.static_lm import MAX_CACHE, SPAN
from ..core.transfer import padded_rows, upload
from ..core.tree import DeviceTree, additive, ancestors_from
from ..models.loading import compile_function
from .eagle_trees import Draft


def rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each sequence's rows `index` [B, m] of x [B, F, ...]: [B, m, ...]."""
    return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand(*index.shape, *x.shape[2:]))


def padded_pairs(
    members: list[tuple[int, torch.Tensor, list[int], int]], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Several slots' pairs ((slot, features [n, F], ids [n], pairs before them) each) as a batch of their own,
    padded to the most pairs w, the host's values in one copy: the slots, counts and pairs before [m] each, then
    features [m, w, F] and ids [m, w] (zeros past each one's n)."""
    m = len(members)
    slots, pairs, ids, past = (list(column) for column in zip(*members, strict=True))
    counts = [len(t) for t in ids]
    width, size = max(counts), pairs[0].shape[-1]
    at = padded_rows(list(range(m)), counts, width)
    host = upload(slots + counts + past + at + [t for row in ids for t in row], device)
    lanes, count, committed, rows, flat = host.split([m, m, m, len(at), len(at)])
    features = pairs[0].new_zeros(m * width, size)
    features[rows] = torch.cat(pairs)
    tokens = flat.new_zeros(m * width)
    tokens[rows] = flat
    return lanes, count, committed, features.view(m, width, size), tokens.view(m, width)


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
    and no host wait. Slots with more pairs (the prompt's) run the same function over themselves, uncaptured. Drafting
    sampled children (T > 0 with `sampled`) keeps the eager cache. `eagle` (a `methods.eagle.Eagle`, which holds this
    drafting: not imported here, to keep the modules out of a circle): its head, readout and tree policy serve every
    slot, its `lanes` hold each slot's turn."""

    def __init__(self, eagle: Any, batch: int = 1, capture: bool = True, compile: bool = False) -> None:
        self.eagle = eagle
        self.draft = compile_function(self._draft) if compile else self._draft  # the captured shapes' drafting
        tree = eagle.expansion
        self.pad = tree.max_depth + 1  # the pairs a step commits at most: the accepted path and the root
        layers = eagle.head.config.get_text_config().num_hidden_layers
        self.cache = StaticRows(layers, -(-(MAX_CACHE + self.pad + tree.fed) // SPAN) * SPAN, batch)
        self.batch = batch
        self.drained = torch.empty(0, eagle.head.feature_size)  # a lane's pending pairs once all are fed
        self.lengths = [0] * batch  # each slot's committed pairs in the cache
        self.inputs: dict[int, DraftInputs] = {}  # by key span
        self.replays = Replays(eagle.device)
        self.replays.capture = self.replays.capture and capture
        self.alone: int | torch.Tensor | None = None  # the slots a forward runs over alone: one, several [m] (None:
        # every slot)
        self.before: torch.Tensor | None = None  # [B, span]: the keys every tree row sees (a draft's committed
        # pairs; additive, 0 where seen)
        self.rows: torch.Tensor | None = None  # [B, fed]: the rows a draft's fed nodes go to, in feeding order

    def propose(
        self, slots: list[int], tokens: list[list[int]], depths: list[int]
    ) -> list[tuple[Draft, int, DeviceTree] | None]:
        """Feed each slot's pending pairs, then its draft (the batch's it was drafted in, and its row there) and the
        tree to verify, left on the device; None for a slot with nothing to draft from (no new pairs, no depth left,
        or features missing for some committed token, as in the eager cache). The slots drafting to one depth share
        one forward per level: those with more pairs than a captured step feeds (a turn's first step: its prompt's)
        in one uncaptured forward of their own, and those with nothing to draft from in one more."""
        found: list[tuple[Draft, int, DeviceTree] | None] = [None] * len(slots)
        together: dict[int, list[tuple[int, torch.Tensor, list[int], int]]] = {}  # by depth
        apart: dict[int, list[tuple[int, torch.Tensor, list[int], int]]] = {}  # by depth (0: feed only)
        for i, (slot, committed, depth) in enumerate(zip(slots, tokens, depths, strict=True)):
            lane, past = self.eagle.lanes[slot], self.lengths[slot]
            n = min(len(lane.pending), len(committed) - 1 - past)
            if n <= 0:
                continue
            features = lane.pending if n == len(lane.pending) else lane.pending[:n]  # (all of them, as a rule)
            lane.pending = lane.pending[n:] if n < len(lane.pending) else self.drained
            ids = committed[past + 1 : past + 1 + n]
            self.lengths[slot] = past + n
            if past + n != len(committed) - 1 or depth < 1:  # feed them; nothing to draft from
                apart.setdefault(0, []).append((i, features, ids, past))
            elif n > self.pad:  # more pairs than a captured step feeds (the prompt's): uncaptured
                apart.setdefault(depth, []).append((i, features, ids, past))
            else:
                together.setdefault(depth, []).append((i, features, ids, past))
        for groups, run in ((apart, self._apart), (together, self._together)):
            for depth, members in groups.items():
                drafts = run([(slots[i], features, ids, past) for i, features, ids, past in members], depth)
                for (i, *_), drafted in zip(members, drafts, strict=True):
                    found[i] = drafted
        return found

    def _apart(
        self, members: list[tuple[int, torch.Tensor, list[int], int]], depths: int
    ) -> list[tuple[Draft, int, DeviceTree] | None]:
        """The pairs of the slots `members` ((slot, features [n, F], ids [n], past) each) fed in one uncaptured
        forward over those slots alone, padded to the most pairs (rare: never worth compiling), and each one's draft
        of `depths` levels from its last pair (none: 0)."""
        lanes, count, committed, features, ids = padded_pairs(members, self.eagle.device)
        self.cache.span = self._span(max(len(t) + past for _, _, t, past in members), depths)
        self.alone = members[0][0] if len(members) == 1 else lanes  # (one: its rows as a view)
        try:
            with uncompiled():
                if not depths:
                    self._pairs(features, ids, committed)
                    return [None] * len(members)
                draft, *tree = self._draft(features, ids, count, committed, depths)
        finally:
            self.alone = self.cache.slot = None
        tokens, parents, ancestors = (t.unbind() for t in tree)
        return [(draft, i, DeviceTree(tokens[i], parents[i], depths, ancestors[i])) for i in range(len(members))]

    def _together(
        self, members: list[tuple[int, torch.Tensor, list[int], int]], depths: int
    ) -> list[tuple[Draft, int, DeviceTree]]:
        """The drafts of `depths` levels of the slots `members` ((slot, features [n, F], ids [n], past) each), every
        slot in one forward padded to the captured shapes (the others pad past their own committed pairs): every
        member's pairs written in one copy of the features and one of the host's values."""
        eagle = self.eagle
        past = list(self.lengths)  # (the members' own are set below; the others' writes land past theirs)
        count = [1] * self.batch
        for slot, _, ids, before in members:
            past[slot], count[slot] = before, len(ids)
        span = self._span(max(past) + self.pad, depths)
        inputs = self.inputs.get(span)
        if inputs is None:
            features = members[0][1]
            inputs = self.inputs[span] = DraftInputs(
                features.new_zeros(self.batch, self.pad, features.shape[1]),
                torch.zeros(self.batch, self.pad, dtype=torch.long, device=eagle.device),
                torch.ones(self.batch, dtype=torch.long, device=eagle.device),
                torch.zeros(self.batch, dtype=torch.long, device=eagle.device),
            )
        at = padded_rows([m[0] for m in members], [len(m[2]) for m in members], self.pad)
        host = upload(count + past + at + [t for *_, ids, _ in members for t in ids], eagle.device)
        counts, rows, ids = host.split([2 * self.batch, len(at), len(at)])
        inputs.features.view(-1, inputs.features.shape[-1])[rows] = torch.cat([m[1] for m in members])
        inputs.ids.view(-1)[rows] = ids
        inputs.count.copy_(counts[: self.batch])
        inputs.committed.copy_(counts[self.batch :])  # (capture's warm-up runs write past the committed rows only)
        self.cache.span = span
        full = depths == eagle.expansion.max_depth  # else a shallower tree (the budget's last steps): never compiled
        with contextlib.nullcontext() if full else uncompiled():
            draft, *tree = self.replays.run(
                (span, depths), lambda: self.draft(inputs.features, inputs.ids, inputs.count, inputs.committed, depths)
            )
        draft = draft._map(torch.clone)  # (copied once for every slot: the next replay writes over them)
        tokens, parents, ancestors = (t.clone().unbind() for t in tree)  # (each slot's views, in one op)
        return [(draft, slot, DeviceTree(tokens[slot], parents[slot], depths, ancestors[slot])) for slot, *_ in members]

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
        root = rows_of(out, (count - 1)[:, None])[:, 0]  # [B, H]
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
