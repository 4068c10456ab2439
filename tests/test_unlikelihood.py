"""Answer tuning loss: repeat candidates against brute force, and the loss against a hand computation."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from specbench.zoo.packing import pack
from specbench.zoo.unlikelihood import (
    PROMPT,
    answer_loss,
    answer_tags,
    continuation_loss,
    repeat_candidates,
    repeated_ngram_mask,
)


def _brute(ids: list[int], tags: list[int], vocab: int) -> set[tuple[int, int]]:
    """(t, v) pairs: predicting ids[t+1] (an answer token), v was an earlier answer token of the same run."""
    out = set()
    for t in range(len(ids) - 1):
        tag = tags[t + 1]
        if tag == PROMPT:
            continue
        start = t + 1
        while start > 0 and tags[start - 1] == tag:
            start -= 1
        for j in range(start, t + 1):
            if ids[j] != ids[t + 1]:
                out.add((t, ids[j]))
    return out


def test_hand_worked_example() -> None:
    # prompt 5 5 | answer 1 2 1 3 | prompt 5 | answer 2 2
    ids = torch.tensor([[5, 5, 1, 2, 1, 3, 5, 2, 2]])
    tags = torch.tensor([answer_tags(2, 6, 1) + answer_tags(1, 3, 2)])
    cand = repeat_candidates(ids, tags, vocab=6)[0]
    got = {(t, v) for t, v in cand.nonzero().tolist()}
    # t=2 predicts 2: {1}; t=3 predicts 1 (itself excluded): {2}; t=4 predicts 3: {1, 2}
    # t=7 predicts 2 in the second answer, which has only 2 before it: nothing
    assert got == {(2, 1), (3, 2), (4, 1), (4, 2)}


@pytest.mark.parametrize("seed", range(20))
def test_candidates_match_brute_force(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab, rows, length = 5, 3, 17
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    tags = torch.zeros(rows, length, dtype=torch.long)
    for b in range(rows):
        t, number = 0, 1 + 100 * b
        while t < length:  # random prompt / answer segments, answers may start at position 0
            p = int(torch.randint(0, 3, (1,), generator=gen))
            a = int(torch.randint(1, 6, (1,), generator=gen))
            tags[b, t + p : t + p + a] = number
            t, number = t + p + a, number + 1
    cand = repeat_candidates(ids, tags, vocab)
    for b in range(rows):
        got = {(t, v) for t, v in cand[b].nonzero().tolist()}
        assert got == _brute(ids[b].tolist(), tags[b].tolist(), vocab)


def test_loss_is_answer_cross_entropy_plus_weighted_unlikelihood() -> None:
    ids = torch.tensor([[4, 1, 2, 1]])
    tags = torch.tensor([answer_tags(1, 4, 1)])
    logits = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0))
    logp = F.log_softmax(logits, -1)[0]
    # positions 0, 1, 2 predict answer tokens 1, 2, 1; candidates: t=1 {1}, t=2 {2} (1 is the target)
    ce = -(logp[0, 1] + logp[1, 2] + logp[2, 1]) / 3
    ul = -(math.log(1 - logp[1, 1].exp()) + math.log(1 - logp[2, 2].exp())) / 3
    assert answer_loss(logits, ids, tags, 0.0).item() == pytest.approx(ce.item(), rel=1e-5)
    assert answer_loss(logits, ids, tags, 0.5).item() == pytest.approx((ce + 0.5 * ul).item(), rel=1e-5)


def test_unlikelihood_gradient_lowers_repeated_tokens() -> None:
    ids = torch.tensor([[0, 1, 2, 3]])
    tags = torch.tensor([[PROMPT, 1, 1, 1]])
    logits = torch.zeros(1, 4, 4, requires_grad=True)
    answer_loss(logits, ids, tags, 1.0).backward()
    # predicting ids[3] = 3 at t = 2: tokens 1 and 2 were used in the answer, so their logits get pushed down
    # beyond plain cross-entropy, and token 0 (prompt only) only by cross-entropy
    grad = logits.grad[0, 2]
    assert grad[1] > grad[0] and grad[2] > grad[0]


def test_pack_keeps_tags_aligned_with_tokens() -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    tags = [answer_tags(1, 3, 1), answer_tags(0, 2, 2), answer_tags(2, 4, 3)]
    rows = pack(docs, 4, random.Random(0), tags)
    assert rows.shape == (2, 2, 4)
    owner = {tok: tag for d, t in zip(docs, tags, strict=True) for tok, tag in zip(d, t, strict=True)}
    for row in rows:
        assert [owner[int(i)] for i in row[0]] == row[1].tolist()


def test_repeated_ngram_mask_marks_every_token_of_a_repeat() -> None:
    # 1 2 3 4 | 1 2 3 4 repeats the first 4-gram; the 4-grams 2 3 4 1 etc. are new
    assert repeated_ngram_mask([1, 2, 3, 4, 1, 2, 3, 4]) == [False] * 4 + [True] * 4
    assert repeated_ngram_mask([1, 2, 3, 4, 5, 6]) == [False] * 6
    # a period-1 loop: the second 4-gram of 7s (from position 2) repeats the first (from position 1)
    assert repeated_ngram_mask([9, 7, 7, 7, 7, 7], n=4) == [False, False, True, True, True, True]
    assert repeated_ngram_mask([1, 2, 1, 2], n=2) == [False, False, True, True]


def test_continuation_loss_on_repeated_tokens_only() -> None:
    ids = torch.tensor([[0, 1, 2, 1, 2, 3]])  # prompt [0], continuation 1 2 1 2 3 (positions 1..5)
    logits = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(1))
    p = logits.softmax(-1)[0]
    # with n=2, continuation tokens 3 and 4 (ids 1, 2) repeat the bigram 1 2; predicted at positions 2 and 3
    expected = -(math.log(1 - p[2, 1]) + math.log(1 - p[3, 2])) / 5
    assert continuation_loss(logits, ids, 1, n=2).item() == pytest.approx(expected, rel=1e-5)
