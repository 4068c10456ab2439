"""A KV cache of preallocated rows (`--graphs`): a forward writes its keys and values where a device tensor says
(a replayed graph writes wherever it says now), attends over the first `span` rows, and a commit moves the accepted
rows in place. Rows past a sequence's length are never attended to, so nothing is ever cleared. `batch` sequences
(slots) lie side by side, each with rows of its own."""

from __future__ import annotations

import torch

from .transfer import upload


class StaticRows:
    """`capacity` rows for each of `layers` layers and `batch` slots, allocated by the first forward. Every layer's
    rows lie in one tensor, layer after layer, so torch.compile can take the layer's number as a symbol (every
    layer shares one compiled graph) and still write the rows in place (into a view of a tensor, such as one layer's
    of a stack, it copies the whole tensor)."""

    def __init__(self, layers: int, capacity: int, batch: int = 1) -> None:
        self.capacity = capacity
        self.layers_count = layers
        self.batch = batch
        self.at: torch.Tensor | None = None  # [layers, b or 1, n]: `write_rows`, offset into the one tensor
        self.starts: torch.Tensor | None = None  # [layers, 1, 1]: each layer's first row in the one tensor (`_starts`)
        self.slot: int | torch.Tensor | None = None  # the slots a forward runs over: one, several [n] (a prefill's;
        # their keys are read as a copy), None: all of them
        self.every: torch.Tensor | None = None  # [batch, 1]: all slots, the index a forward writes through
        self.span = capacity
        self.keys: torch.Tensor | None = None  # [batch, kv heads, layers * capacity, head dim]
        self.values: torch.Tensor | None = None
        self.length = 0  # rows committed (of slot 0: the one sequence of a batch of one)

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `layer`'s keys and values [b, kv heads, n, d] at the rows `write_rows` set, in its slots; their
        first `span` rows [b, kv heads, span, d]. (transformers' attention calls it too, with extra arguments.)"""
        if self.keys is None or self.values is None:  # (the allocating forward runs uncompiled: `allocating`)
            self.keys, self.values = (
                states.new_zeros((self.batch, states.shape[1], self.layers_count * self.capacity, states.shape[-1]))
                for states in (keys, values)
            )
            self.every = torch.arange(self.batch, device=keys.device)[:, None]
        assert self.at is not None, "write_rows comes before a forward"
        assert self.every is not None
        start = layer * self.capacity
        slots: slice | torch.Tensor = slice(None)  # the slots read: all, one (a view) or several (a copy)
        lanes = self.every  # [b, 1]: the slots written
        if isinstance(self.slot, int):
            slots = slice(self.slot, self.slot + 1)
            lanes = self.every[:1]  # (into the one slot's view)
        elif self.slot is not None:
            slots, lanes = self.slot, self.slot[:, None]
        for states, stored in ((keys, self.keys), (values, self.values)):
            if isinstance(self.slot, int):
                stored = stored[slots]  # (a view: the writes land in the whole)
            if self.batch == 1:  # one sequence: the write session 37's measured loop made (see docs/gpu-notes.md)
                stored.index_copy_(2, self.at[layer][0], states)
            else:  # [b, n, kv heads, d] into [slot, :, row]
                stored[lanes, :, self.at[layer]] = states.transpose(1, 2)
        return self.keys[slots, :, start : start + self.span], self.values[slots, :, start : start + self.span]

    def write_rows(self, rows: torch.Tensor, slot: int | torch.Tensor | None = None) -> None:
        """The rows [n] (every slot's) or [b, n] (each slot's own) of each layer the next forward writes (offset into
        the one tensor here, not once a layer), in every slot or in `slot` alone (one, or several [b])."""
        rows = rows if rows.dim() == 2 else rows[None]
        self.slot = slot
        if self.layers_count == 1:
            self.at = rows[None]
            return
        self.at = self._starts(rows.device) + rows

    def _starts(self, device: torch.device) -> torch.Tensor:
        """Each layer's first row in the one tensor [layers, 1, 1], made once."""
        if self.starts is None:
            starts = torch.arange(0, self.layers_count * self.capacity, self.capacity, device=device)
            self.starts = starts[:, None, None]
        return self.starts

    def get_seq_length(self, layer: int | None = 0) -> int:
        return self.length

    def commit(self, start: int, keep: list[int]) -> None:
        """A batch of one: `commit_rows` for slot 0, whose length becomes start + len(keep)."""
        self.commit_rows([(0, start, keep)])
        self.length = start + len(keep)

    def commit_rows(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """For each (slot, start, keep): the slot's rows start + keep[i] kept as rows start + i, moved in place through
        every layer and slot at once (a few kernels: the layers and slots share one tensor; the host lists each slot's
        moved rows once, not once a layer); the rest lie past the slot's length, ignored."""
        if self.keys is None or self.values is None:
            return
        slots: list[int] = []
        source: list[int] = []
        target: list[int] = []
        for slot, start, keep in moves:
            for i, k in enumerate(keep):
                if k != i:  # (a row already in place stays)
                    slots.append(slot)
                    source.append(start + k)
                    target.append(start + i)
        if not slots:
            return
        index = upload(slots + source + target, self.keys.device).view(3, -1)  # [3, n]: layer 0's rows
        lanes, rows = index[0], index[1:]
        if self.layers_count > 1:  # every layer's: its rows `capacity` further on than the layer before's
            rows = (rows[:, None, :] + self._starts(index.device)[:, 0]).view(2, -1)  # [2, layers * n]
            lanes = lanes.repeat(self.layers_count)
        for stored in (self.keys, self.values):
            stored[lanes, :, rows[1]] = stored[lanes, :, rows[0]]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)
