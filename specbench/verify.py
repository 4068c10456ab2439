"""Losslessness audits: greedy token-by-token agreement with vanilla, and a goodness-of-fit test for sampling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from .decode import decode
from .methods.base import Proposer
from .sampling import probabilities
from .target import Target

NEAR_TIE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}  # top-1/top-2 logit margins


def first_divergence(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, int] | None:
    """(turn, position) of the first token that differs, or None when every turn is identical."""
    for turn, (a, b) in enumerate(zip(ours, reference, strict=False)):
        for pos, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return turn, pos
        if len(a) != len(b):
            return turn, min(len(a), len(b))
    return None


@torch.inference_mode()
def top2_margin(model: torch.nn.Module, ids: list[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after `ids` (a fresh forward, no cache)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def greedy_check(model, ours: list[list[int]], reference: list[list[int]], prompts: list[list[int]]) -> dict:
    """Compare a method's greedy tokens with vanilla's; at a mismatch, measure the target's margin there.

    prompts[t] is vanilla's prompt for turn t (identical to the method's while earlier turns agree).
    """
    where = first_divergence(ours, reference)
    if where is None:
        return {"match": True, "turn": None, "position": None, "margin": None, "near_tie": False}
    turn, pos = where
    margin = top2_margin(model, prompts[turn] + reference[turn][:pos])
    dtype = next(model.parameters()).dtype
    return {"match": False, "turn": turn, "position": pos, "margin": margin, "near_tie": margin < NEAR_TIE[dtype]}


@dataclass(frozen=True)
class SamplingTest:
    samples: int
    bins: int
    statistic: float
    p_value: float
    alpha: float
    tv_distance: float  # empirical total variation over the bins (for reading, not for the verdict)

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha


@torch.inference_mode()
def exact_distribution(
    model, prompt: list[int], horizon: int, temperature: float, stop_ids: set[int], min_prob: float
) -> dict[tuple[int, ...], float]:
    """Vanilla sampling's exact probabilities of every continuation of `horizon` tokens (or ending at a stop
    token) whose probability is at least min_prob, found level by level with batched forwards."""
    device = next(model.parameters()).device
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    done: dict[tuple[int, ...], float] = {}
    for _ in range(horizon):
        seqs = list(frontier)
        ids = torch.tensor([prompt + list(s) for s in seqs], device=device)
        probs = probabilities(model(input_ids=ids).logits[:, -1], temperature).cpu().numpy()
        nxt: dict[tuple[int, ...], float] = {}
        for seq, row in zip(seqs, probs, strict=True):
            for token in np.flatnonzero(row * frontier[seq] >= min_prob):
                p = float(row[token]) * frontier[seq]
                (done if int(token) in stop_ids else nxt)[(*seq, int(token))] = p
        frontier = nxt
    return {**done, **frontier}


def sampling_test(
    target: Target,
    proposer: Proposer,
    prompt: list[int],
    *,
    horizon: int,
    samples: int,
    temperature: float,
    stop_ids: set[int],
    alpha: float = 1e-3,
    seed: int = 0,
) -> SamplingTest:
    """Chi-square goodness of fit of the method's first `horizon` sampled tokens against vanilla's exact law.

    Bins are the continuations whose exact probability gives an expected count of at least 5, plus one bin
    for everything else; a lossless method passes at significance `alpha`.
    """
    law = exact_distribution(target.model, prompt, horizon, temperature, stop_ids, min_prob=5.0 / samples)
    keys = sorted(law, key=law.get, reverse=True)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1)
    generator = torch.Generator(target.device).manual_seed(seed)
    for _ in range(samples):
        out = decode(
            target,
            proposer,
            prompt,
            max_new_tokens=horizon,
            temperature=temperature,
            stop_ids=stop_ids,
            generator=generator,
        )
        counts[index.get(tuple(out.tokens), len(keys))] += 1
    expected = np.array([law[k] for k in keys] + [max(0.0, 1.0 - sum(law.values()))]) * samples
    if expected[-1] < 5:  # too small a tail to test on its own: fold it into the last bin
        counts[-2] += counts[-1]
        expected[-2] += expected[-1]
        counts, expected = counts[:-1], expected[:-1]
    expected *= samples / expected.sum()
    statistic, p_value = stats.chisquare(counts, expected)
    tv = 0.5 * float(np.abs(counts - expected).sum()) / samples
    return SamplingTest(samples, len(counts), float(statistic), float(p_value), alpha, tv)
