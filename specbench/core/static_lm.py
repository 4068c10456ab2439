"""CachedLM on a preallocated KV cache (`--graphs`): every forward is padded to a bucket of rows (1, 2, 4, ... 128),
so each bucket has fixed shapes, and on a GPU each bucket's forward is captured once as a CUDA graph and replayed:
no Python and no per-kernel launch cost per step. Attention reads the live rows only (rounded up to SPAN, a graph
per span). The mask, positions and cache rows are built inside the graph from the ids, two counts and a tree's
shape (`Inputs`). Padding rows attend to one cached row and are never committed; a commit moves the accepted rows in
place. On a CPU the same cache and padding run without capture, which is what the tests check against the eager
loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from ..errors import SpecbenchError
from . import kernels
from .cached_lm import CachedLM, Forward, SideBranch, as_ids, call
from .transfer import upload
from .tree import Tree, additive, new_rows_allowed, position_ids

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows of a verification (root, tree, side branch), padded up to one
SPAN = 256  # the keys a forward attends over come in multiples of this (only the live rows, not the whole cache)
MAX_CACHE = 4096  # cached tokens at most (the model's own context if shorter): prompt and answer must fit
# SDPA's kernels in a captured forward, by priority. cuDNN's first: a one-row forward's attention over 256 keys took
# 9.8 µs a layer there against 24.4 on the memory-efficient kernel (H200, vicuna-7b's shapes; docs/gpu-notes.md).
# Uncaptured forwards keep it off (models.loading): it builds a plan for every shape it meets, which a captured
# bucket does once.
CAPTURED_ATTENTION = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]  # fmt: skip
T = TypeVar("T")


class StaticRows(DynamicCache):
    """A KV cache of `capacity` rows per layer, allocated at the first forward; a forward writes its keys and values
    at the rows `write_rows` set (a device tensor: a replayed graph writes wherever it says now) and attends over the
    first `span` rows. Every layer's rows lie in one tensor, layer after layer, so torch.compile can take the layer's
    number as a symbol (every layer shares one compiled graph) and still write the rows in place (into a view of a
    tensor, such as one layer's of a stack, it copies the whole tensor)."""

    def __init__(self, config, capacity: int) -> None:
        super().__init__(config=config)
        self.capacity = capacity
        self.layers_count = config.get_text_config().num_hidden_layers
        self.at: torch.Tensor | None = None  # [layers, n]: `write_rows`
        self.starts: torch.Tensor | None = None  # [layers, 1]: each layer's first row in the one tensor
        self.span = capacity
        self.keys: torch.Tensor | None = None  # [batch, kv heads, layers * capacity, head dim]
        self.values: torch.Tensor | None = None
        self.length = 0  # rows committed

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys is None:  # (the allocating forward runs uncompiled: `allocating`)
            self.keys, self.values = (
                states.new_zeros((*states.shape[:2], self.layers_count * self.capacity, states.shape[-1]))
                for states in (key_states, value_states)
            )
        start = layer_idx * self.capacity
        if kernels.writes_rows(self.keys, self.values, key_states, value_states):  # (one kernel on a GPU)
            kernels.write_rows(self.keys, self.values, self.at[layer_idx], key_states, value_states)
        else:
            self.keys.index_copy_(2, self.at[layer_idx], key_states)
            self.values.index_copy_(2, self.at[layer_idx], value_states)
        return self.keys[:, :, start : start + self.span], self.values[:, :, start : start + self.span]

    def write_rows(self, rows: torch.Tensor) -> None:
        """The rows [n] of each layer the next forward writes (offset into the one tensor here, not once a layer)."""
        if self.layers_count == 1:
            self.at = rows[None]
            return
        if self.starts is None:
            self.starts = torch.arange(0, self.layers_count * self.capacity, self.capacity, device=rows.device)[:, None]
        self.at = self.starts + rows

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.length


def uncompiled() -> contextlib.AbstractContextManager:
    """A context in which torch.compile'd functions run eagerly: for calls too rare to be worth a graph."""
    return torch.compiler.set_stance("force_eager")  # (sets it now: use it in a `with` at once)


def allocating(cache: StaticRows) -> contextlib.AbstractContextManager:
    """Around an uncaptured forward into `cache`: the one that allocates its rows runs uncompiled (under --compile,
    tracing the allocation would compile a whole graph for one call)."""
    return uncompiled() if cache.keys is None else contextlib.nullcontext()


def capture(fn: Callable[[], T], device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`fn` (tensor work on static inputs, no host syncs) run twice on a side stream to warm up, then captured as a
    CUDA graph in `pool`: the graph and the outputs each replay writes. Attention inside prefers cuDNN's kernel
    (CAPTURED_ATTENTION)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with sdpa_kernel(CAPTURED_ATTENTION, set_priority=True):
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
    the first time `key` is met and replays it after, returning the outputs each replay writes. With `capture` off
    (on a CPU) it keeps a replay's contract all the same: each later call of a key runs the function first met there
    (what a graph replays: its inputs are the tensors that one read) and writes its outputs over the first call's
    tensors, and the first call runs it three times (a capture's two warm-ups and the capture), so a caller that
    keeps an output past the next replay or hands a replay new input tensors, or a function whose effects add up
    when it runs again, fails on a CPU as it would on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capture = device.type == "cuda"
        self.pool = None
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.uncaptured: dict[Hashable, tuple[Callable[[], Any], Any]] = {}  # by key: the first function, its outputs

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        if not self.capture:
            if key not in self.uncaptured:
                fn(), fn()
                self.uncaptured[key] = fn, fn()
                return self.uncaptured[key][1]
            first, out = self.uncaptured[key]
            _write_over(out, first())
            return out
        if key not in self.graphs:
            graph, out = capture(fn, self.device, self.pool)
            self.pool = graph.pool()
            self.graphs[key] = graph, out
        graph, out = self.graphs[key]
        graph.replay()
        return out


def _write_over(old: Any, new: Any) -> None:
    """A replay's outputs `new` written into the tensors `old` of the same structure (tensors, tuples, lists,
    dataclasses, None), which must keep their shapes, as a graph's outputs do."""
    if isinstance(old, torch.Tensor):
        if old.shape != new.shape:
            raise RuntimeError(f"a replayed output changed shape, {tuple(old.shape)} -> {tuple(new.shape)}: a CUDA "
                               "graph cannot")  # fmt: skip
        old.copy_(new)
    elif isinstance(old, (tuple, list)):
        for a, b in zip(old, new, strict=True):
            _write_over(a, b)
    elif is_dataclass(old):
        for field in fields(old):
            _write_over(getattr(old, field.name), getattr(new, field.name))
    elif old is not None or new is not None:
        raise TypeError(f"a replay's output {type(old).__name__} is not tensors")


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
    """The CachedLM interface over StaticRows; `capture`: CUDA graphs per (bucket, layers) (default: on CUDA)."""

    def __init__(self, model, capture: bool | None = None) -> None:
        super().__init__(model)
        self.capacity = min(self.context_length, MAX_CACHE) + BUCKETS[-1]
        self.context_length = self.capacity - BUCKETS[-1]
        self.replays = Replays(self.device)
        self.replays.capture = self.replays.capture if capture is None else capture
        self.inputs: dict[tuple, Inputs] = {}  # by (bucket, span, layers, chain or not, greedy)
        self.cache = StaticRows(model.config, self.capacity)

    @property
    def cached(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.length = 0  # rows past `length` are never attended to, so nothing needs clearing
        self.prefilled = None

    @torch.inference_mode()
    def run(self, tokens: list[int] | torch.Tensor, tree: Tree | None = None, *, last_only: bool = False,
            layers: tuple[int, ...] | None = None, side: SideBranch | None = None,
            greedy: bool = False) -> Forward:  # fmt: skip
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
            inputs.local[:n, :n] = upload(new_rows_allowed(tree, side.allowed if side else None), self.device)
            inputs.offsets[:n] = position_ids(tree, 0, self.device, side.positions if side else None)[0]

        def forward() -> Forward:
            mask, positions, rows = inputs.built(span, self.dtype)
            self.cache.write_rows(rows)
            self.cache.span = span
            return call(self.model, self.cache, inputs.ids[None], mask, positions, layers, greedy=greedy)

        if bucket in BUCKETS and self.cache.keys is not None:
            out = self.replays.run(key, forward)
        else:  # a prefill longer than any bucket, or the forward that allocates the cache: never captured
            with allocating(self.cache):
                out = forward()
        self.cache.length = past + n  # the rows of this forward, until commit keeps some
        rows = slice(n - 1, n) if last_only else slice(0, n)  # `last_only` spares logits; features are every row's
        return Forward(out.logits[rows].clone(), None if out.features is None else out.features[:n].clone(),
                       None if out.picks is None else (out.picks[0][:n], out.picks[1][:n]))  # (read at once)

    @torch.inference_mode()
    def commit(self, start: int, keep: list[int]) -> None:
        """Keep rows start + keep[i] as rows start + i, moved in place through every layer at once (four kernels:
        the layers share one tensor); the rest are past the length, ignored."""
        if keep != list(range(len(keep))):
            firsts = range(start, self.cache.layers_count * self.capacity, self.capacity)  # each layer's row `start`
            source = [first + k for first in firsts for k in keep]
            moves = upload(source + [first + i for first in firsts for i in range(len(keep))], self.device)
            moves = moves.view(2, -1)
            for stored in (self.cache.keys, self.cache.values):
                stored.index_copy_(2, moves[1], stored.index_select(2, moves[0]))
        self.cache.length = start + len(keep)

    def crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)
