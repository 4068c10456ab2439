"""The speedup interval (metrics.ratio_interval) and the pooled category intervals (metrics.pooled_speedups) by
hand and by simulation, and the A/A order-effect tests.

The simulation is the rules' justification: paired log ratios with the noise a timing has (small Gaussian jitter
plus occasional interference that only ever slows a decode down), questions whose true speedups differ, and an
A/A column measured in the same cell. At every n the rule must cover the true speedup in at least 93% of cells;
the percentile bootstrap it replaced does not (about half at n = 2). The pooled intervals must too, in cells whose
categories' true speedups differ, and with the categories' spreads as unequal as in Spec-Bench's own answers."""

from __future__ import annotations

import math
from dataclasses import astuple

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from specbench.report import metrics
from specbench.report.cells import OVERALL, Cell

T_1 = 12.706204736174698  # Student's t, 97.5th percentile, 1 degree of freedom


def test_two_ratios_hand_worked():
    a = math.log(1.1)  # ratios 1.1 and 1.21: logs a and 2a, mean 1.5a, sample sd a / sqrt(2)
    low, high = metrics.ratio_interval(np.array([a, 2 * a]))
    half = T_1 * (a / math.sqrt(2)) / math.sqrt(2)
    assert (low, high) == pytest.approx((math.exp(1.5 * a - half), math.exp(1.5 * a + half)))


def test_agreeing_questions_cannot_claim_less_than_the_noise():
    """The issue's A/A cell: two questions at 1.10 and 1.11. Alone they exclude 1.00; with the cell's A/A noise
    (0.1 in logs) as the spread's floor the interval is as wide as two questions can honestly be."""
    logs = np.log([1.10, 1.11])
    low, high = metrics.ratio_interval(logs)
    assert low > 1.0  # t alone: questions that agree by chance
    low, high = metrics.ratio_interval(logs, noise=0.1)
    mean = logs.mean()
    assert (low, high) == pytest.approx(
        (math.exp(mean - T_1 * 0.1 / math.sqrt(2)), math.exp(mean + T_1 * 0.1 / math.sqrt(2)))
    )
    assert low < 1.0 < high


T_2 = 4.302652729911275  # 97.5th percentile, 2 degrees of freedom


def test_pooled_spread_hand_worked():
    """Three categories: ratios 1.1 and 1.21 (logs a, 2a), 10 and 13.31 (logs c, c + 3a: another speedup, a wider
    spread) and 2.0 alone. Centred on their own means the deviations are ±a/2 and ±1.5a: 5a² over 1 + 1 + 0
    degrees of freedom; the categories' different speedups and the lone question add nothing."""
    a = math.log(1.1)
    ratios = {"x": np.array([1.1, 1.21]), "y": np.array([10.0, 13.31]), "z": np.array([2.0])}
    sd, df = metrics.pooled_spread(np.log(r) for r in ratios.values())
    assert (sd, df) == (pytest.approx(a * math.sqrt(2.5)), 2)
    got = metrics.pooled_speedups(ratios)
    half = T_2 * a * math.sqrt(2.5) / math.sqrt(2)
    assert (got["x"].low, got["x"].high) == pytest.approx((math.exp(1.5 * a - half), math.exp(1.5 * a + half)))
    assert got["y"].value == pytest.approx(10 * 1.1**1.5) and got["y"].high / got["y"].low == pytest.approx(
        math.exp(2 * half)
    )  # the same spread and width as x, whatever its own
    assert got["z"].value == 2.0 and not got["z"].has_interval  # one question: its point, no interval
    floored = metrics.pooled_speedups(ratios, noise=1.0)["x"]  # the A/A floor still holds
    assert floored.high == pytest.approx(math.exp(1.5 * a + T_2 * 1.0 / math.sqrt(2)))
    assert metrics.pooled_spread([np.array([0.1]), np.array([])]) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_a_cells_categories_pool_and_its_overall_does_not():
    """The same ratios as a report's cell (cells.Cell.stats): vanilla 1 s a question, the method faster."""
    seconds = {"mt_bench": [1 / 1.1, 1 / 1.21], "translation": [1 / 10, 1 / 13.31], "qa": [1 / 2]}
    rows = [
        {"method": method, "group": group, "question_id": f"{group}{i}", "turn": 0, "new_tokens": 10.0}
        | {"wall_time": t if method == "sps" else 1.0}
        for method in ("vanilla", "sps")
        for group, times in seconds.items()
        for i, t in enumerate(times)
    ]
    turns = pd.DataFrame(rows)
    cell = Cell(None, "tiny", "quick", 0.0, 1, turns, turns.iloc[:0])  # type: ignore[arg-type]  # no source needed
    got = cell.stats["sps"].paired
    expected = metrics.pooled_speedups({g: 1 / np.array(t) for g, t in seconds.items()})
    expected[OVERALL] = metrics.geometric_mean(1 / np.concatenate(list(seconds.values())))  # its own questions' t
    assert list(got) == list(expected)
    for category, s in got.items():
        assert astuple(s) == pytest.approx(astuple(expected[category]), nan_ok=True)
    for category in ("mt_bench", "translation"):  # alone: one degree of freedom each, t = 12.7 against 4.3
        own = metrics.geometric_mean(1 / np.array(seconds[category]))
        assert got[category].high / got[category].low < own.high / own.low


