"""Losslessness maths: greedy token-by-token agreement with vanilla, and a goodness-of-fit test for sampling
(`specbench verify` runs them: audit.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from ..errors import SpecbenchError
from ..progress import Progress
from . import acceptance
from .cached_lm import CachedLM, margins
from .decode import Job, decode, decode_batch
from .one_slot import Target, single
from .proposer import Drafter, Proposer
from .sampling import probabilities
from .static_lm import BatchedLM, Row
from .tree import trie


def first_divergence(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, int] | None:
    """(turn, position) of the first token that differs, or None when every turn is identical."""
    for turn, (a, b) in enumerate(zip(ours, reference, strict=False)):
        for pos, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return turn, pos
        if len(a) != len(b):
            return turn, min(len(a), len(b))
    return None


SPREAD_ROWS = 8  # rows of the multi-row forward that measures the target's rounding spread


@torch.inference_mode()
def two_ways(model: torch.nn.Module, ids: list[int], rows: int = SPREAD_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits [V] for the token after `ids`, computed as vanilla computes it (the cache of all but the
    last token, then a one-token forward) and as the last row of a `rows`-token forward on a shorter cache: the same
    value two ways, which differ only by rounding."""
    lm = CachedLM(model)
    lm.prefill(ids)
    one = lm.forward([ids[-1]])[-1].float()
    rows = max(1, min(rows, len(ids) - 1))
    lm.prefill(ids[: len(ids) - rows + 1])
    many = lm.forward(ids[-rows:])[-1].float()
    lm.reset()
    return one, many


def classify(
    ours: int, method_top1: int | None, vanilla_margin: float, method_margin: float | None, spread: float
) -> str:
    """A greedy mismatch's verdict: "bug" when the method emitted a token its own target forward did not pick, or
    when the two computations' margins are wider than rounding moves them; else "numerical".

    At the divergence vanilla's one-token step ranks vanilla's token first by `vanilla_margin` and the method's
    verification row ranks the method's token first by `method_margin`: for the target to flip, the difference of
    those two logits moved by their sum. `spread` is the largest change of any logit measured between a one-row
    and a multi-row computation of that very position (`two_ways`), so a difference of two logits moves by up to
    2 x spread; the method's own forward (other rows, a tree mask) is allowed twice that. Without the method's
    margin (an engine's answers), vanilla's alone is judged.
    """
    if method_top1 is not None and method_top1 != ours:
        return "bug"
    return "numerical" if vanilla_margin + (method_margin or 0.0) <= 4 * spread else "bug"


def _at(per_turn: list[list] | None, turn: int, pos: int):
    """A recorded per-token value, or None where it was not recorded."""
    row = per_turn[turn] if per_turn is not None and turn < len(per_turn) else None
    return row[pos] if row is not None and pos < len(row) else None


