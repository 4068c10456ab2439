"""A drafting model's KV cache for every slot of a batch, so a drafter runs one forward for all its slots: one
`BatchedLM` (the owned decoder: under --graphs, and for a batch) or, for a model run by transformers (the eager
regime's batch of one), a `CachedLM` per slot, run one after another."""

from __future__ import annotations

import torch

from .cached_lm import CachedLM, Forward
from .static_lm import BUCKETS, BatchedLM, Row
from .transfer import upload


class Lanes:
    """`model` is a BatchedLM (every slot's rows in one forward), a CachedLM (slot 0's; the others get their own cache
    of its model) or a causal LM (a CachedLM per slot)."""

    def __init__(self, model: BatchedLM | CachedLM | torch.nn.Module) -> None:
        self.batched = model if isinstance(model, BatchedLM) else None
        self.own: dict[int, CachedLM] = {0: model} if isinstance(model, CachedLM) else {}  # slot -> its cache, when
        # not batched
        self.model = model.model if isinstance(model, CachedLM | BatchedLM) else model
        self.context_length = self.batched.context_length if self.batched is not None else self.lane(0).context_length

    def lane(self, slot: int) -> CachedLM:
        """`slot`'s own cache (not batched)."""
        if slot not in self.own:
            self.own[slot] = CachedLM(self.model)
        return self.own[slot]

    def cached(self, slot: int) -> int:
        return self.batched.lengths[slot] if self.batched is not None else self.lane(slot).cached

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> None:
        """Empty `slots` and fill each with all of its prompt but the last token: batched, together
        (`BatchedLM.prefill`)."""
        if self.batched is not None:
            self.batched.prefill(slots, prompts)
            return
        for slot, prompt in zip(slots, prompts, strict=True):
            self.lane(slot).prefill(prompt)

    def crop(self, slot: int, length: int) -> None:
        """Drop `slot`'s rows from `length` on."""
        if self.batched is not None:
            self.batched.lengths[slot] = min(self.batched.lengths[slot], length)
        else:
            self.lane(slot).crop(length)

    def chains(self, k: int, tokens: list[list[int]], max_depths: list[int], whole: bool = False) -> list[int]:
        """How many tokens each slot's chain drafts: k, at most its depth budget, none where they would not fit the
        model's context after its committed `tokens`. `whole` (T = 0): a slot with any budget drafts all k where
        they fit, as its batch-mates do (the loop cuts its chain on the device: one chain length for the batch)."""
        found = []
        for t, d in zip(tokens, max_depths, strict=True):
            n = k if whole and d > 0 and len(t) + k <= self.context_length else min(k, d)
            found.append(n if n > 0 and len(t) + n <= self.context_length else 0)
        return found

    def follow(self, slot: int, tokens: list[int]) -> None:
        """After a verification: `slot`'s rows stay valid up to the last accepted token (the newest is the root)."""
        self.crop(slot, len(tokens) - 1)

    @torch.inference_mode()
    def run(self, rows: list[Row], *, greedy: bool = False, last_only: bool = False) -> list[Forward]:
        """Each row appended to its slot's cache, its output in order (copied): batched, one forward for the rows
        that fit a bucket (a longer one, a catch-up after a prompt, runs alone); else slot after slot. `greedy`:
        a batched forward's picks are computed inside it (a slot's own cache leaves them to the caller)."""
        if self.batched is None:
            return [self.lane(r.slot).run(r.joined(), r.tree, last_only=last_only, greedy=greedy) for r in rows]
        out: dict[int, Forward] = {}
        short = [row for row in rows if row.size <= BUCKETS[-1]]
        for row in rows:
            if row.size > BUCKETS[-1]:
                out[row.slot] = self.batched.run([row], last_only=last_only)[0]
        if short:
            outs = self.batched.run(short, greedy=greedy, last_only=last_only)
            out.update(zip([row.slot for row in short], outs, strict=True))
        return [out[row.slot] for row in rows]

    @torch.inference_mode()
    def last_logits(self, rows: list[Row]) -> torch.Tensor:
        """Each row appended to its slot's cache (as `run`), and its last token's logits [len(rows), V] on the
        device: batched, one gather of the forward's output (no per-row copy)."""
        if self.batched is None or any(row.size > BUCKETS[-1] for row in rows):
            return torch.cat([out.logits[-1:] for out in self.run(rows, last_only=True)])
        out, _ = self.batched.verify(rows)
        at = upload([r.slot for r in rows] + [r.size - 1 for r in rows], out.logits.device)
        return out.logits[at[: len(rows)], at[len(rows) :]]

    @torch.inference_mode()
    def picks(self, rows: list[Row], last: int = 1) -> torch.Tensor:
        """Each row appended to its slot's cache (as `run`), and the argmax of its `last` tokens [len(rows), last]
        on the device (a row shorter than `last` repeats its first token's in front): batched, the forward's own
        picks gathered at once (no per-row copy of its output)."""
        if self.batched is None or any(row.size > BUCKETS[-1] for row in rows):
            outs = self.run(rows, greedy=True, last_only=last == 1)
            return torch.stack([argmax(out, last) for out in outs])
        out, _ = self.batched.verify(rows, greedy=True, top1_only=True)
        assert out.picks is not None  # (a greedy forward's)
        slots = [r.slot for r in rows for _ in range(last)]
        at = upload(slots + [max(r.size - last + j, 0) for r in rows for j in range(last)], out.picks[0].device)
        return out.picks[0][at[: len(slots)], at[len(slots) :]].view(len(rows), last)


def argmax(out: Forward, last: int = 1) -> torch.Tensor:
    """The last `last` rows' argmax [last] on the device (fewer rows: the first one's repeated in front), the
    forward's picks when it computed them, else from its logits."""
    top = out.picks[0][-last:].clone() if out.picks is not None else out.logits[-last:].argmax(-1)
    return top if len(top) == last else torch.cat([top[:1].expand(last - len(top)), top])
