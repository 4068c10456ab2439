"""PARD-2: PARD's parallel drafting (`methods.pard`: k - 1 mask tokens after the committed ones, one forward guesses
k tokens, the masks' cache rows dropped at once) by a drafter whose input embeddings add the target's states,
projected (`heads.pard2`): row p reads the target's states at p - 1, a mask row those its last real row reads, as
`pard2_infer.py` feeds them. `target_features: false` drafts without them (the checkpoint is trained for both).

The drafter runs on the owned decoder in both regimes, every slot's rows in one forward (captured under --graphs);
each step writes the newly committed rows' projected states into its table in one scatter, and the mask rows'
copies of their root's in another.
"""

from __future__ import annotations

import torch

from ..core.lanes import Lanes
from ..core.proposer import Feedback, Proposal, Turn, chain_prefix
from ..core.static_lm import BatchedLM
from ..core.transfer import upload
from ..heads.pard2 import FAMILY, Pard2Draft
from ..registry import implementation
from .pard import Pard
from .resources import Resources


class Pard2(Pard):
    def __init__(
        self,
        draft: Pard2Draft,
        lanes: Lanes,
        vocab: int,
        num_draft_tokens: int = 8,
        target_features: bool = True,
    ) -> None:
        super().__init__(lanes, draft.pard_token, vocab, num_draft_tokens)
        if not isinstance(target_features, bool):
            raise ValueError(f"pard2's target_features is true or false, not {target_features!r}")
        assert lanes.batched is not None  # (the owned decoder's static cache: `build`)
        self.draft = draft
        self.feature_layers = draft.feature_layers if target_features else None
        draft.table = None
        if target_features:
            draft.reserve(lanes.batched.batch, lanes.batched.capacity)

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        """Each prompt's rows 0..n - 1 get the target's states at -1 (zero), 0, ..., n - 2, then the prefill."""
        if self.draft.table is not None:
            width = self.draft.target_proj.in_features
            features = [t.features for t in turns if t.features is not None]
            assert len(features) == len(turns)  # the target returns the feature_layers' states
            self._write(slots, [0] * len(slots), [torch.cat([f.new_zeros(1, width), f]) for f in features])
        super().start(slots, turns)

    def _masks(self, slots: list[int], roots: list[int], ks: list[int]) -> None:
        """Each mask row reads what its root reads (`pard2_infer.py` repeats the last real row's states)."""
        table = self.draft.table
        if table is None or not slots or max(ks) < 2:
            return
        into = [(s, r, r + j) for s, r, k in zip(slots, roots, ks, strict=True) for j in range(1, k)]
        at = upload([x for triple in into for x in triple], table.device).view(-1, 3)
        table[at[:, 0], at[:, 2]] = table[at[:, 0], at[:, 1]]

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        super().update(slots, tokens, proposals, feedback)
        if self.draft.table is not None:  # the root's and the accepted rows' states, read from the next rows on
            features = [fed.features for fed in feedback if fed.features is not None]
            assert len(features) == len(slots)  # the target returns the feature_layers' states
            self._write(slots, [len(t) - len(f) for t, f in zip(tokens, features, strict=True)], features)

    def _write(self, slots: list[int], starts: list[int], features: list[torch.Tensor]) -> None:
        """Slot slots[i]'s rows from starts[i] on get features[i] [n_i, F], projected: every slot's in one product
        and one scatter."""
        table = self.draft.table
        assert table is not None and len(features) == len(slots)
        sizes = [len(f) for f in features]
        if not sum(sizes):
            return
        at = upload(
            [s for s, n in zip(slots, sizes, strict=True) for _ in range(n)]
            + [p + j for p, n in zip(starts, sizes, strict=True) for j in range(n)],
            table.device,
        ).view(2, -1)
        table[at[0], at[1]] = self.draft.projected(torch.cat(features).to(table.device)).to(table.dtype)


@implementation("pard2", nested=chain_prefix("num_draft_tokens"), graphed=lambda params: True, batched=True)
def build(params: dict, res: Resources, slots: int) -> Pard2:
    draft: Pard2Draft = res.head(FAMILY.name, res.draft_dtype(params.pop("draft_dtype", None)))
    vocab = res.target_model.get_output_embeddings().weight.shape[0]
    lanes = Lanes(BatchedLM(draft, slots, capture=None if res.graphs else False))
    return Pard2(draft, lanes, vocab, **params)
