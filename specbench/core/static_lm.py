"""The owned decoder (`models.decoder`) on a preallocated KV cache (`core.static_cache`), for `--graphs` and for
batches: `BatchedLM` runs one forward over the rows of `batch` sequences (slots), each with its own length, tree and
positions (B = 1 included: the target of `--graphs`). Every forward is padded to a bucket of
rows (1, 2, 4, ... 128), so each bucket has fixed shapes, and on a GPU each bucket's forward is captured once as a
CUDA graph and replayed (`core.capture`): no Python and no per-kernel launch cost per step. Attention reads the live
rows only (rounded up to SPAN, a graph per span). The mask, positions and cache rows are built inside the graph from
the ids, two counts per slot and the trees' shapes (`Inputs`). Padding rows (and a slot with nothing to do) attend
to one cached row and are never committed. On a CPU the same cache and padding run without capture, which is what
the tests check against the eager loop."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..errors import SpecbenchError
from .cached_lm import Forward, SideBranch, as_ids, top1, top_two
from .capture import Replays, uncompiled
from .static_cache import StaticRows
from .step import Judged, judge_batch
from .transfer import upload
from .tree import DeviceTree, Tree, ancestor_matrix, new_rows_allowed, position_ids

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows of a verification (root, tree, side branch), padded up to one
SPAN = 256  # the keys a forward attends over come in multiples of this (only the live rows, not the whole cache)
MAX_CACHE = 4096  # cached tokens at most (the model's own context if shorter): prompt and answer must fit
PREFILL_ROWS = 2048  # padded rows of one forward of several slots' prompts at most (a longer prompt runs alone)


def allocating(cache: StaticRows) -> contextlib.AbstractContextManager:
    """Around an uncaptured forward into `cache`: the one that allocates its rows runs uncompiled (under --compile,
    tracing the allocation would compile a whole graph for one call)."""
    return uncompiled() if cache.keys is None else contextlib.nullcontext()


@dataclass
class Inputs:
    """One key's forward reads these and builds its mask, positions and cache rows from them on the device (inside
    the captured graph), so a step sets only what changed: the ids, four counts per slot (in one copy) and, for a
    tree, its shape."""

    ids: torch.Tensor  # [B, b]
    counts: torch.Tensor  # [4, B] long: the four below, rows of one tensor
    past: torch.Tensor  # [B] long: each slot's rows cached before this forward
    count: torch.Tensor  # [B] long: its real rows (the rest pad the bucket)
    nodes: torch.Tensor  # [B] long: a verification's tree nodes (the rows after the root that acceptance reads)
    limit: torch.Tensor  # [B] long: the deepest node a verdict may accept (`DeviceTree.limited`; else the bucket)
    local: torch.Tensor  # bool [B, b, b]: the forward's rows each row sees (a tree's: its ancestors and itself)
    offsets: torch.Tensor  # [B, b]: each row's position after `past` (a tree's: its depth)

    @staticmethod
    def chain(batch: int, bucket: int, device: torch.device) -> Inputs:
        """For chains of up to `bucket` rows (a tree's `local` and `offsets` are written over at each forward)."""
        rows = torch.arange(bucket, device=device)
        local = torch.ones(bucket, bucket, dtype=torch.bool, device=device).tril()
        counts = rows.new_zeros(4, batch)
        counts[3] = bucket
        past, count, nodes, limit = counts  # (views: one copy writes them all)
        return Inputs(
            rows.new_zeros(batch, bucket),
            counts,
            past,
            count,
            nodes,
            limit,
            local.repeat(batch, 1, 1),
            rows.repeat(batch, 1),
        )

    def built(self, span: int, dtype: torch.dtype, chained: bool = False) -> tuple[torch.Tensor, ...]:
        """The additive mask [B, 1, b, span], positions [B, b] and cache rows [B, b] of the forward: real rows see
        their slot's cache and the rows `local` marks; padding rows see one cached row (a row of -inf gives NaN), sit
        at `past` and are never kept. `chained`: every slot's rows a chain (`local` lower-triangular), so a row sees
        the keys up to its own. Built in float arithmetic (1 = blocked): a CPU's comparisons, masked fills and
        bool conversions over [B, b, span] cost several times as much."""
        (batch, b), device = self.ids.shape, self.ids.device
        rows, cols = torch.arange(b, device=device), torch.arange(span, device=device)
        rel = (cols - self.past[:, None]).float()  # [B, span]: each key's row in this forward (< 0: cached before)
        real = rows < self.count[:, None]  # [B, b]
        # the last key each row sees by rule: a chain's row its own row, a tree's row the cache (its new rows are
        # written below), a padding row column 0 (rel = -past there)
        last = torch.where(real, rows if chained else -1, -self.past[:, None]).float()  # [B, b]
        blocked = (rel[:, None, :] - last[..., None]).clamp_(0, 1)  # [B, b, span]
        if not chained:  # each real row's new rows, `local`'s real ones, at their columns; a padding row's col 0
            new = self.local & real[:, None, :] & real[..., None]
            blocked.scatter_(2, (self.past[:, None, None] + rows).expand(batch, b, b), (~new).float())
            blocked[..., 0].mul_(real)
        mask = blocked.mul_(-torch.finfo(dtype).max).to(dtype)  # (the dtype's min, exact in float32)
        positions = self.past[:, None] + torch.where(real, self.offsets, 0)
        return mask[:, None], positions, self.past[:, None] + rows


@dataclass(slots=True)  # (not frozen: a batch builds one a slot a step, and a frozen one costs 4x to build)
class Row:
    """One slot's share of a batched forward: its tokens (a list, or ids on the device) and, for a verification,
    the tree ([root] + tree tokens + side tokens) and side branch."""

    slot: int
    tokens: list[int] | torch.Tensor
    tree: Tree | None = None
    side: SideBranch | None = None
    root: int | None = None  # set: `tokens` are the rows after this root (a drafted tree's ids on the device), so
    # a batch's roots are written with the host's other values, not joined to their ids one row at a time
    size: int = field(init=False)  # its rows, taken once (a tensor's len costs microseconds, read many times)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0] if isinstance(self.tokens, torch.Tensor) else len(self.tokens)
        self.size = n + (self.root is not None)

    def joined(self) -> list[int] | torch.Tensor:
        """All its rows' tokens, the root first (one sequence's forward reads them so)."""
        if self.root is None:
            return self.tokens
        if isinstance(self.tokens, torch.Tensor):
            return torch.cat([self.tokens.new_full((1,), self.root), self.tokens])
        return [self.root, *self.tokens]

    @property
    def chained(self) -> bool:
        tree = self.tree
        return tree is None or (self.side is None and (len(tree) < 2 or tree.is_chain))


class BatchedLM:
    """A `models.decoder.Decoder` (called as `model(ids, positions, mask, cache, features)` -> final states,
    features) over StaticRows of `batch` slots of `context` tokens each (the model's context, MAX_CACHE at most, if
    not given); `capture`: CUDA graphs per (bucket, span, layers, chained, greedy) (default: on CUDA)."""

    def __init__(self, model, batch: int = 1, capture: bool | None = None, context: int | None = None) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        own = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.context_length = min(own, MAX_CACHE, context or own)
        self.capacity = self.context_length + BUCKETS[-1]
        self.batch = batch
        self.lengths = [0] * batch  # each slot's committed rows
        self.replays = Replays(self.device)
        self.replays.capture = self.replays.capture if capture is None else capture
        self.inputs: dict[tuple, Inputs] = {}  # by (bucket, span, layers, chains only, greedy)
        self.chains: dict[int, Inputs] = {}  # by bucket: a chain's shape, written over a tree's (`_shape`)
        self.cache = StaticRows(len(model.layers), self.capacity, batch)
        self.prefilled: dict[int, tuple[tuple, Forward | None]] = {}  # slot -> its last prefill's prompt and layers,
        # and its output (`prefill`'s `reuse`)

    def _check(self, rows: list[Row], transient: bool = False) -> None:
        """Every row fits its slot's context after its committed rows. `transient` (a forward of a bucket's rows):
        only each row's first must (a verification keeps its root; its drafted rows, and those a bucket pads, may
        lie past the context, in the rows `capacity` adds, and the token budget keeps every accepted one inside)."""
        for row in rows:
            need = self.lengths[row.slot] + (min(row.size, 1) if transient else row.size)
            if need > self.context_length:
                raise SpecbenchError(
                    f"{self.lengths[row.slot] + row.size} tokens do not fit the static cache of "
                    f"{self.context_length} tokens (--graphs, --batch)"
                )

    @torch.inference_mode()
    def run(
        self,
        rows: list[Row],
        *,
        layers: tuple[int, ...] | None = None,
        greedy: bool = False,
        last_only: bool = False,
    ) -> list[Forward]:
        """`verify`, then each row's output, in order, copied (the next forward writes over a replay's): `last_only`:
        the last row's logits only. A row longer than any bucket (a prefill) runs alone."""
        n = max(row.size for row in rows)
        if n > BUCKETS[-1]:
            self._check(rows)
            if len(rows) > 1:
                raise SpecbenchError(f"a forward of {n} rows runs one slot at a time (prefill)")
            return self._alone(rows, layers, last_only)
        out, _ = self.verify(rows, layers=layers, greedy=greedy)
        return [self._output(out, row.slot, row.size, last_only) for row in rows]

    @torch.inference_mode()
    def verify(
        self,
        rows: list[Row],
        *,
        layers: tuple[int, ...] | None = None,
        greedy: bool = False,
        judged: bool = False,
        top1_only: bool = False,
    ) -> tuple[Forward, Judged | None]:
        """One forward over every slot, `rows` the ones with work (the others pad): every slot's output [B, b, ...],
        written over by the next forward of the same shape. `greedy`: every row's argmax and margin computed inside
        the forward (`Forward.picks`), the argmax alone with `top1_only` (a draft's: its margins are never read);
        `judged` (greedy too): every slot's verdict on its tree as well (`step.judge_batch`)."""
        self._check(rows, transient=True)
        greedy |= judged
        top1_only &= not judged
        n = max(row.size for row in rows)
        bucket = next(b for b in BUCKETS if b >= n)
        past = list(self.lengths)  # (a slot without work pads past its committed rows: its writes are never kept)
        count, nodes, limit = [0] * self.batch, [0] * self.batch, [bucket] * self.batch
        for row in rows:
            count[row.slot] = row.size
            nodes[row.slot] = 0 if row.tree is None else len(row.tree)
            if isinstance(row.tree, DeviceTree) and row.tree.limit is not None:
                limit[row.slot] = row.tree.limit
        end = max(p + bucket for p in past)
        span = min(-(-end // SPAN) * SPAN, self.capacity)  # keys attended: the live rows, rounded up
        chained = all(row.chained for row in rows)
        key = (bucket, span, layers, chained, greedy, judged, top1_only)
        inputs = self.inputs.get(key)
        if inputs is None:
            inputs = self.inputs[key] = Inputs.chain(self.batch, bucket, self.device)
        inputs.counts.copy_(upload(past + count + nodes + limit, self.device).view(4, self.batch))  # (capture's
        # warm-up runs write past the committed rows only)
        listed = [row for row in rows if not isinstance(row.tokens, torch.Tensor)]
        rooted = [row for row in rows if row.root is not None and isinstance(row.tokens, torch.Tensor)]
        if listed or rooted:  # every host row's ids, and the roots of the rows on the device, in one copy
            ids = [t for row in listed for t in [*row.joined(), *[0] * (bucket - row.size)]]
            host = upload([r.slot for r in listed + rooted] + ids + [r.root for r in rooted], self.device)
            at, ids_at, roots = host.split([len(listed) + len(rooted), len(ids), len(rooted)])
            if listed:
                inputs.ids[at[: len(listed)]] = ids_at.view(len(listed), bucket)
            if rooted:
                inputs.ids[at[len(listed) :], 0] = roots
        on_device: dict[tuple[int, int], list[Row]] = {}  # rows whose ids are on the device, by where they start
        for row in rows:  # and their length: one copy for each
            if isinstance(row.tokens, torch.Tensor):
                on_device.setdefault((row.root is not None, row.size), []).append(row)
        if not chained:
            self._shapes(inputs, rows, bucket)
        for (start, n), group in on_device.items():
            stacked = torch.stack([row.tokens for row in group]).to(self.device)  # type: ignore[misc]
            inputs.ids[upload([row.slot for row in group], self.device), start:n] = stacked

        def forward() -> tuple[Forward, Judged | None]:
            final, features = self._decoded(inputs, span, layers, chained)
            logits = self.model.get_output_embeddings()(final)  # [B, b, V]
            if not greedy:
                return Forward(logits, features), None
            if top1_only:
                return Forward(logits, features, (top1(logits), None)), None
            picks = top_two(logits)
            verdicts = None
            if judged:
                verdicts = judge_batch(
                    inputs.ids, inputs.local, inputs.offsets, inputs.nodes, picks, features, inputs.limit
                )
            return Forward(logits, features, picks), verdicts

        if self.cache.keys is not None:
            out = self.replays.run(key, forward)
        else:  # the forward that allocates the cache: never captured
            with allocating(self.cache):
                out = forward()
        for row in rows:  # the rows of this forward, until commit keeps some
            self.lengths[row.slot] += row.size
        return out

    def _shapes(self, inputs: Inputs, rows: list[Row], bucket: int) -> None:
        """Every row's tree shape into `inputs`, in groups: the chains (the bucket's chain), the trees drafted on
        the device of one size (their ancestors there), and the trees of one shape known on the host (a template's,
        as Medusa's: its ancestors built once), each group in one copy of its masks and one of its depths; a side
        branch's rows one by one (`_shape`)."""
        groups: dict[tuple, list[Row]] = {}
        for row in rows:
            tree = row.tree
            if row.chained:
                groups.setdefault(("chain",), []).append(row)
            elif row.side is not None or tree is None:  # (no tree is a chain: for the type checker)
                self._shape(inputs, row)
            elif isinstance(tree, DeviceTree) and tree.shape_on_device:
                groups.setdefault(("drafted", row.size), []).append(row)
            else:
                groups.setdefault(("shape", *tree.parents), []).append(row)
        for key, group in groups.items():
            at = upload([row.slot for row in group], self.device)
            if key[0] == "chain":
                if bucket not in self.chains:
                    self.chains[bucket] = Inputs.chain(1, bucket, self.device)
                inputs.local[at], inputs.offsets[at] = self.chains[bucket].local, self.chains[bucket].offsets
                continue
            m = group[0].size
            if key[0] == "drafted":  # [n, m, m]
                allowed = torch.stack([row.tree.ancestors for row in group])  # type: ignore[union-attr]
            else:  # [1, m, m], every row's
                allowed = ancestor_matrix(group[0].tree)[None]  # type: ignore[arg-type]
            allowed = allowed.to(self.device)
            inputs.local[at, :m, :m] = allowed
            inputs.offsets[at, :m] = allowed.sum(-1) - 1  # each row's depth: its ancestors

    def _shape(self, inputs: Inputs, row: Row) -> None:
        """A tree row's shape into `inputs`, side branch included (chains are `_shapes`' to write)."""
        m = row.size
        assert row.tree is not None
        side = row.side
        inputs.local[row.slot, :m, :m] = upload(new_rows_allowed(row.tree, side.allowed if side else None), self.device)
        inputs.offsets[row.slot, :m] = position_ids(row.tree, 0, self.device, side.positions if side else None)[0]

    def _alone(self, rows: list[Row], layers: tuple[int, ...] | None, last_only: bool) -> list[Forward]:
        """A forward over these slots' rows only (prefills, or a row longer than any bucket), each padded to the
        longest (several rows: chains), never captured: each row's logits (its last row's with `last_only`) and
        features."""
        n, m = max(row.size for row in rows), len(rows)
        past = [self.lengths[row.slot] for row in rows]
        span = min(-(-(max(past) + n) // SPAN) * SPAN, self.capacity)
        inputs = Inputs.chain(m, n, self.device)
        ids = [t for row in rows for t in [*row.joined(), *[0] * (n - row.size)]] if m > 1 else []
        host = upload(past + [row.size for row in rows] + [row.size - 1 for row in rows] + ids, self.device)
        inputs.past.copy_(host[:m])
        inputs.count.copy_(host[m : 2 * m])
        inputs.ids.copy_(host[3 * m :].view(m, n) if ids else as_ids(rows[0].joined(), self.device)[None])
        chained = all(row.chained for row in rows)
        if not chained:  # (one row: a tree)
            (row,) = rows
            self._shape(inputs, Row(0, row.tokens, row.tree, row.side, row.root))
        slots = rows[0].slot if m == 1 else upload([row.slot for row in rows], self.device)
        with allocating(self.cache):
            final, features = self._decoded(inputs, span, layers, chained, slots)
            if last_only:  # each row's last real row
                final = final[torch.arange(m, device=self.device), host[2 * m : 3 * m]][:, None]
            logits = self.model.get_output_embeddings()(final)
        for row in rows:
            self.lengths[row.slot] += row.size
        return [
            Forward(
                logits[i] if last_only else logits[i, : row.size],
                None if features is None else features[i, : row.size],
            )
            for i, row in enumerate(rows)
        ]

    def _decoded(
        self,
        inputs: Inputs,
        span: int,
        layers: tuple[int, ...] | None,
        chained: bool,
        slots: int | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over `inputs` (every slot's, or `slots`' alone: one, or several [n]; `chained`: only chains),
        attending over `span` keys: final states [B, b, H] and the features `layers` asks for."""
        mask, positions, at = inputs.built(span, self.dtype, chained)
        self.cache.write_rows(at, slots)
        self.cache.span = span
        try:
            return self.model(inputs.ids, positions, mask, self.cache, layers or ())
        finally:
            self.cache.slot = None

    @torch.inference_mode()
    def prefill(
        self, slots: list[int], prompts: list[list[int]], layers: tuple[int, ...] | None = None, reuse: bool = False
    ) -> list[Forward | None]:
        """Empty `slots` and fill each with all of its prompt but the last token (the first root): the slots
        together, in forwards of PREFILL_ROWS padded rows at most (prompts of like length together): each slot's
        last row's logits and its rows' features (None for a one-token prompt). `reuse`: a slot whose last prefill
        was of the same prompt and layers, its rows still cached, goes back to them instead (the sampling audit
        answers one prompt thousands of times; a timed answer never reuses)."""
        rows = []
        out: dict[int, Forward | None] = {}
        for slot, prompt in zip(slots, prompts, strict=True):
            key, last = (tuple(prompt), layers), self.prefilled.pop(slot, None)
            if reuse and last is not None and last[0] == key and self.lengths[slot] >= len(prompt) - 1:
                self.lengths[slot], out[slot], self.prefilled[slot] = len(prompt) - 1, last[1], last
                continue
            self.lengths[slot] = 0
            if len(prompt) >= 2:
                rows.append(Row(slot, prompt[:-1]))
        self._check(rows)
        groups: list[list[Row]] = []
        for row in sorted(rows, key=lambda r: r.size, reverse=True):  # the longest first: each group's widest
            if not groups or (len(groups[-1]) + 1) * groups[-1][0].size > PREFILL_ROWS:
                groups.append([])
            groups[-1].append(row)
        for group in groups:
            out.update(zip([r.slot for r in group], self._alone(group, layers, last_only=True), strict=True))
        if reuse:  # (an uncaptured forward's outputs: no replay writes over them)
            for slot, prompt in zip(slots, prompts, strict=True):
                self.prefilled[slot] = ((tuple(prompt), layers), out.get(slot))
        return [out.get(slot) for slot in slots]

    @staticmethod
    def _output(out: Forward, slot: int, n: int, last_only: bool) -> Forward:
        """One slot's rows of a (replayed) forward, copied (the next replay writes over it): logits [n or 1, V],
        features [n, F], picks [n] each."""
        rows = slice(n - 1, n) if last_only else slice(0, n)  # `last_only` spares logits; features are every row's
        features = None if out.features is None else out.features[slot, :n].clone()
        picks = None
        if out.picks is not None:
            top1, margin = out.picks
            picks = (top1[slot, :n], None if margin is None else margin[slot, :n])
        return Forward(out.logits[slot, rows].clone(), features, picks)

    def rewind(self, slot: int, length: int) -> None:
        """`slot`'s committed rows from `length` on dropped (rows past a length are never read: nothing is cleared;
        a prefill kept for `reuse` is forgotten once its rows may be written over)."""
        last = self.prefilled.get(slot)
        if last is not None and length < len(last[0][0]) - 1:
            del self.prefilled[slot]
        self.lengths[slot] = length

    @torch.inference_mode()
    def commit(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """For each (slot, start, keep): rows start + keep[i] of the last forward kept as rows start + i, the rest
        dropped; every slot's moves at once."""
        self.cache.commit_rows(moves)
        for slot, start, keep in moves:
            self.lengths[slot] = start + len(keep)
