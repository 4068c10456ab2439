"""Losslessness maths: greedy token-by-token agreement with vanilla, and a goodness-of-fit test for sampling
(`specbench verify` runs them: audit.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from ..errors import SpecbenchError
from . import acceptance
from .cached_lm import CachedLM
from .decode import decode
from .proposer import Proposer
from .sampling import probabilities
from .tree import trie

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


def exact_distribution(
    target: CachedLM, prompt: list[int], horizon: int, temperature: float, stop_ids: set[int], min_prob: float
) -> dict[tuple[int, ...], float]:
    """Vanilla sampling's exact probabilities of every continuation of `horizon` tokens (or ending at a stop
    token) whose probability is at least min_prob. Level by level, all open prefixes form one token tree
    verified in a single forward over the cached prompt."""
    target.prefill(prompt)
    past = target.cached
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    done: dict[tuple[int, ...], float] = {}
    for _ in range(horizon):
        tree = trie([list(seq) for seq in frontier])
        prefixes: list[tuple[int, ...]] = []  # each node's token sequence from the root
        for token, parent in zip(tree.tokens, tree.parents, strict=True):
            prefixes.append((*(prefixes[parent] if parent >= 0 else ()), token))
        node = {(): 0, **{seq: i + 1 for i, seq in enumerate(prefixes)}}  # prefix -> input row ([root] + tree)
        logits = target.forward([prompt[-1], *tree.tokens], tree)
        target.crop(past)
        rows = [node[seq] for seq in frontier]
        probs = probabilities(logits[rows], temperature).cpu().numpy()
        nxt: dict[tuple[int, ...], float] = {}
        for seq, row in zip(frontier, probs, strict=True):
            for token in np.flatnonzero(row * frontier[seq] >= min_prob):
                p = float(row[token]) * frontier[seq]
                (done if int(token) in stop_ids else nxt)[(*seq, int(token))] = p
        frontier = nxt
    return {**done, **frontier}


def _bins(law: dict[tuple[int, ...], float], samples: int) -> tuple[dict[tuple[int, ...], int], list[float]]:
    """Group continuations, most probable first, into bins of expected count >= 5; one more bin (index len)
    holds every continuation that was not enumerated. Returns the bin of each continuation and bin masses."""
    of: dict[tuple[int, ...], int] = {}
    masses: list[float] = []
    open_mass = 0.0
    for key in sorted(law, key=law.get, reverse=True):
        of[key] = len(masses)
        open_mass += law[key]
        if open_mass * samples >= 5:
            masses.append(open_mass)
            open_mass = 0.0
    if open_mass and masses:  # a short last group joins the one before it
        masses[-1] += open_mass
        of = {k: min(b, len(masses) - 1) for k, b in of.items()}
    elif open_mass:
        masses.append(open_mass)
    masses.append(max(0.0, 1.0 - sum(law.values())))
    return of, masses


def sampling_test(
    target: CachedLM,
    proposer: Proposer,
    prompt: list[int],
    *,
    horizon: int,
    samples: int,
    temperature: float,
    stop_ids: set[int],
    alpha: float = 1e-3,
    seed: int = 0,
    rule: acceptance.Rule = acceptance.EXACT,
) -> SamplingTest:
    """Chi-square goodness of fit of the method's first `horizon` sampled tokens against vanilla's exact law.

    Continuations of probability >= 1/samples are enumerated exactly and grouped into bins of expected
    count >= 5 (most probable first); the rest forms one more bin. A lossless method passes at `alpha`.
    """
    law = exact_distribution(target, prompt, horizon, temperature, stop_ids, min_prob=1.0 / samples)
    of, masses = _bins(law, samples)
    expected = np.array(masses) * samples
    if expected[-1] < 5:  # too small a tail to test on its own: fold it into the last bin
        expected[-2] += expected[-1]
        expected = expected[:-1]
    if len(expected) < 2:
        raise SpecbenchError(
            f"the sampled distribution is too flat to test with {samples} samples: raise --samples or lower "
            "--temperature"
        )
    counts = np.zeros(len(expected))
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
            rule=rule,
        )
        counts[min(of.get(tuple(out.tokens), len(masses) - 1), len(expected) - 1)] += 1
    expected *= samples / expected.sum()
    statistic, p_value = stats.chisquare(counts, expected)
    tv = 0.5 * float(np.abs(counts - expected).sum()) / samples
    return SamplingTest(samples, len(counts), float(statistic), float(p_value), alpha, tv)
