"""Packing tokenised conversations into fixed-length training sequences."""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch


def pack(docs: list[list[int]], seq_len: int, rng: random.Random | None = None) -> torch.Tensor:
    """Concatenate `docs` (shuffled when `rng` is given), cut into rows of `seq_len`, drop the remainder."""
    order = list(range(len(docs)))
    if rng is not None:
        rng.shuffle(order)
    stream = [t for i in order for t in docs[i]]
    rows = len(stream) // seq_len
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def batches(docs: list[list[int]], seq_len: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of packed rows; every epoch reshuffles the documents and the rows, seeded."""
    rng = random.Random(seed)
    while True:
        rows = pack(docs, seq_len, rng)
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        for i in range(0, len(rows) - batch + 1, batch):
            yield rows[perm[i : i + batch]]
