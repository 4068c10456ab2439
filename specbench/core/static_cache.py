"""A KV cache of preallocated rows (`--graphs`): a forward writes its keys and values where a device tensor says
(a replayed graph writes wherever it says now), attends over the first `span` rows, and a commit moves the accepted
rows in place. Rows past `length` are never attended to, so nothing is ever cleared."""

from __future__ import annotations

import torch

from .transfer import upload


class StaticRows:
    """`capacity` rows for each of `layers` layers, allocated by the first forward. Every layer's rows lie in one
    tensor, layer after layer, so torch.compile can take the layer's number as a symbol (every layer shares one
    compiled graph) and still write the rows in place (into a view of a tensor, such as one layer's of a stack, it
    copies the whole tensor). The batch dimension is there and is 1 today."""

    def __init__(self, layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.layers_count = layers
        self.at: torch.Tensor | None = None  # [layers, n]: `write_rows`, offset into the one tensor
        self.starts: torch.Tensor | None = None  # [layers, 1]: each layer's first row in the one tensor
        self.span = capacity
        self.keys: torch.Tensor | None = None  # [batch, kv heads, layers * capacity, head dim]
        self.values: torch.Tensor | None = None
        self.length = 0  # rows committed

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `layer`'s keys and values [B, kv heads, n, d] at the rows `write_rows` set; the layer's first
        `span` rows [B, kv heads, span, d]. (transformers' attention calls it too, with extra arguments.)"""
        if self.keys is None or self.values is None:  # (the allocating forward runs uncompiled: `allocating`)
            self.keys, self.values = (
                states.new_zeros((*states.shape[:2], self.layers_count * self.capacity, states.shape[-1]))
                for states in (keys, values)
            )
        assert self.at is not None, "write_rows comes before a forward"
        self.keys.index_copy_(2, self.at[layer], keys)
        self.values.index_copy_(2, self.at[layer], values)
        start = layer * self.capacity
        return self.keys[:, :, start : start + self.span], self.values[:, :, start : start + self.span]

    def write_rows(self, rows: torch.Tensor) -> None:
        """The rows [n] of each layer the next forward writes (offset into the one tensor here, not once a layer)."""
        if self.layers_count == 1:
            self.at = rows[None]
            return
        if self.starts is None:
            self.starts = torch.arange(0, self.layers_count * self.capacity, self.capacity, device=rows.device)[:, None]
        self.at = self.starts + rows

    def get_seq_length(self, layer: int | None = 0) -> int:
        return self.length

    def commit(self, start: int, keep: list[int]) -> None:
        """Keep rows start + keep[i] as rows start + i, moved in place through every layer at once (four kernels:
        the layers share one tensor); the rest are past the length, ignored."""
        if keep != list(range(len(keep))) and self.keys is not None and self.values is not None:
            firsts = range(start, self.layers_count * self.capacity, self.capacity)  # each layer's row `start`
            source = [first + k for first in firsts for k in keep]
            moves = upload(source + [first + i for first in firsts for i in range(len(keep))], self.keys.device)
            moves = moves.view(2, -1)
            for stored in (self.keys, self.values):
                stored.index_copy_(2, moves[1], stored.index_select(2, moves[0]))
        self.length = start + len(keep)

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)
