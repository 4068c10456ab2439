"""Every number of docs/metrics.md, defined once. Inputs are `frames` data: turn rows (`frames.frame`) or step
rows (`frames.steps_frame`), each of one method in one cell unless said otherwise."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import special


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


# alpha_k from n drafts is a binomial share: near 0.5 its 95% interval is about +-1/sqrt(n) wide (+-0.31 at n = 10),
# and one draft more or less moves it by up to 1/n. Below 10 drafts a point says little more than "some were
# accepted", so the report draws it apart (hollow, dashed) rather than as firmly as one resting on hundreds.
MIN_DRAFTS = 10


def acceptance_counts(steps: pd.DataFrame, max_depth: int | None = None) -> list[int]:
    """n_k for k = 1..: the steps that examined draft depth k, the drafts alpha_k (`acceptance_by_position`, same
    depths) rests on. They never grow with k, so a deep alpha_k may rest on a handful of drafts."""
    recorded = steps[steps.tested.notna()]
    if recorded.empty:
        return []
    tested = recorded.tested.to_numpy(dtype=np.int64)
    return _at_least(tested, int(tested.max()) if max_depth is None else max_depth).tolist()


def speculators_acceptance(steps: pd.DataFrame, positions: int) -> dict[str, float]:
    """A group of steps in the columns of speculators' evaluation (its acceptance.csv, from vLLM's spec-decode
    counters): a draft is a step that verified drafted rows (`tree_size` > 1; where no tree size is recorded,
    `tested` > 0); num_draft_tokens Σ its rows after the root, num_accepted_tokens Σ its accepted drafted tokens
    (the target's own left out), acceptance_length 1 + accepted / drafts, and acceptance_at_pos_i (i from 0) the
    share of all drafts that accepted their (i + 1)-th token: unconditional, unlike alpha_k."""
    sizes, tested = steps.tree_size.to_numpy(dtype=float), steps.tested.to_numpy(dtype=float)
    drafted = np.where(np.isnan(sizes), np.where(np.isnan(tested), 0, tested > 0), sizes > 1).astype(bool)
    accepted = np.clip(steps.accepted.to_numpy(dtype=np.int64)[drafted] - 1, 0, None)
    drafts = int(drafted.sum())
    row: dict[str, float] = {
        "num_drafts": drafts,
        "num_draft_tokens": float(np.nansum(np.where(np.isnan(sizes), tested, sizes - 1)[drafted])),
        "num_accepted_tokens": int(accepted.sum()),
        "acceptance_length": 1 + accepted.sum() / drafts if drafts else float("nan"),
    }
    took = _at_least(accepted, positions) if positions else np.zeros(0)
    for i in range(positions):
        row[f"acceptance_at_pos_{i}"] = float(took[i] / drafts) if drafts else float("nan")
    return row


def _at_least(values: np.ndarray, depth: int) -> np.ndarray:
    """[depth]: how many of the non-negative `values` are >= k, for k = 1..depth."""
    counts = np.bincount(values, minlength=depth + 1)
    return np.cumsum(counts[::-1])[::-1][1 : depth + 1]


def question_throughput(turns: pd.DataFrame) -> pd.Series:
    """Tokens/s of each question: its new tokens over its wall time, all turns; by question id, in the order the
    questions first appear."""
    sums = turns.groupby("question_id", sort=False)[["new_tokens", "wall_time"]].sum()
    return sums.new_tokens / sums.wall_time


def tokens_per_second(turns: pd.DataFrame) -> float:
    """Σ new tokens / Σ wall time: at batch 1 the run's rate, in a batch the rate one user sees (per-user)."""
    return float(turns.new_tokens.sum() / turns.wall_time.sum())


def total_throughput(turns: pd.DataFrame) -> float:
    """Σ new tokens / the time they took together: in a batch from its first turn's start to its last turn's end
    (the turns overlap); at batch 1 Σ wall time (the turns ran one after another)."""
    if len(turns) and turns.batch_end.notna().all():
        return float(turns.new_tokens.sum() / (turns.batch_end.max() - turns.batch_start.min()))
    return tokens_per_second(turns)


def batch_step_split(turns: pd.DataFrame) -> tuple[float, float, float, float, float] | None:
    """Seconds per step of a batch (B > 1) from its turns' shares: the whole step (the batch's time over its
    steps), the target's forward as measured and as profiled (T(rows) at B slots of the widest slot's bucket), the
    drafting (every slot's), and the rest (prefills of refilled slots, acceptance, the host's loop). None: not
    recorded (B = 1, or a file without shares)."""
    if not len(turns) or turns.batch_steps.isna().any() or turns.draft_time.isna().all():
        return None
    steps = turns.batch_steps.sum()
    step = (turns.batch_end.max() - turns.batch_start.min()) / steps
    forward, profiled = turns.batch_forward.sum() / steps, turns.batch_profiled.sum() / steps
    drafting = turns.draft_time.fillna(0).sum() / steps
    return float(step), float(forward), float(profiled), float(drafting), float(step - forward - drafting)


@dataclass(frozen=True)
class Speedup:
    value: float
    low: float  # 95% interval (`ratio_interval`); nan with a single pair: no interval
    high: float
    pairs: int

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))


