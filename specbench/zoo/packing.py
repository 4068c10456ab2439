"""Packing tokenised conversations into fixed-length training sequences."""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch


def pack(
    docs: list[list[int]], seq_len: int, rng: random.Random | None = None, tags: list[list[int]] | None = None
) -> torch.Tensor:
    """Concatenate `docs` (shuffled when `rng` is given), cut into rows of `seq_len`, drop the remainder.

    Returns [rows, seq_len]; with per-token `tags` (same lengths as `docs`), [rows, 2, seq_len]: ids, tags.
    """
    order = list(range(len(docs)))
    if rng is not None:
        rng.shuffle(order)
    streams = [docs] if tags is None else [docs, tags]
    packed = []
    for stream_docs in streams:
        stream = [t for i in order for t in stream_docs[i]]
        rows = len(stream) // seq_len
        packed.append(torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len))
    return packed[0] if tags is None else torch.stack(packed, dim=1)


def batches(
    docs: list[list[int]], seq_len: int, batch: int, seed: int, tags: list[list[int]] | None = None
) -> Iterator[torch.Tensor]:
    """Endless batches of packed rows; every epoch reshuffles the documents and the rows, seeded."""
    rng = random.Random(seed)
    while True:
        rows = pack(docs, seq_len, rng, tags)
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        for i in range(0, len(rows) - batch + 1, batch):
            yield rows[perm[i : i + batch]]
