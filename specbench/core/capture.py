"""CUDA graphs: a function of static inputs captured once and replayed (`Replays`, one memory pool), and the same
contract kept on a CPU, where nothing is captured, so the tests catch what a replay would break."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA's kernels in a captured forward, by priority. cuDNN's first: a one-row forward's attention over 256 keys took
# 9.8 µs a layer there against 24.4 on the memory-efficient kernel (H200, vicuna-7b's shapes; docs/gpu-notes.md).
# Uncaptured forwards keep it off (models.loading): it builds a plan for every shape it meets, which a captured
# bucket does once.
CAPTURED_ATTENTION = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
T = TypeVar("T")


def uncompiled() -> contextlib.AbstractContextManager:
    """A context in which torch.compile'd functions run eagerly: for calls too rare to be worth a graph."""
    return torch.compiler.set_stance("force_eager")  # (sets it now: use it in a `with` at once)


def capture(fn: Callable[[], T], device: torch.device, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, T]:
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
        self.pool: Any = None
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
            raise RuntimeError(
                f"a replayed output changed shape, {tuple(old.shape)} -> {tuple(new.shape)}: a CUDA graph cannot"
            )
        old.copy_(new)
    elif isinstance(old, (tuple, list)):
        for a, b in zip(old, new, strict=True):
            _write_over(a, b)
    elif is_dataclass(old):
        for field in fields(old):
            _write_over(getattr(old, field.name), getattr(new, field.name))
    elif old is not None or new is not None:
        raise TypeError(f"a replay's output {type(old).__name__} is not tensors")
