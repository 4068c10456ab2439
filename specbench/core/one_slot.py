"""The eager regime's target: a transformers model with its own KV cache (`CachedLM`) behind the batch interface
of `BatchedLM`, as a batch of one (slot 0), so the loop, the profiles and the audits speak one interface for both
regimes."""

from __future__ import annotations

from . import acceptance
from .cached_lm import CachedLM, Forward, margins
from .static_lm import BatchedLM, Row
from .step import Judged
from .transfer import upload
from .tree import EMPTY


class OneSlot:
    """`lm` as a batch of one: `BatchedLM`'s prefill, run, verify, commit and rewind for slot 0 (`model`: its
    transformers model)."""

    batch = 1

    def __init__(self, lm: CachedLM) -> None:
        self.lm, self.model = lm, lm.model
        self.device, self.context_length = lm.device, lm.context_length

    @property
    def lengths(self) -> list[int]:
        return [self.lm.cached]

    def prefill(
        self, slots: list[int], prompts: list[list[int]], layers: tuple[int, ...] | None = None, reuse: bool = False
    ) -> list[Forward | None]:
        (prompt,) = prompts
        return [self.lm.prefill(prompt, layers, reuse=reuse)]

    def run(
        self, rows: list[Row], *, layers: tuple[int, ...] | None = None, greedy: bool = False, last_only: bool = False
    ) -> list[Forward]:
        """The one row's forward (any length): logits [n or 1, V], features [n, F]."""
        (row,) = rows
        return [self.lm.run(row.joined(), row.tree, last_only=last_only, layers=layers, side=row.side, greedy=greedy)]

    def verify(
        self, rows: list[Row], *, layers: tuple[int, ...] | None = None, greedy: bool = False, judged: bool = False
    ) -> tuple[Forward, Judged | None]:
        """`BatchedLM.verify` for the one sequence: its output [1, n, ...] and, when `judged`, its greedy verdict,
        decided on the host from the one read of its picks (cheaper than a batch's tensor operations for one
        sequence: `acceptance.greedy`)."""
        (row,) = rows
        (out,) = self.run(rows, layers=layers, greedy=greedy or judged)
        logits, features = out.logits[None], None if out.features is None else out.features[None]
        if not (greedy or judged):
            return Forward(logits, features), None
        top1 = logits.argmax(-1) if out.picks is None else out.picks[0][None]  # [1, n]
        if not judged:
            return Forward(logits, features, (top1, margins(logits))), None
        tree = row.tree if row.tree is not None else EMPTY
        best = tree.read_along(top1[0])  # (a tree still on the device comes with them: one read)
        accepted = acceptance.greedy(tree, best[: len(tree) + 1], getattr(tree, "limit", None))
        n, kept = len(best), [0, *accepted.rows]
        pad = [0] * (n - len(kept))
        new = [tree.tokens[r - 1] for r in accepted.rows] + [accepted.token]
        summary = [len(accepted.rows), accepted.tested, *kept, *pad, *new, *pad, *best]
        at = upload(kept + pad, self.device)
        chosen = features[:, at] if features is not None else None
        verdict = Judged([summary], top1[:, at], margins(logits[:, at]), chosen)
        return Forward(logits, features), verdict

    def commit(self, moves: list[tuple[int, int, list[int]]]) -> None:
        ((_, start, keep),) = moves
        self.lm.commit(start, keep)

    def rewind(self, slot: int, length: int) -> None:
        """The sequence's cached rows from `length` on dropped."""
        self.lm.crop(length)


Target = BatchedLM | OneSlot  # a model behind the batch interface: the owned decoder's static cache, or eager's


def single(model: CachedLM | BatchedLM | OneSlot) -> Target:
    """`model` behind the batch interface: a CachedLM as a batch of one, the others as they are."""
    return OneSlot(model) if isinstance(model, CachedLM) else model
