import math
import random

import pandas as pd
import pytest

from specbench.report import metrics


def turns(*rows: tuple, **columns) -> pd.DataFrame:
    """Turn rows, one (question_id, new_tokens, wall_time, steps) per turn, plus constant or per-row columns."""
    return pd.DataFrame(rows, columns=["question_id", "new_tokens", "wall_time", "steps"]).assign(**columns)


def steps(accepted: list[int], tested: list | None = None, question_id=1, group: str = "c") -> pd.DataFrame:
    """Step rows of one question."""
    return pd.DataFrame(
        {
            "question_id": question_id,
            "group": group,
            "accepted": accepted,
            "tested": tested if tested is not None else [None] * len(accepted),
        }
    )


def test_tau_is_tokens_over_steps():
    assert metrics.tau(turns((1, 6, 1.0, 2), (1, 4, 1.0, 2), (2, 2, 1.0, 2))) == pytest.approx(12 / 6)


def test_acceptance_by_position_hand_worked():
    # steps: accepted 2 of 3 tested (rejected at depth 3), accepted 0 of 1, accepted 3 of 3 (all accepted)
    alpha = metrics.acceptance_by_position(steps([3, 1, 4], tested=[3, 1, 3]))
    # depth 1 reached by 3 steps, accepted by 2; depth 2 reached by 2, accepted by 2; depth 3 reached 2, accepted 1
    assert alpha == pytest.approx([2 / 3, 1.0, 0.5])
    assert metrics.acceptance_by_position(steps([3, 1, 4])) == []  # depth not recorded (Spec-Bench's files)


def brute_force_alpha(rows: list[tuple[int, int | None]], max_depth: int | None) -> list[float]:
    """Plain Python over (accepted, tested) steps: alpha_k = accepted >= k draft tokens among tested >= k."""
    recorded = [(accepted - 1, tested) for accepted, tested in rows if tested is not None]
    if not recorded:
        return []
    out = []
    for k in range(1, (max(t for _, t in recorded) if max_depth is None else max_depth) + 1):
        reached = [a for a, t in recorded if t >= k]
        out.append(sum(a >= k for a in reached) / len(reached) if reached else math.nan)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_acceptance_by_position_matches_brute_force(seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(1, 30)):
        tested = rng.choice([None, *range(6)]) if seed % 2 else rng.randint(0, 5)
        rows.append((rng.randint(1, (tested or 0) + 1), tested))
    data = steps([a for a, _ in rows], [t for _, t in rows])
    for depth in (None, 3, 7):
        got, expected = metrics.acceptance_by_position(data, depth), brute_force_alpha(rows, depth)
        assert len(got) == len(expected)
        assert all(g == e or (math.isnan(g) and math.isnan(e)) for g, e in zip(got, expected, strict=True))


def test_paired_speedup_constant_ratio_and_pairing():
    base = turns(*((q, 10, 1.0 * q, 10) for q in range(1, 6)))
    fast = turns(*((q, 10, 0.5 * q, 5) for q in range(1, 6)))
    s = metrics.paired_speedup(fast, base)
    assert s.value == pytest.approx(2.0) and s.low == pytest.approx(2.0) and s.high == pytest.approx(2.0)
    assert s.pairs == 5
    assert metrics.paired_speedup(fast[:2], base).pairs == 2


def test_paired_speedup_is_geometric():
    base = turns((1, 10, 1.0, 10), (2, 10, 1.0, 10))
    new = turns((1, 10, 0.25, 5), (2, 10, 1.0, 10))
    assert metrics.paired_speedup(new, base).value == pytest.approx(2.0)  # sqrt(4 * 1)


