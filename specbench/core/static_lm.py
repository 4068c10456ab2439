"""CachedLM on a preallocated KV cache (`--graphs`): every forward is padded to a bucket of rows (1, 2, 4, ... 128),
so each bucket has fixed shapes, and on a GPU each bucket's forward is captured once as a CUDA graph and replayed:
no Python and no per-kernel launch cost per step. Attention reads the live rows only (rounded up to SPAN, a graph
per span). Padding rows attend to one cached row and are never committed; a commit moves the accepted rows in
place. On a CPU the same cache and padding run without capture, which is what the tests check against the eager
loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from ..errors import SpecbenchError
from .cached_lm import CachedLM, Forward, SideBranch, as_ids, call
from .transfer import upload
from .tree import Tree, attention_mask, position_ids

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows of a verification (root, tree, side branch), padded up to one
SPAN = 256  # the keys a forward attends over come in multiples of this (only the live rows, not the whole cache)
MAX_CACHE = 4096  # cached tokens at most (the model's own context if shorter): prompt and answer must fit
T = TypeVar("T")


class StaticRows(DynamicCache):
    """A KV cache of `capacity` rows per layer, allocated at the first forward; a forward writes its keys and values
    at the rows `at` holds (a device tensor: a replayed graph writes wherever `at` says now) and attends over the
    first `span` rows."""

    def __init__(self, config, capacity: int) -> None:
        super().__init__(config=config)
        self.capacity = capacity
        self.at: torch.Tensor | None = None
        self.span = capacity
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0  # rows committed

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.kv):
            keys = key_states.new_zeros((*key_states.shape[:2], self.capacity, key_states.shape[-1]))
            values = value_states.new_zeros((*value_states.shape[:2], self.capacity, value_states.shape[-1]))
            self.kv.append((keys, values))
        keys, values = self.kv[layer_idx]
        keys.index_copy_(2, self.at, key_states)
        values.index_copy_(2, self.at, value_states)
        return keys[:, :, : self.span], values[:, :, : self.span]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.length


def uncompiled() -> contextlib.AbstractContextManager:
    """A context in which torch.compile'd functions run eagerly: for calls too rare to be worth a graph."""
    return torch.compiler.set_stance("force_eager")  # (sets it now: use it in a `with` at once)


def allocating(cache: StaticRows) -> contextlib.AbstractContextManager:
    """Around an uncaptured forward into `cache`: the one that allocates its rows runs uncompiled (under --compile,
    tracing the allocation would compile a whole graph for one call)."""
    return uncompiled() if not cache.kv else contextlib.nullcontext()


