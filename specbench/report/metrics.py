"""Every number of docs/metrics.md, defined once. Inputs are `frames` data: turn rows (`frames.frame`) or step
rows (`frames.steps_frame`), each of one method in one cell unless said otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


def tau(turns: pd.DataFrame) -> float:
    """Mean accepted length: total new tokens / total decoding steps (the target's own token counted)."""
    steps = turns.steps.sum()
    return float(turns.new_tokens.sum() / steps) if steps else float("nan")


def acceptance_by_position(steps: pd.DataFrame, max_depth: int | None = None) -> list[float]:
    """alpha_k for k = 1..: among steps that examined draft depth k, the share that accepted the k-th token."""
    recorded = steps[steps.tested.notna()]
    if recorded.empty:
        return []
    tested = recorded.tested.to_numpy(dtype=np.int64)
    depth = int(tested.max()) if max_depth is None else max_depth
    # a step reached depth k when tested >= k, and accepted the k-th draft token too when also accepted - 1 >= k
    accepted = np.clip(np.minimum(tested, recorded.accepted.to_numpy(dtype=np.int64) - 1), 0, None)
    reached = _at_least(tested, depth)
    took = _at_least(accepted, depth)
    return [float(t / r) if r else float("nan") for t, r in zip(took, reached, strict=True)]


def _at_least(values: np.ndarray, depth: int) -> np.ndarray:
    """[depth]: how many of the non-negative `values` are >= k, for k = 1..depth."""
    counts = np.bincount(values, minlength=depth + 1)
    return np.cumsum(counts[::-1])[::-1][1 : depth + 1]


def question_throughput(turns: pd.DataFrame) -> pd.Series:
    """Tokens/s of each question: its new tokens over its wall time, all turns; by question id, in the order the
    questions first appear (the bootstrap resamples in that order)."""
    sums = turns.groupby("question_id", sort=False)[["new_tokens", "wall_time"]].sum()
    return sums.new_tokens / sums.wall_time


def tokens_per_second(turns: pd.DataFrame) -> float:
    return float(turns.new_tokens.sum() / turns.wall_time.sum())


@dataclass(frozen=True)
class Speedup:
    value: float
    low: float  # 95% bootstrap interval over questions
    high: float
    pairs: int


def geometric_mean(ratios: list[float] | np.ndarray, n_boot: int = 2000, seed: int = 0) -> Speedup:
    """Geometric mean of paired ratios, with a 95% percentile-bootstrap interval over the pairs."""
    logs = np.log(np.asarray(ratios, dtype=float))
    if logs.size == 0:
        return Speedup(float("nan"), float("nan"), float("nan"), 0)
    rng = np.random.default_rng(seed)
    boot = logs[rng.integers(0, logs.size, size=(n_boot, logs.size))].mean(axis=1)
    low, high = np.exp(np.percentile(boot, [2.5, 97.5]))
    return Speedup(float(np.exp(logs.mean())), float(low), float(high), int(logs.size))


def paired_speedup(method_turns: pd.DataFrame, baseline_turns: pd.DataFrame, n_boot: int = 2000,
                   seed: int = 0) -> Speedup:
    """Geometric mean over questions of tokens/s(method) / tokens/s(baseline), paired by question id."""
    mine, base = question_throughput(method_turns), question_throughput(baseline_turns)
    shared = mine.index[mine.index.isin(base.index)]
    return geometric_mean(mine.loc[shared].to_numpy() / base.loc[shared].to_numpy(), n_boot, seed)


def spec_bench_speedup(method_turns: pd.DataFrame, baseline_turns: pd.DataFrame) -> float:
    """Spec-Bench's definition: mean per-question tokens/s of the method / that of the baseline (unpaired)."""
    if method_turns.empty or baseline_turns.empty:
        return float("nan")
    return float(question_throughput(method_turns).mean() / question_throughput(baseline_turns).mean())


def roofline_efficiency(speedup: float, tau_value: float, t1: float, tn: float, draft: float) -> float:
    """Measured speedup / the overhead-free speedup tau * T(1) / (T(n) + D) at the same tau."""
    return speedup / (tau_value * t1 / (tn + draft))


@dataclass(frozen=True)
class Losslessness:
    questions: int
    exact: int
    near_ties: int  # first divergence classified numerical (core.losslessness.classify)
    bugs: int  # first divergence classified a bug

    @property
    def exact_rate(self) -> float:
        return self.exact / self.questions if self.questions else float("nan")


def losslessness(turns: pd.DataFrame) -> Losslessness:
    """Greedy token-by-token agreement with vanilla, from each answer's recorded greedy check (on its turn-0 row,
    so each answer counts once)."""
    checked = turns[turns.greedy_match.notna()]
    exact = int(checked.greedy_match.eq(True).sum())
    ties = int((checked.greedy_match.eq(False) & checked.greedy_near_tie.eq(True)).sum())
    return Losslessness(len(checked), exact, ties, len(checked) - exact - ties)


PROFILE_SCHEMA = "1.0"  # NVIDIA SPEED-Bench specdec_bench's speculation_profile.json schema_version


def speculation_profile(steps: pd.DataFrame, k: int, method: str) -> dict:
    """The cell's acceptance profile in the layout of SPEED-Bench's `speculation_profile.json` (NVIDIA
    Model-Optimizer `examples/specdec_bench`), so engine runs measured there compare with ours.

    L = tokens a step appended (the target's own included: L = 1 accepted no draft). Position i (0-based) is the
    (i+1)-th draft token: marginal[i] = P(L >= i + 2) over steps, conditional[i] = marginal[i] / marginal[i-1]
    (0 after a 0). `k` is the deepest draft position reported (longer L are counted at k + 1).
    """
    lengths = np.minimum(steps.accepted.to_numpy(dtype=np.int64), k + 1)
    n = lengths.size
    histogram = np.bincount(lengths, minlength=k + 2)  # [k + 2]: steps by L
    at_least = (_at_least(lengths, k + 1)[1:] / n).tolist() if n else [0.0] * k  # [k]: share of steps with L >= i + 2
    conditional = [(m / prev if prev else 0.0) for m, prev in zip(at_least, [1.0, *at_least[:-1]], strict=True)]
    mean = int(lengths.sum()) / n if n else float("nan")
    per_request = steps.groupby("question_id", sort=False).agg(group=("group", "first"), mean=("accepted", "mean"))
    by_group = per_request.groupby("group")["mean"].mean()
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
        "mean_accept_length_per_request": round(float(per_request["mean"].mean()), 6) if n else None,
        "accept_length_model": "measured_per_k",
        "accept_length_by_k": {str(k): round(mean, 6)} if n else {},
        "acceptance_length_histogram": {str(length): int(c) for length, c in enumerate(histogram) if c},
        "per_category": {g: round(float(v), 6) for g, v in by_group.items()} or None,
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