Spread = tuple[float, int]  # a standard deviation of log ratios and its degrees of freedom


def ratio_interval(logs: np.ndarray, noise: float = 0.0, spread: Spread | None = None) -> tuple[float, float]:
    """95% interval of the mean of paired log ratios: Student's t over the pairs' spread, that spread taken no
    smaller than `noise` (the per-question timing noise the A/A column measured). The spread is the pairs' own
    (n - 1 degrees of freedom) unless `spread` gives one estimated from more questions (`pooled_spread`).

    Why t and not a bootstrap: with n pairs a percentile bootstrap only returns the pairs' range (n = 2: two equal
    ratios give a zero-width interval), so it covers about half the time at n = 2; t covers 95% for normal logs at
    every n. The floor keeps questions that agree by chance from claiming less noise than the machine has."""
    n = logs.size
    if n < 2:
        return float("nan"), float("nan")
    sd, df = (float(logs.std(ddof=1)), n - 1) if spread is None else spread
    half = float(special.stdtrit(df, 0.975)) * max(sd, noise) / math.sqrt(n)  # the t quantile
    mean = float(logs.mean())
    return math.exp(mean - half), math.exp(mean + half)


def pooled_spread(groups: Iterable[np.ndarray]) -> Spread:
    """The within-group standard deviation of log ratios, pooled: each group centred on its own mean, the squared
    deviations of all groups summed over Σ (n_g - 1), the degrees of freedom it returns too. Differences between
    the groups' means do not enter it; a group of one question adds nothing. (nan, 0) when no group has two."""
    centred = [g - g.mean() for g in groups if g.size]
    df = sum(g.size - 1 for g in centred)
    if df == 0:
        return float("nan"), 0
    return math.sqrt(sum(float(np.sum(g**2)) for g in centred) / df), df


def geometric_mean(ratios: list[float] | np.ndarray, noise: float = 0.0, spread: Spread | None = None) -> Speedup:
    """Geometric mean of paired ratios, with its 95% interval (`ratio_interval`; none for one pair)."""
    logs = np.log(np.asarray(ratios, dtype=float))
    if logs.size == 0:
        return Speedup(float("nan"), float("nan"), float("nan"), 0)
    low, high = ratio_interval(logs, noise, spread)
    return Speedup(float(np.exp(logs.mean())), low, high, int(logs.size))


def pooled_speedups(ratios: dict[str, np.ndarray], noise: float = 0.0) -> dict[str, Speedup]:
    """Each category's geometric mean of its paired ratios, its interval from the spread pooled over all the
    categories given (`pooled_spread`): a category of two questions alone has one degree of freedom (t = 12.7),
    while the timing noise of one method on one machine is much the same in every category."""
    spread = pooled_spread(np.log(np.asarray(r, dtype=float)) for r in ratios.values())
    return {category: geometric_mean(r, noise, spread) for category, r in ratios.items()}


def paired_ratios(method_turns: pd.DataFrame, baseline_turns: pd.DataFrame) -> pd.Series:
    """Tokens/s of the method / that of the baseline, by question id, over the questions both answered."""
    mine, base = question_throughput(method_turns), question_throughput(baseline_turns)
    shared = mine.index[mine.index.isin(base.index)]
    return mine.loc[shared] / base.loc[shared]