@pytest.mark.parametrize("seed", range(8))
def test_paired_speedup_matches_brute_force(seed):
    """Random questions of 1-3 turns, in shuffled order, some missing from the baseline: the pairs and every
    number equal a plain-Python computation."""
    rng = random.Random(seed)

    def run(questions: list[int]) -> list[tuple]:
        rows = [(q, rng.randint(1, 50), rng.uniform(0.1, 2.0), 1) for q in questions for _ in range(rng.randint(1, 3))]
        rng.shuffle(rows)
        return rows

    method = run(rng.sample(range(12), rng.randint(1, 12)))
    baseline = run(rng.sample(range(12), rng.randint(1, 12)))

    def throughput(rows: list[tuple]) -> dict:
        tokens, seconds = {}, {}
        for q, new, wall, _ in rows:  # dicts keep first-appearance order
            tokens[q], seconds[q] = tokens.get(q, 0) + new, seconds.get(q, 0.0) + wall
        return {q: tokens[q] / seconds[q] for q in tokens}

    mine, base = throughput(method), throughput(baseline)
    ratios = [mine[q] / base[q] for q in mine if q in base]
    got = metrics.paired_speedup(turns(*method), turns(*baseline))
    expected = metrics.geometric_mean(ratios)
    assert got.pairs == expected.pairs == len(ratios)
    if ratios:
        assert got.value == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)))
        assert (got.value, got.low, got.high) == pytest.approx(
            (expected.value, expected.low, expected.high), nan_ok=True
        )  # one pair: no interval
    else:
        assert math.isnan(got.value)


def test_spec_bench_speedup_is_ratio_of_means():
    base = turns((1, 10, 1.0, 10), (2, 30, 1.0, 30))  # 10 and 30 tok/s
    new = turns((1, 10, 0.5, 5), (2, 30, 1.0, 15))  # 20 and 30 tok/s
    assert metrics.spec_bench_speedup(new, base) == pytest.approx(25 / 20)
    assert math.isnan(metrics.spec_bench_speedup(new, base[:0]))


def test_tokens_per_second_pools_turns():
    assert metrics.tokens_per_second(turns((1, 10, 1.0, 1), (1, 30, 3.0, 1))) == pytest.approx(10.0)


def test_roofline_efficiency():
    # tau 3, T(1) = 10 ms, T(n) = 12 ms, draft 3 ms/step: ideal 3 * 10 / 15 = 2; measured 1.5 -> 75%
    assert metrics.roofline_efficiency(1.5, 3.0, 0.010, 0.012, 0.003) == pytest.approx(0.75)


def test_losslessness_counts():
    # the last question's check is on its turn-0 row; its turn 1 row leaves it missing, and the one before it has none
    rows = turns(
        *((q, 1, 1.0, 1) for q in (0, 1, 2, 3, 3, 4)),
        greedy_match=[True, False, False, False, None, None],
        greedy_near_tie=[None, True, False, True, None, None],
    )
    result = metrics.losslessness(rows)
    assert (result.questions, result.exact, result.near_ties, result.bugs) == (4, 1, 2, 1)
    assert math.isclose(result.exact_rate, 1 / 4)


def test_speculation_profile_hand_worked():
    """SPEED-Bench's worked case: lengths 1 x40, 2 x30, 3 x30 with K = 3."""
    lengths = [1] * 40 + [2] * 30 + [3] * 30
    data = pd.concat([steps(lengths[:50], question_id=0, group="g"), steps(lengths[50:], question_id=1, group="h")])
    profile = metrics.speculation_profile(data, 3, "eagle3")
    assert profile["conditional_accept_rates"] == [0.6, 0.5, 0.0]
    assert profile["marginal_accept_rates"] == [0.6, 0.3, 0.0]
    assert profile["mean_accept_length"] == 1.9
    assert profile["mean_accept_length_per_request"] == (1.2 + 2.6) / 2  # per question: 60 / 50 and 130 / 50
    assert profile["per_category"] == {"g": 1.2, "h": 2.6}
    assert profile["acceptance_length_histogram"] == {"1": 40, "2": 30, "3": 30}
    checks = profile["validation"]
    assert checks["mean_consistency"]["passed"] and checks["marginal_monotonicity"]["passed"]
    assert profile["schema_version"] == "1.0" and profile["num_speculative_tokens"] == 3
    # brute force: marginal[i] is the share of steps that accepted the (i+1)-th draft token
    for i, m in enumerate(profile["marginal_accept_rates"]):
        assert m == sum(length >= i + 2 for length in lengths) / len(lengths)
    clipped = metrics.speculation_profile(data, 1, "eagle3")  # longer steps counted at k + 1 = 2
    assert clipped["acceptance_length_histogram"] == {"1": 40, "2": 60} and clipped["mean_accept_length"] == 1.6
    empty = metrics.speculation_profile(data[:0], 2, "eagle3")
    assert not empty["measured"] and empty["mean_accept_length"] is None and empty["per_category"] is None