def test_one_question_has_no_interval():
    s = metrics.geometric_mean([1.5])
    assert s.value == pytest.approx(1.5) and s.pairs == 1 and not s.has_interval
    assert metrics.format_ratio(s.value, s.low, s.high) == "1.50×"
    assert metrics.format_ratio(1.5, 1.2, 1.8) == "1.50× [1.20, 1.80]"
    assert math.isnan(metrics.geometric_mean([]).value)


def test_noise_floor_is_the_rms_of_aa_log_ratios():
    def turns(seconds: list[float]) -> pd.DataFrame:
        return pd.DataFrame({"question_id": range(len(seconds)), "new_tokens": 10, "wall_time": seconds})

    base, aa = turns([1.0, 1.0, 1.0]), turns([1.0 / 1.1, 1.0 / 0.9, 1.0])  # A/A ratios 1.1, 0.9, 1.0
    expected = math.sqrt((math.log(1.1) ** 2 + math.log(0.9) ** 2) / 3)
    assert metrics.noise_floor(aa, base) == pytest.approx(expected)
    assert metrics.noise_floor(aa[:1], base) == 0.0  # one pair measures nothing


# ---------------------------------------------------------------- coverage by simulation

CELLS = 1500  # simulated cells per n: a coverage estimate's standard error is about 0.006
CATEGORIES = 6  # the floor comes from the A/A column of the whole cell, as in a report
MU = math.log(1.4)  # the method's true speedup over the population of questions


