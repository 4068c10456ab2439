"""core.static_cache.StaticRows.commit_rows: every slot's kept rows moved in place through every layer at once,
against a brute-force copy layer by layer and slot by slot."""

from __future__ import annotations

import random

import torch

from specbench.core.static_cache import StaticRows


def test_commit_rows_moves_each_slots_kept_rows_in_every_layer():
    draw = random.Random(0)
    for layers in (1, 3):
        for _ in range(50):
            cache = StaticRows(layers, capacity=12, batch=4)
            cache.keys = torch.randn(4, 2, layers * 12, 3)
            cache.values = torch.randn(4, 2, layers * 12, 3)
            before = (cache.keys.clone(), cache.values.clone())
            moves = []
            for slot in draw.sample(range(4), draw.randint(1, 4)):  # (some slots move nothing)
                start = draw.randint(0, 5)
                rows = sorted(draw.sample(range(1, 7), draw.randint(0, 6)))
                moves.append((slot, start, [0, *rows]))  # (the root stays: a verification's row 0)
            cache.commit_rows(moves)
            for stored, old in zip((cache.keys, cache.values), before, strict=True):
                expected = old.clone()
                for slot, start, keep in moves:
                    for layer in range(layers):
                        first = layer * 12 + start
                        for i, k in enumerate(keep):
                            expected[slot, :, first + i] = old[slot, :, first + k]
                kept = torch.zeros(4, layers * 12, dtype=torch.bool)  # the rows a commit defines
                for slot, start, keep in moves:
                    for layer in range(layers):
                        kept[slot, layer * 12 : layer * 12 + start + len(keep)] = True
                untouched = [s for s in range(4) if s not in {m[0] for m in moves}]
                kept[untouched] = True
                assert torch.equal(stored.transpose(1, 2)[kept], expected.transpose(1, 2)[kept])
