import math

import pytest

from specbench import metrics
from specbench.results import Answer


def answer(qid, new, wall, steps, accept, tested=None, check=None, method="m"):
    return Answer(
        qid, "c", "c", method, 0.0, "model", "task", new, wall, steps, accept, tested=tested, greedy_check=check
    )


def test_tau_is_tokens_over_steps():
    a = answer(1, [6, 4], [1.0, 1.0], [2, 2], [3, 3, 2, 2])
    b = answer(2, [2], [1.0], [2], [1, 1])
    assert metrics.tau([a, b]) == pytest.approx(12 / 6)


def test_acceptance_by_position_hand_worked():
    # steps: accepted 2 of 3 tested (rejected at depth 3), accepted 0 of 1, accepted 3 of 3 (all accepted)
    a = answer(1, [8], [1.0], [3], [3, 1, 4], tested=[3, 1, 3])
    alpha = metrics.acceptance_by_position([a])
    # depth 1 reached by 3 steps, accepted by 2; depth 2 reached by 2, accepted by 2; depth 3 reached 2, accepted 1
    assert alpha == pytest.approx([2 / 3, 1.0, 0.5])


def test_paired_speedup_constant_ratio_and_pairing():
    base = [answer(q, [10], [1.0 * q], [10], [1] * 10) for q in range(1, 6)]
    fast = [answer(q, [10], [0.5 * q], [5], [2] * 5) for q in range(1, 6)]
    s = metrics.paired_speedup(fast, base)
    assert s.value == pytest.approx(2.0) and s.low == pytest.approx(2.0) and s.high == pytest.approx(2.0)
    assert s.pairs == 5
    assert metrics.paired_speedup(fast[:2], base).pairs == 2


def test_paired_speedup_is_geometric():
    base = [answer(q, [10], [1.0], [10], [1] * 10) for q in (1, 2)]
    new = [answer(1, [10], [0.25], [5], [2] * 5), answer(2, [10], [1.0], [10], [1] * 10)]
    assert metrics.paired_speedup(new, base).value == pytest.approx(2.0)  # sqrt(4 * 1)


def test_spec_bench_speedup_is_ratio_of_means():
    base = [answer(1, [10], [1.0], [10], [1] * 10), answer(2, [30], [1.0], [30], [1] * 30)]  # 10 and 30 tok/s
    new = [answer(1, [10], [0.5], [5], [2] * 5), answer(2, [30], [1.0], [15], [2] * 15)]  # 20 and 30 tok/s
    assert metrics.spec_bench_speedup(new, base) == pytest.approx(25 / 20)


def test_tokens_per_second_pools_turns():
    assert metrics.tokens_per_second([answer(1, [10, 30], [1.0, 3.0], [1, 1], [10, 30])]) == pytest.approx(10.0)


def test_roofline_efficiency():
    # tau 3, T(1) = 10 ms, T(n) = 12 ms, draft 3 ms/step: ideal 3 * 10 / 15 = 2; measured 1.5 -> 75%
    assert metrics.roofline_efficiency(1.5, 3.0, 0.010, 0.012, 0.003) == pytest.approx(0.75)


def test_losslessness_counts():
    checks = [{"match": True}, {"match": False, "near_tie": True}, {"match": False, "near_tie": False}, None]
    result = metrics.losslessness([answer(i, [1], [1.0], [1], [1], check=c) for i, c in enumerate(checks)])
    assert (result.questions, result.exact, result.near_ties, result.bugs) == (3, 1, 1, 1)
    assert math.isclose(result.exact_rate, 1 / 3)


def test_speculation_profile_hand_worked():
    """SPEED-Bench's worked case: lengths 1 x40, 2 x30, 3 x30 with K = 3."""
    from specbench.metrics import speculation_profile

    steps = [1] * 40 + [2] * 30 + [3] * 30
    answers = [Answer(question_id=i, category="c", group="g", method="m", temperature=0.0, model="t", task="q",
                      new_tokens=[sum(part)], wall_time=[1.0], decoding_steps=[len(part)], accept_lengths=part)
               for i, part in enumerate((steps[:50], steps[50:]))]  # fmt: skip
    profile = speculation_profile(answers, 3, "eagle3")
    assert profile["conditional_accept_rates"] == [0.6, 0.5, 0.0]
    assert profile["marginal_accept_rates"] == [0.6, 0.3, 0.0]
    assert profile["mean_accept_length"] == 1.9
    assert profile["acceptance_length_histogram"] == {"1": 40, "2": 30, "3": 30}
    checks = profile["validation"]
    assert checks["mean_consistency"]["passed"] and checks["marginal_monotonicity"]["passed"]
    assert profile["schema_version"] == "1.0" and profile["num_speculative_tokens"] == 3
    # brute force: marginal[i] is the share of steps that accepted the (i+1)-th draft token
    for i, m in enumerate(profile["marginal_accept_rates"]):
        assert m == sum(length >= i + 2 for length in steps) / len(steps)
