"""The batch sweep (`run --batch`): a run's cells that differ only in batch size, side by side. For each method and
batch size B: the paired speedup over vanilla at the same B, total tokens/s (every sequence's tokens over the time
the batch took), per-user tokens/s (the rate one sequence sees) and τ; and the figure serving studies draw (speedup
against B; total throughput against per-user speed)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from . import metrics
from .cells import AA, BASELINE, OVERALL, Cell, forward_time, mean_tree_size
from .plots import _legend, _save
from .regimes import step_split
from .tables import fmt_speedup, md_table

NOTES = """\
B sequences are decoded together in our loop: each drafts and accepts on its own, one target forward verifies them
all, and a sequence that ends hands its slot to the next turn waiting, so the batch stays full while questions
remain (it drains at the end). **Speedup**: paired over the questions with vanilla at the same B (per-user rates,
so it is the speedup a user sees at that batch size). **total tokens/s**: every sequence's new tokens over the time
from the batch's first prefill to its last token. **per-user tokens/s**: Σ new tokens / Σ each turn's own span in
the batch. At B = 1 both are the run's tokens/s. **ms/step**: a step of the batch (its time over its steps), split
into the target's forward as measured [and as profiled before the run: T(rows) at B slots of the widest slot's
bucket], the drafting of every slot, and the rest (a refilled slot's prefill, acceptance, the host's loop). Methods
whose drafter is a model draft every sequence in one forward per depth; pld, suffix, lookahead and ouroboros draft
sequence by sequence on the host."""


STEP = "ms/step (forward [T(rows)] / drafting / rest)"


def groups(cells: list[Cell]) -> list[list[Cell]]:
    """Cells of one source, model, task and temperature at two batch sizes or more, smallest B first."""
    by_key: dict[tuple, list[Cell]] = {}
    for c in cells:
        by_key.setdefault((c.source.name, c.model, c.task, c.temperature), []).append(c)
    return [sorted(g, key=lambda c: c.batch_size) for g in by_key.values() if len({c.batch_size for c in g}) > 1]


def rows(group: list[Cell]) -> pd.DataFrame:
    """One row per method and batch size (the A/A column left out): B, speedup, total and per-user tokens/s, τ."""
    out = []
    for c in group:
        for method, s in c.stats.items():
            if method != AA:
                out.append(
                    dict(
                        method=method,
                        display=s.display,
                        batch=c.batch_size,
                        speedup=s.paired[OVERALL] if method != BASELINE else None,
                        total=metrics.total_throughput(s.turns),
                        per_user=metrics.tokens_per_second(s.turns),
                        tau=s.tau,
                        split=_split(c, s),
                    )
                )
    return pd.DataFrame(out)


def _split(cell: Cell, s) -> tuple[float, float, float, float, float] | None:
    """Seconds per step: the whole, the forward measured and profiled, drafting, the rest; at B = 1 from the
    steps' sums and `forward_profile.json`'s T(mean rows)."""
    if cell.batch_size > 1:
        return metrics.batch_step_split(s.turns)
    split, rows = step_split(s.turns), mean_tree_size(s.steps)
    if split is None:
        return None
    profiled = forward_time(cell.source.profile, rows) if cell.source.profile and rows is not None else math.nan
    step, forward, drafting, rest = split
    return step, forward, profiled, drafting, rest


def _ms(split: tuple[float, float, float, float, float] | None) -> str:
    if split is None:
        return "–"
    step, forward, profiled, drafting, rest = (1e3 * x for x in split)
    return f"{step:.1f} ({forward:.1f} [{profiled:.1f}] / {drafting:.1f} / {rest:.1f})"


def table(group: list[Cell]) -> str:
    data = rows(group)
    body = [
        [
            r.display,
            str(r.batch),
            "1.00×" if r.speedup is None else fmt_speedup(r.speedup),
            f"{r.total:.1f}",
            f"{r.per_user:.1f}",
            f"{r.tau:.2f}",
            _ms(r.split),
        ]
        for r in data.sort_values(["method", "batch"], key=_vanilla_first).itertuples()
    ]
    header = ["method", "B", "speedup [95% CI]", "total tokens/s", "per-user tokens/s", "τ", STEP]
    return md_table(header, body, left=1)


def _vanilla_first(column: pd.Series) -> pd.Series:
    return column.map(lambda m: "" if m == BASELINE else m) if column.name == "method" else column


def plot(group: list[Cell], colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Left: each method's speedup over vanilla against B (log scale), its interval as error bars. Right: total
    tokens/s against per-user tokens/s, one curve per method through its batch sizes, each point labelled B."""
    data = rows(group)
    fig = Figure(figsize=(11.0, 4.2))
    speed, pareto = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for method, part in data.sort_values("batch").groupby("method"):
        color = colors.get(method, "black")
        label = part.display.iloc[0]
        if method != BASELINE:
            s = list(part.speedup)
            low = [x.value - x.low if x.has_interval else 0 for x in s]
            high = [x.high - x.value if x.has_interval else 0 for x in s]
            speed.errorbar(part.batch, [x.value for x in s], yerr=[low, high], marker="o", color=color, label=label)
        pareto.plot(part.per_user, part.total, marker="o", color=color, label=label)
        for r in part.itertuples():
            pareto.annotate(
                f"B={r.batch}", (r.per_user, r.total), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    speed.axhline(1.0, color="black", linestyle="--", linewidth=1)
    batches = sorted(data.batch.unique())
    speed.set_xscale("log", base=2)
    speed.set_xticks(batches, [str(b) for b in batches])
    speed.minorticks_off()
    speed.set_xlabel("batch size B")
    speed.set_ylabel("speedup over vanilla at the same B (×)")
    pareto.set_xlabel("per-user tokens/s")
    pareto.set_ylabel("total tokens/s")
    _legend(pareto)
    c = group[0]
    fig.suptitle(f"Batch sweep: {c.source.label} · {c.model} · {c.task} · T={c.temperature:g}", fontsize=10)
    return _save(fig, out_dir, stem)