def capture(fn: Callable[[], T], device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`fn` (tensor work on static inputs, no host syncs) run twice on a side stream to warm up, then captured as a
    CUDA graph in `pool`: the graph and the outputs each replay writes."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class Replays:
    """Functions of static inputs captured as CUDA graphs by key, in one memory pool: `run(key, fn)` captures `fn`
    the first time `key` is met and replays it after, returning the outputs each replay writes; on a CPU (or with
    `capture` off) it calls `fn`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capture = device.type == "cuda"
        self.pool = None
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        if not self.capture:
            return fn()
        if key not in self.graphs:
            graph, out = capture(fn, self.device, self.pool)
            self.pool = graph.pool()
            self.graphs[key] = graph, out
        graph, out = self.graphs[key]
        graph.replay()
        return out


@dataclass
class Inputs:
    """One bucket's captured forward reads these."""

    ids: torch.Tensor  # [1, b]
    positions: torch.Tensor  # [1, b]
    mask: torch.Tensor  # [1, 1, b, span]
    at: torch.Tensor  # [b]: the cache rows the forward writes


class StaticCachedLM(CachedLM):
    """The CachedLM interface over StaticRows; `capture`: CUDA graphs per (bucket, layers) (default: on CUDA)."""

    def __init__(self, model, capture: bool | None = None) -> None:
        super().__init__(model)
        self.capacity = min(self.context_length, MAX_CACHE) + BUCKETS[-1]
        self.context_length = self.capacity - BUCKETS[-1]
        self.replays = Replays(self.device)
        self.replays.capture = self.replays.capture if capture is None else capture
        self.inputs: dict[tuple, Inputs] = {}  # by (bucket, span, layers)
        self.moves: dict[int, torch.Tensor] = {}  # a commit's captured moves [2, bucket], by bucket
        self.cache = StaticRows(model.config, self.capacity)
        self.floor = torch.finfo(self.dtype).min

    @property
    def cached(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.length = 0  # rows past `length` are never attended to, so nothing needs clearing
        self.prefilled = None

    @torch.inference_mode()
    def run(self, tokens: list[int] | torch.Tensor, tree: Tree | None = None, *, last_only: bool = False,
            layers: tuple[int, ...] | None = None, side: SideBranch | None = None) -> Forward:  # fmt: skip
        past, n = self.cached, len(tokens)
        if past + n > self.context_length:
            raise SpecbenchError(f"{past + n} tokens do not fit the static cache of {self.context_length} (--graphs)")
        bucket = next((b for b in BUCKETS if b >= n), n)  # longer (a prefill): its own length, never captured
        ids = as_ids(tokens, self.device)
        ids = torch.cat([ids, ids[-1:].expand(bucket - n)])[None]  # padding: the last token again
        span = min(-(-(past + bucket) // SPAN) * SPAN, self.capacity)  # keys attended: the live rows, rounded up
        full = torch.full((1, 1, bucket, span), self.floor, dtype=self.dtype, device=self.device)
        if tree is None or (tree.is_chain and side is None):
            positions = torch.arange(past, past + n, device=self.device)[None]
            full[:, :, :n, :past] = 0
            causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            full[0, 0, :n, past : past + n].masked_fill_(causal, 0)
        else:
            positions = position_ids(tree, past, self.device, side.positions if side else None)
            full[:, :, :n, : past + n] = attention_mask(tree, past, self.dtype, self.device,
                                                        side.allowed if side else None)  # fmt: skip
        full[:, :, n:, 0] = 0  # padding rows see one cached row (a row of -inf would give NaN) and are never kept
        positions = torch.cat([positions, torch.full((1, bucket - n), past, device=self.device)], 1)  # padding: any
        at = torch.arange(past, past + bucket, device=self.device)
        key = (bucket, span, layers)
        if self.replays.capture and bucket in BUCKETS:  # (capture's warm-up runs write past the committed rows only)
            inputs = self.inputs.get(key)
            if inputs is None:
                inputs = self.inputs[key] = Inputs(ids.clone(), positions.clone(), full.clone(), at.clone())
            for static, now in ((inputs.ids, ids), (inputs.positions, positions), (inputs.mask, full), (inputs.at, at)):
                static.copy_(now)
            self.cache.at, self.cache.span = inputs.at, span
            out = self.replays.run(key, lambda: call(self.model, self.cache, inputs.ids, inputs.mask, inputs.positions,
                                                     layers))  # fmt: skip
        else:
            self.cache.at, self.cache.span = at, span
            with allocating(self.cache):
                out = call(self.model, self.cache, ids, full, positions, layers)
        self.cache.length = past + n  # the rows of this forward, until commit keeps some
        rows = slice(n - 1, n) if last_only else slice(0, n)  # `last_only` spares logits; features are every row's
        return Forward(out.logits[rows].clone(), None if out.features is None else out.features[:n].clone())

    @torch.inference_mode()
    def commit(self, start: int, keep: list[int]) -> None:
        """Keep rows start + keep[i] as rows start + i, moved in place; the rest are past the length, ignored. The
        moves are padded to a bucket with moves of the last row onto itself (past every committed row), so on a GPU
        each bucket's moves through every layer are one captured graph, not four kernels a layer."""
        if keep != list(range(len(keep))):
            bucket = next(b for b in BUCKETS if b >= len(keep))
            spare = [self.capacity - 1] * (bucket - len(keep))
            moves = upload([start + k for k in keep] + spare + list(range(start, start + len(keep))) + spare,
                           self.device).view(2, bucket)  # fmt: skip
            if not self.replays.capture:
                self._move(moves)
            else:
                static = self.moves.get(bucket)
                if static is None:  # captured on moves of nothing (its warm-up runs would move rows twice)
                    static = self.moves[bucket] = torch.full_like(moves, self.capacity - 1)
                    self.replays.run(("commit", bucket), lambda: self._move(static))
                static.copy_(moves)
                self.replays.run(("commit", bucket), lambda: self._move(static))
        self.cache.length = start + len(keep)

    def _move(self, moves: torch.Tensor) -> None:
        """Rows moves[0] of every layer's keys and values copied to rows moves[1]. moves: [2, m]."""
        for keys, values in self.cache.kv:
            keys.index_copy_(2, moves[1], keys.index_select(2, moves[0]))
            values.index_copy_(2, moves[1], values.index_select(2, moves[0]))

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)
