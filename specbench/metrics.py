"""Every number of docs/metrics.md, defined once. Inputs are lists of `results.Answer`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .results import Answer


def tau(answers: list[Answer]) -> float:
    """Mean accepted length: total new tokens / total decoding steps (the target's own token counted)."""
    steps = sum(sum(a.decoding_steps) for a in answers)
    return sum(sum(a.new_tokens) for a in answers) / steps if steps else float("nan")


def acceptance_by_position(answers: list[Answer], max_depth: int | None = None) -> list[float]:
    """alpha_k for k = 1..: among steps that examined draft depth k, the share that accepted the k-th token."""
    tested: list[int] = []
    accepted: list[int] = []
    for a in answers:
        if a.tested is None:
            continue
        tested.extend(a.tested)
        accepted.extend(n - 1 for n in a.accept_lengths)
    if not tested:
        return []
    tested_arr, accepted_arr = np.asarray(tested), np.asarray(accepted)
    depth = int(tested_arr.max()) if max_depth is None else max_depth
    out = []
    for k in range(1, depth + 1):
        reached = tested_arr >= k
        out.append(float((accepted_arr[reached] >= k).mean()) if reached.any() else float("nan"))
    return out


def question_throughput(answer: Answer) -> float:
    """Tokens/s of one question: its new tokens over its wall time, all turns."""
    return sum(answer.new_tokens) / sum(answer.wall_time)


def tokens_per_second(answers: list[Answer]) -> float:
    return sum(sum(a.new_tokens) for a in answers) / sum(sum(a.wall_time) for a in answers)


@dataclass(frozen=True)
class Speedup:
    value: float
    low: float  # 95% bootstrap interval over questions
    high: float
    pairs: int


def geometric_mean(ratios: list[float], n_boot: int = 2000, seed: int = 0) -> Speedup:
    """Geometric mean of paired ratios, with a 95% percentile-bootstrap interval over the pairs."""
    logs = np.log(np.asarray(ratios, dtype=float))
    if logs.size == 0:
        return Speedup(float("nan"), float("nan"), float("nan"), 0)
    rng = np.random.default_rng(seed)
    boot = logs[rng.integers(0, logs.size, size=(n_boot, logs.size))].mean(axis=1)
    low, high = np.exp(np.percentile(boot, [2.5, 97.5]))
    return Speedup(float(np.exp(logs.mean())), float(low), float(high), int(logs.size))


def paired_speedup(method: list[Answer], baseline: list[Answer], n_boot: int = 2000, seed: int = 0) -> Speedup:
    """Geometric mean over questions of tokens/s(method) / tokens/s(baseline), paired by question id."""
    base = {a.question_id: question_throughput(a) for a in baseline}
    ratios = [question_throughput(a) / base[a.question_id] for a in method if a.question_id in base]
    return geometric_mean(ratios, n_boot, seed)


def spec_bench_speedup(method: list[Answer], baseline: list[Answer]) -> float:
    """Spec-Bench's definition: mean per-question tokens/s of the method / that of the baseline (unpaired)."""
    if not method or not baseline:
        return float("nan")
    return float(
        np.mean([question_throughput(a) for a in method]) / np.mean([question_throughput(a) for a in baseline])
    )


def roofline_efficiency(speedup: float, tau_value: float, t1: float, tn: float, draft: float) -> float:
    """Measured speedup / the overhead-free speedup tau * T(1) / (T(n) + D) at the same tau."""
    return speedup / (tau_value * t1 / (tn + draft))


@dataclass(frozen=True)
class Losslessness:
    questions: int
    exact: int
    near_ties: int  # first divergence where the target's top-1/top-2 margin is below the threshold
    bugs: int  # first divergence with a clear margin

    @property
    def exact_rate(self) -> float:
        return self.exact / self.questions if self.questions else float("nan")


def losslessness(answers: list[Answer]) -> Losslessness:
    """Greedy token-by-token agreement with vanilla, from each answer's recorded greedy_check."""
    checked = [a.greedy_check for a in answers if a.greedy_check is not None]
    exact = sum(1 for c in checked if c["match"])
    ties = sum(1 for c in checked if not c["match"] and c["near_tie"])
    return Losslessness(len(checked), exact, ties, len(checked) - exact - ties)


PROFILE_SCHEMA = "1.0"  # NVIDIA SPEED-Bench specdec_bench's speculation_profile.json schema_version


def speculation_profile(answers: list[Answer], k: int, method: str) -> dict:
    """The cell's acceptance profile in the layout of SPEED-Bench's `speculation_profile.json` (NVIDIA
    Model-Optimizer `examples/specdec_bench`), so engine runs measured there compare with ours.

    L = tokens a step appended (the target's own included: L = 1 accepted no draft). Position i (0-based) is the
    (i+1)-th draft token: marginal[i] = P(L >= i + 2) over steps, conditional[i] = marginal[i] / marginal[i-1]
    (0 after a 0). `k` is the deepest draft position reported (longer L are counted at k + 1).
    """
    lengths = [min(length, k + 1) for a in answers for length in a.accept_lengths]
    n = len(lengths)
    at_least = [sum(length >= i + 2 for length in lengths) / n if n else 0.0 for i in range(k)]
    conditional = [(m / prev if prev else 0.0) for m, prev in zip(at_least, [1.0, *at_least[:-1]], strict=True)]
    histogram = {length: lengths.count(length) for length in sorted(set(lengths))}
    mean = sum(lengths) / n if n else float("nan")
    per_request = [sum(a.accept_lengths) / len(a.accept_lengths) for a in answers if a.accept_lengths]
    groups = sorted({a.group for a in answers})
    by_group = {g: [sum(a.accept_lengths) / len(a.accept_lengths) for a in answers if a.group == g and a.accept_lengths]
                for g in groups}  # fmt: skip
    implied = 1 + sum(at_least)
    drops = [{"position": i, "value": m, "previous": at_least[i - 1]}
             for i, m in enumerate(at_least) if i and m > at_least[i - 1] + 1e-9]  # fmt: skip
    return {
        "schema_version": PROFILE_SCHEMA,
        "measured": n > 0,
        "method": method,
        "num_speculative_tokens": k,
        "block_size": None,
        "max_supported_k": k,
        "verification_method": "longest_prefix",
        "conditional_accept_rates": [round(x, 6) for x in conditional],
        "marginal_accept_rates": [round(x, 6) for x in at_least],
        "mean_accept_length": round(mean, 6) if n else None,
        "mean_accept_length_per_request": round(sum(per_request) / len(per_request), 6) if per_request else None,
        "accept_length_model": "measured_per_k",
        "accept_length_by_k": {str(k): round(mean, 6)} if n else {},
        "acceptance_length_histogram": {str(length): c for length, c in histogram.items()},
        "per_category": {g: round(sum(v) / len(v), 6) for g, v in by_group.items() if v} or None,
        "validation": {
            "mean_consistency": {
                "implied_mean_accept_length": round(implied, 6),
                "reported_mean_accept_length": round(mean, 6) if n else None,
                "abs_delta": round(abs(implied - mean), 6) if n else None,
                "tolerance": 0.02,
                "passed": bool(n) and abs(implied - mean) <= 0.02,
            },
            "marginal_monotonicity": {"passed": not drops, "violations": drops},
        },
    }


BUSY_SHARE = 0.25  # other processes using more than this share of the CPUs make a timing untrustworthy


def format_ratio(
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    digits: int = 2,
    times: str = "×",
    interval: str = " [{}, {}]",
) -> str:
    """`2.31× [2.10, 2.55]`: a ratio and its 95% interval, the one way every table writes a speedup
    (`times` and `interval` adapt it to LaTeX)."""
    text = f"{value:.{digits}f}{times}"
    return text if low is None or high is None else text + interval.format(f"{low:.{digits}f}", f"{high:.{digits}f}")