def greedy_check(
    model,
    ours: list[list[int]],
    reference: list[list[int]],
    prompts: list[list[int]],
    ours_top1: list[list[int]] | None = None,
    ours_margin: list[list[float]] | None = None,
    reference_margin: list[list[float]] | None = None,
) -> dict:
    """Compare a method's greedy tokens with vanilla's; at a mismatch, measure the target there both ways and
    classify it (`classify`).

    prompts[t] is vanilla's prompt for turn t (identical to the method's while earlier turns agree); ours_top1 /
    ours_margin (per turn, per token) are the target's picks inside the method's verification forwards and
    reference_margin vanilla's in its one-token steps (core.decode.Generation), where the run kept them; vanilla's
    margin is otherwise recomputed as a one-token step.
    """
    where = first_divergence(ours, reference)
    if where is None:
        return {"match": True, "turn": None, "position": None, "margin": None, "near_tie": False}
    turn, pos = where
    one, many = two_ways(model, prompts[turn] + reference[turn][:pos])
    spread = float((one - many).abs().max())
    vanilla_margin = _at(reference_margin, turn, pos)
    vanilla_margin = float(margins(one[None])[0]) if vanilla_margin is None else vanilla_margin
    method_top1, method_margin = _at(ours_top1, turn, pos), _at(ours_margin, turn, pos)
    if pos >= len(ours[turn]) or pos >= len(reference[turn]):  # one stopped where the other went on
        verdict = "bug"
    else:
        verdict = classify(ours[turn][pos], method_top1, vanilla_margin, method_margin, spread)
    return {
        "match": False,
        "turn": turn,
        "position": pos,
        "margin": vanilla_margin,  # vanilla's top-1/top-2 margin, in its one-token step
        "method_margin": method_margin,  # the method's, in its verification row (None: not recorded)
        "method_top1": method_top1,
        "spread": spread,  # largest logit change between a one-row and a multi-row computation there
        "verdict": verdict,
        "near_tie": verdict == "numerical",  # the report's "numerical divergence" column
    }


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
    target: Target, prompt: list[int], horizon: int, temperature: float, stop_ids: set[int], min_prob: float
) -> dict[tuple[int, ...], float]:
    """Vanilla sampling's exact probabilities of every continuation of `horizon` tokens (or ending at a stop
    token) whose probability is at least min_prob. Level by level, all open prefixes form one token tree
    verified in a single forward over the cached prompt (in `target`'s slot 0)."""
    target.prefill([0], [prompt])
    past = target.lengths[0]
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    done: dict[tuple[int, ...], float] = {}
    for _ in range(horizon):
        tree = trie([list(seq) for seq in frontier])
        prefixes: list[tuple[int, ...]] = []  # each node's token sequence from the root
        for token, parent in zip(tree.tokens, tree.parents, strict=True):
            prefixes.append((*(prefixes[parent] if parent >= 0 else ()), token))
        node = {(): 0, **{seq: i + 1 for i, seq in enumerate(prefixes)}}  # prefix -> input row ([root] + tree)
        (out,) = target.run([Row(0, [prompt[-1], *tree.tokens], tree)])
        target.rewind(0, past)
        logits = out.logits
        rows = [node[seq] for seq in frontier]
        probs = probabilities(logits[rows], temperature).cpu().numpy()
        nxt: dict[tuple[int, ...], float] = {}
        for seq, row in zip(frontier, probs, strict=True):
            for token in np.flatnonzero(row * frontier[seq] >= min_prob).tolist():
                p = float(row[token]) * frontier[seq]
                (done if token in stop_ids else nxt)[(*seq, token)] = p
        frontier = nxt
    return {**done, **frontier}


def _bins(law: dict[tuple[int, ...], float], samples: int) -> tuple[dict[tuple[int, ...], int], list[float]]:
    """Group continuations, most probable first, into bins of expected count >= 5; one more bin (index len)
    holds every continuation that was not enumerated. Returns the bin of each continuation and bin masses."""
    of: dict[tuple[int, ...], int] = {}
    masses: list[float] = []
    open_mass = 0.0
    for key in sorted(law, key=law.__getitem__, reverse=True):
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
    target: CachedLM | Target,
    proposer: Proposer | Drafter,
    prompt: list[int],
    *,
    horizon: int,
    samples: int,
    temperature: float,
    stop_ids: set[int],
    alpha: float = 1e-3,
    seed: int = 0,
    rule: acceptance.Rule = acceptance.EXACT,
    batch: tuple[BatchedLM, Drafter | list[Proposer]] | None = None,
) -> SamplingTest:
    """Chi-square goodness of fit of the method's first `horizon` sampled tokens against vanilla's exact law; with
    `batch` (a target of B slots and the method's drafting for them) the samples are drawn B at a time.

    Continuations of probability >= 1/samples are enumerated exactly and grouped into bins of expected
    count >= 5 (most probable first); the rest forms one more bin. A lossless method passes at `alpha`.
    """
    target = single(target)
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
    bar = Progress(samples, "sampling audit", "samples")

    def count(tokens: list[int]) -> None:
        bar.update()
        counts[min(of.get(tuple(tokens), len(masses) - 1), len(expected) - 1)] += 1

    if batch is not None:  # every sample a turn of its own, `batch` at a time, one random stream for them all
        lm, proposers = batch
        jobs = [Job(prompt, horizon, temperature, generator) for _ in range(samples)]
        decode_batch(
            lm,
            proposers,
            lambda: jobs.pop() if jobs else None,
            lambda _, gen: count(gen.tokens),
            stop_ids=stop_ids,
            rule=rule,
        )
    for _ in range(samples if batch is None else 0):
        out = decode(
            target,
            proposer,
            prompt,
            max_new_tokens=horizon,
            temperature=temperature,
            stop_ids=stop_ids,
            generator=generator,
            rule=rule,
            reuse_prefill=True,  # the prompt's cache rows are computed once, not per sample
        )
        count(out.tokens)
    bar.close()
    expected *= samples / expected.sum()
    statistic, p_value = stats.chisquare(counts, expected)
    tv = 0.5 * float(np.abs(counts - expected).sum()) / samples
    return SamplingTest(samples, len(counts), float(statistic), float(p_value), alpha, tv)