def timing_noise(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """log(measured / true time) of a decode: Gaussian jitter, and one decode in six slowed by interference."""
    return rng.normal(0, 0.03, shape) + (rng.random(shape) < 1 / 6) * rng.exponential(0.15, shape)


def simulated_cells(
    rng: np.random.Generator, n: int, spread: float | np.ndarray, truth: float | np.ndarray = MU, cells: int = CELLS
) -> tuple[np.ndarray, np.ndarray]:
    """[cells, categories, n] paired log ratios of a method (true per-question speedups spread around `truth`) and
    of the A/A column (true ratio 1), each question's vanilla timing shared by both; `spread` and `truth` one for
    every category or [categories]."""
    shape = (cells, CATEGORIES, n)
    vanilla = timing_noise(rng, shape)
    per_category = (-1, 1)
    method = (
        np.reshape(truth, per_category)
        + rng.normal(0, np.reshape(spread, per_category), shape)
        - timing_noise(rng, shape)
        + vanilla
    )
    aa = vanilla - timing_noise(rng, shape)
    return method, aa


def covered(logs: np.ndarray, noise: np.ndarray, truth: float) -> float:
    """Share of [cells, categories] intervals (the rule, each cell's floor `noise`) that contain `truth`."""
    hits = [metrics.ratio_interval(logs[c, k], noise[c]) for c in range(logs.shape[0]) for k in range(CATEGORIES)]
    return float(np.mean([low <= math.exp(truth) <= high for low, high in hits]))


def bootstrap_covered(rng: np.random.Generator, logs: np.ndarray, truth: float, resamples: int = 400) -> float:
    """The old rule: 95% percentile bootstrap of the mean log ratio over the questions."""
    flat = logs.reshape(-1, logs.shape[-1])
    n = flat.shape[1]
    picks = rng.integers(0, n, size=(flat.shape[0], resamples, n))
    means = np.take_along_axis(flat[:, None, :].repeat(resamples, 1), picks, axis=2).mean(axis=2)
    low, high = np.percentile(means, [2.5, 97.5], axis=1)
    return float(np.mean((low <= truth) & (truth <= high)))


@pytest.mark.parametrize("n", [2, 3, 5, 10, 30])
@pytest.mark.parametrize("spread", [0.0, 0.2])
def test_the_rule_covers_at_every_n_and_the_bootstrap_did_not(n, spread):
    rng = np.random.default_rng(1000 * n + int(10 * spread))
    method, aa = simulated_cells(rng, n, spread)
    noise = cell_noise(aa)
    assert covered(method, noise, MU) >= 0.93
    assert covered(aa, noise, 0.0) >= 0.93
    if n <= 5:
        assert bootstrap_covered(rng, method, MU) < 0.90 and bootstrap_covered(rng, aa, 0.0) < 0.90


DIFFERING = MU + np.linspace(-0.5, 0.5, CATEGORIES)  # categories' true speedups from 0.85× to 2.3×
# EAGLE on Vicuna-7B in Spec-Bench's own answers (tests/data/spec_bench_model_answers, 80 questions a category): each
# category's paired speedup and the sd of its questions' log ratios, timing included: the spreads differ too
SPEC_BENCH_SPEEDUPS = np.log([2.53, 1.79, 2.17, 2.00, 2.57, 1.81])
SPEC_BENCH_SPREADS = np.array([0.180, 0.145, 0.111, 0.179, 0.129, 0.200])
POOLED_CELLS = 800  # a coverage's standard error about 0.003, a single category's 0.008


def pooled_covered(logs: np.ndarray, noise: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """[categories]: the share of cells whose pooled interval of a category (metrics.pooled_speedups over the
    cell's categories, floored by the cell's `noise`) contains that category's true speedup `truth`."""
    hits = np.zeros(logs.shape[:2], dtype=bool)
    for c, cell in enumerate(np.exp(logs)):
        pooled = metrics.pooled_speedups({str(k): ratios for k, ratios in enumerate(cell)}, noise[c])
        hits[c] = [pooled[str(k)].low <= math.exp(truth[k]) <= pooled[str(k)].high for k in range(CATEGORIES)]
    return hits.mean(axis=0)


def cell_noise(aa: np.ndarray) -> np.ndarray:
    """metrics.noise_floor over each simulated cell's A/A column."""
    return np.sqrt(np.mean(aa.reshape(aa.shape[0], -1) ** 2, axis=1))


@pytest.mark.parametrize("n", [2, 3, 5, 10, 30])
def test_pooled_intervals_cover_when_the_categories_differ(n):
    """Categories' true speedups far apart: the pooled spread leaves them out, each category centred on its own
    mean. With spreads as unequal as Spec-Bench's, the widest category is covered a little less (90-92%)."""
    rng = np.random.default_rng(n)
    method, aa = simulated_cells(rng, n, 0.2, DIFFERING, POOLED_CELLS)
    assert pooled_covered(method, cell_noise(aa), DIFFERING).mean() >= 0.93
    assert pooled_covered(aa, cell_noise(aa), np.zeros(CATEGORIES)).mean() >= 0.93
    method, aa = simulated_cells(rng, n, SPEC_BENCH_SPREADS, SPEC_BENCH_SPEEDUPS, POOLED_CELLS)
    coverage = pooled_covered(method, cell_noise(aa), SPEC_BENCH_SPEEDUPS)
    assert coverage.mean() >= 0.93 and coverage.min() >= 0.88


# ---------------------------------------------------------------- order effects in the A/A column


@pytest.mark.parametrize("seed", range(4))
def test_spearman_and_welch_match_scipy(seed):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=11), rng.normal(size=11)
    y[3] = y[4]  # a tie
    assert metrics.spearman_p(x, 0.5 * x + y) == pytest.approx(stats.spearmanr(x, 0.5 * x + y).pvalue, rel=1e-9)
    a, b = x[:4], y + 0.3
    assert metrics.welch_p(a, b) == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
    assert math.isnan(metrics.welch_p(a[:1], b)) and math.isnan(metrics.spearman_p(x, np.ones(11)))


def aa_cell(ratios: list[float], positions: list[int], aa_after: list[bool]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(A/A turns, vanilla turns), one turn per question: vanilla 10 tokens in 1 s, the A/A at `ratios` of that."""
    n = len(ratios)
    base = pd.DataFrame(
        {
            "question_id": range(n),
            "turn": 0,
            "new_tokens": 10,
            "wall_time": 1.0,
            "position": positions,
            "order": [0 if after else 1 for after in aa_after],
        }
    )
    aa = base.assign(wall_time=[1.0 / r for r in ratios], order=[1 if after else 0 for after in aa_after])
    return aa, base


def test_order_effect_flags_drift_and_first_timing():
    rng = np.random.default_rng(0)
    n = 24
    noise = np.exp(rng.normal(0, 0.02, n))
    after = [i % 2 == 0 for i in range(n)]
    steady = metrics.order_effect(*aa_cell(list(noise), list(range(n)), after))
    assert steady.pairs == n and not steady.flagged
    drifting = metrics.order_effect(*aa_cell(list(noise * np.linspace(0.9, 1.1, n)), list(range(n)), after))
    assert drifting.flagged and drifting.drift_p < metrics.ORDER_ALPHA
    warm = [r * (1.08 if a else 1.0) for r, a in zip(noise, after, strict=True)]  # the second timing is faster
    first = metrics.order_effect(*aa_cell(warm, list(range(n)), after))
    assert first.flagged and first.first_p < metrics.ORDER_ALPHA and first.first_shift == pytest.approx(1.08, abs=0.02)


def test_order_effect_needs_recorded_order_and_six_pairs():
    aa, base = aa_cell([1.0, 1.1, 0.9, 1.0, 1.2], list(range(5)), [True, False] * 2 + [True])
    assert metrics.order_effect(aa, base).pairs == 5 and not metrics.order_effect(aa, base).flagged
    aa, base = aa_cell([1.0] * 8, list(range(8)), [True] * 8)
    unrecorded = metrics.order_effect(aa.assign(position=None, order=None), base.assign(position=None, order=None))
    assert unrecorded.pairs == 0 and not unrecorded.flagged  # runs written before order was recorded
