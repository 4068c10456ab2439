"""Prompt lookup decoding: propose the tokens that followed the latest earlier match of the last n tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..core.proposer import NO_PROPOSAL, Proposal, Proposer, chain_prefix
from ..core.tree import chain
from ..registry import implementation
from .resources import Resources


def find_continuation(tokens: list[int], max_ngram: int, num_pred: int) -> list[int]:
    """For n = max_ngram..1: the tokens after the first earlier occurrence of the last n tokens (else [])."""
    seq = np.asarray(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        windows = sliding_window_view(seq[:-1], n)  # windows[s] = seq[s : s + n], the trailing one excluded
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + num_pred]
    return []


class PromptLookup(Proposer):
    def __init__(self, max_ngram_size: int = 3, num_pred_tokens: int = 10) -> None:
        if max_ngram_size < 1 or num_pred_tokens < 1:
            raise ValueError("pld needs max_ngram_size >= 1 and num_pred_tokens >= 1")
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        draft = find_continuation(tokens, self.max_ngram_size, self.num_pred_tokens)
        return Proposal(chain(draft)) if draft else NO_PROPOSAL


@implementation("pld", nested=chain_prefix("num_pred_tokens"))
def build(params: dict, res: Resources) -> Proposer:
    return PromptLookup(**params)