def paired_speedup(method_turns: pd.DataFrame, baseline_turns: pd.DataFrame, noise: float = 0.0) -> Speedup:
    """Geometric mean over questions of tokens/s(method) / tokens/s(baseline), paired by question id; `noise`:
    the interval's floor (`noise_floor`)."""
    return geometric_mean(paired_ratios(method_turns, baseline_turns).to_numpy(), noise)


def noise_floor(aa_turns: pd.DataFrame, baseline_turns: pd.DataFrame) -> float:
    """The per-question timing noise of a paired log ratio, from the A/A column: the root mean square of
    log(tokens/s of vanilla's second timing / its first) over the questions (about zero, the true A/A log ratio,
    so a systematic A/A offset counts as noise too); 0.0 below two pairs."""
    logs = np.log(paired_ratios(aa_turns, baseline_turns).to_numpy())
    return float(np.sqrt(np.mean(logs**2))) if logs.size >= 2 else 0.0


ORDER_ALPHA = 0.01  # each of the two order tests' false-alarm rate


@dataclass(frozen=True)
class OrderEffect:
    """Whether the A/A log ratio depends on where a question ran: its place in the run (drift: Spearman's rank
    correlation with the position) or which of the two vanilla timings ran first within it (Welch's t-test)."""

    pairs: int
    drift_p: float  # nan: not testable (fewer than 6 pairs, or no recorded order)
    first_p: float
    first_shift: float  # A/A ratio when the A/A timing ran after vanilla / when it ran before

    @property
    def flagged(self) -> bool:
        return any(p < ORDER_ALPHA for p in (self.drift_p, self.first_p) if not math.isnan(p))


def _two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's T with `df` degrees of freedom."""
    return float(2 * special.stdtr(df, -abs(t)))


def spearman_p(x: np.ndarray, y: np.ndarray) -> float:
    """Two-sided p-value of Spearman's rank correlation (average ranks for ties; the t approximation with n - 2
    degrees of freedom, as scipy.stats.spearmanr); nan when either side is constant or n < 3."""
    rx, ry = (pd.Series(v).rank().to_numpy() for v in (x, y))
    if x.size < 3 or rx.std() == 0 or ry.std() == 0:
        return float("nan")
    r = float(np.corrcoef(rx, ry)[0, 1])
    if abs(r) >= 1:
        return 0.0
    return _two_sided(r * math.sqrt((x.size - 2) / (1 - r * r)), x.size - 2)


def welch_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value of Welch's t-test of equal means (Welch-Satterthwaite degrees of freedom, as
    scipy.stats.ttest_ind(equal_var=False)); nan below two values a side or with no spread."""
    if min(a.size, b.size) < 2:
        return float("nan")
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    if va + vb == 0:
        return float("nan")
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    return _two_sided(float((a.mean() - b.mean()) / math.sqrt(va + vb)), df)


def _order(turns: pd.DataFrame) -> pd.DataFrame:
    """Each answer's recorded position in the run and order within its question, by question id."""
    return turns[turns.turn == 0].set_index("question_id")[["position", "order"]].astype(float)


def order_effect(aa_turns: pd.DataFrame, baseline_turns: pd.DataFrame) -> OrderEffect:
    """Tests the A/A pairs for an order effect; needs each answer's recorded `position` and `order` (turn-0 rows)."""
    nan = float("nan")
    logs = np.log(paired_ratios(aa_turns, baseline_turns))
    order = _order(aa_turns).add_suffix("_aa").join(_order(baseline_turns).add_suffix("_base"))
    order = order.reindex(logs.index).dropna()
    x, pos, after = logs.loc[order.index], order.position_aa, order.order_aa > order.order_base
    if x.size < 6:
        return OrderEffect(int(x.size), nan, nan, nan)
    drift = spearman_p(pos.to_numpy(), x.to_numpy())
    late, early = x[after].to_numpy(), x[~after].to_numpy()
    first = welch_p(late, early)
    shift = float(np.exp(late.mean() - early.mean())) if late.size and early.size else nan
    return OrderEffect(int(x.size), drift, first, shift)


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
    drops = [
        {"position": i, "value": m, "previous": at_least[i - 1]}
        for i, m in enumerate(at_least)
        if i and m > at_least[i - 1] + 1e-9
    ]
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
    (`times` and `interval` adapt it to LaTeX); no brackets without an interval (a single pair)."""
    text = f"{value:.{digits}f}{times}"
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return text
    return text + interval.format(f"{low:.{digits}f}", f"{high:.{digits}f}")
