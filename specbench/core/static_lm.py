"""CachedLM for `--graphs`: the owned decoder (`models.decoder`) on a preallocated KV cache (`core.static_cache`).
Every forward is padded to a bucket of rows (1, 2, 4, ... 128), so each bucket has fixed shapes, and on a GPU each
bucket's forward is captured once as a CUDA graph and replayed (`core.capture`): no Python and no per-kernel launch
cost per step. Attention reads the live rows only (rounded up to SPAN, a graph per span). The mask, positions and
cache rows are built inside the graph from the ids, two counts and a tree's shape (`Inputs`). Padding rows attend to
one cached row and are never committed. On a CPU the same cache and padding run without capture, which is what the
tests check against the eager loop."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import SpecbenchError
from .cached_lm import CachedLM, Forward, SideBranch, as_ids, margins
from .capture import Replays, uncompiled
from .static_cache import StaticRows
from .transfer import upload
from .tree import Tree, additive, new_rows_allowed, position_ids

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows of a verification (root, tree, side branch), padded up to one
SPAN = 256  # the keys a forward attends over come in multiples of this (only the live rows, not the whole cache)
MAX_CACHE = 4096  # cached tokens at most (the model's own context if shorter): prompt and answer must fit


def allocating(cache: StaticRows) -> contextlib.AbstractContextManager:
    """Around an uncaptured forward into `cache`: the one that allocates its rows runs uncompiled (under --compile,
    tracing the allocation would compile a whole graph for one call)."""
    return uncompiled() if cache.keys is None else contextlib.nullcontext()


@dataclass
class Inputs:
    """One key's forward reads these and builds its mask, positions and cache rows from them on the device (inside
    the captured graph), so a step sets only what changed: the ids, two counts and, for a tree, its shape."""

    ids: torch.Tensor  # [b]
    past: torch.Tensor  # 0-d long: the rows cached before this forward
    count: torch.Tensor  # 0-d long: its real rows (the rest pad the bucket)
    local: torch.Tensor  # bool [b, b]: the forward's rows each row sees (a tree's: its ancestors and itself)
    offsets: torch.Tensor  # [b]: each row's position after `past` (a tree's: its depth)

    @staticmethod
    def chain(bucket: int, device: torch.device) -> Inputs:
        """For a chain of up to `bucket` rows (a tree's `local` and `offsets` are written over at each forward)."""
        rows = torch.arange(bucket, device=device)
        local = torch.ones(bucket, bucket, dtype=torch.bool, device=device).tril()
        return Inputs(torch.zeros_like(rows), rows.new_zeros(()), rows.new_zeros(()), local, rows)

    def built(self, span: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The additive mask [1, 1, b, span], positions [1, b] and cache rows [b] of the forward: real rows see the
        cache and the rows `local` marks; padding rows see one cached row (a row of -inf gives NaN), sit at `past`
        and are never kept."""
        b, device = len(self.ids), self.ids.device
        rows, cols = torch.arange(b, device=device), torch.arange(span, device=device)
        rel = cols - self.past  # [span]: each key's row within this forward (negative: cached before it)
        real = rows < self.count  # [b]
        seen = (rel < 0) | ((rel < self.count) & self.local[:, rel.clamp(0, b - 1)])  # [b, span]
        seen = torch.where(real[:, None], seen, cols == 0)
        positions = self.past + torch.where(real, self.offsets, 0)
        return additive(seen, dtype)[None, None], positions[None], self.past + rows


class StaticCachedLM(CachedLM):
    """The CachedLM interface over StaticRows for a `models.decoder.Decoder` (called as
    `model(ids, positions, mask, cache, features)` -> final states, features); `capture`: CUDA graphs per (bucket,
    span, layers) (default: on CUDA)."""

    cache: StaticRows

    def __init__(self, model, capture: bool | None = None) -> None:
        super().__init__(model)
        self.capacity = min(self.context_length, MAX_CACHE) + BUCKETS[-1]
        self.context_length = self.capacity - BUCKETS[-1]
        self.replays = Replays(self.device)
        self.replays.capture = self.replays.capture if capture is None else capture
        self.inputs: dict[tuple, Inputs] = {}  # by (bucket, span, layers, chain or not, greedy)
        self.cache = StaticRows(len(model.layers), self.capacity)

    @property
    def cached(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.length = 0  # rows past `length` are never attended to, so nothing needs clearing
        self.prefilled = None

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int] | torch.Tensor,
        tree: Tree | None = None,
        *,
        last_only: bool = False,
        layers: tuple[int, ...] | None = None,
        side: SideBranch | None = None,
        greedy: bool = False,
    ) -> Forward:
        past, n = self.cached, len(tokens)
        if past + n > self.context_length:
            raise SpecbenchError(f"{past + n} tokens do not fit the static cache of {self.context_length} (--graphs)")
        bucket = next((b for b in BUCKETS if b >= n), n)  # longer (a prefill): its own length, never captured
        span = min(-(-(past + bucket) // SPAN) * SPAN, self.capacity)  # keys attended: the live rows, rounded up
        chained = tree is None or (tree.is_chain and side is None)
        key = (bucket, span, layers, chained, greedy)
        inputs = self.inputs.get(key)
        if inputs is None:
            inputs = Inputs.chain(bucket, self.device)
            if bucket in BUCKETS:  # (a longer prefill's are never met again)
                self.inputs[key] = inputs
        inputs.ids[:n] = as_ids(tokens, self.device)
        inputs.past.fill_(past)  # (capture's warm-up runs write past the committed rows only)
        inputs.count.fill_(n)
        if not chained:
            assert tree is not None
            inputs.local[:n, :n] = upload(new_rows_allowed(tree, side.allowed if side else None), self.device)
            inputs.offsets[:n] = position_ids(tree, 0, self.device, side.positions if side else None)[0]

        def forward() -> Forward:
            mask, positions, rows = inputs.built(span, self.dtype)
            self.cache.write_rows(rows)
            self.cache.span = span
            final, features = self.model(inputs.ids[None], positions, mask, self.cache, layers or ())
            logits = self.model.get_output_embeddings()(final[0])
            picks = (logits.argmax(dim=-1), margins(logits)) if greedy else None
            return Forward(logits, None if features is None else features[0], picks)

        if bucket in BUCKETS and self.cache.keys is not None:
            out = self.replays.run(key, forward)
        else:  # a prefill longer than any bucket, or the forward that allocates the cache: never captured
            with allocating(self.cache):
                out = forward()
        self.cache.length = past + n  # the rows of this forward, until commit keeps some
        rows = slice(n - 1, n) if last_only else slice(0, n)  # `last_only` spares logits; features are every row's
        return Forward(
            out.logits[rows].clone(),
            None if out.features is None else out.features[:n].clone(),
            None if out.picks is None else (out.picks[0][:n], out.picks[1][:n]),
        )  # (read at once)

    @torch.inference_mode()
    def commit(self, start: int, keep: list[int]) -> None:
        self.cache.commit(start, keep)

    def crop(self, length: int) -> None:
        self.cache.crop(length)
