"""Cells: a source's turn and step rows (`frames`) grouped by (model, task, temperature), and each method's numbers
in a cell (paired speedups, τ, tree size, draft share, roofline efficiency), every one computed by `metrics`. A
cell's baseline is `vanilla` from the same source. Tables, plots and `compare` read cells.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from ..tasks import groups as task_groups
from . import metrics
from .frames import from_sources, steps_from_sources
from .sources import Source

BASELINE = "vanilla"
AA = "vanilla-aa"  # the runner's A/A column: vanilla timed twice per question in the same interleaving
OVERALL = "overall"
NA = "n/a"  # no baseline to compare with
MISSING = "—"  # not recorded
CELL_KEY = ["model", "task", "temperature", "batch_size"]  # within one source


@dataclass
class MethodStats:
    """The numbers of one method in one cell; speedups are keyed by category and OVERALL."""

    method: str
    turns: pd.DataFrame
    steps: pd.DataFrame
    paired: dict[str, metrics.Speedup] = field(default_factory=dict)
    spec_bench: dict[str, float] = field(default_factory=dict)

    @property
    def questions(self) -> int:
        """Answers, each one turn-0 row."""
        return int((self.turns.turn == 0).sum())

    @property
    def lossy(self) -> bool:
        return not self.turns.lossless_rule.all()

    @property
    def synthetic(self) -> bool:
        """Cost-only: its verdicts were forced at synthetic acceptance rates (`core.synthetic`)."""
        return bool(self.turns.synthetic.notna().any())

    @property
    def display(self) -> str:
        marks = [m for m, on in (("lossy", self.lossy), ("cost-only", self.synthetic)) if on]
        return f"{self.method} ({', '.join(marks)})" if marks else self.method

    @cached_property
    def tau(self) -> float:
        return metrics.tau(self.turns)


@dataclass
class Cell:
    """All methods of one (source, model, task, temperature): its turn and step rows."""

    source: Source
    model: str
    task: str
    temperature: float
    batch_size: int
    turns: pd.DataFrame
    steps: pd.DataFrame

    @property
    def title(self) -> str:
        batch = f" · B={self.batch_size}" if self.batch_size > 1 else ""
        return f"{self.source.label} · {self.model} · {self.task} · T={self.temperature:g}{batch}"

    @property
    def slug(self) -> str:
        batch = [f"b{self.batch_size}"] if self.batch_size > 1 else []
        return file_stem(self.source.name, self.model, self.task, f"t{self.temperature:g}", *batch)

    @cached_property
    def by_method(self) -> dict[str, tuple[pd.DataFrame, pd.DataFrame]]:
        """Each method's (turns, steps), methods by name."""
        steps = dict(list(self.steps.groupby("method")))
        return {m: (turns, steps.get(m, self.steps.iloc[:0])) for m, turns in self.turns.groupby("method")}

    @property
    def baseline(self) -> pd.DataFrame | None:
        """Vanilla's turns."""
        return self.by_method[BASELINE][0] if BASELINE in self.by_method else None

    @property
    def groups(self) -> list[str]:
        """The reporting groups present, Spec-Bench's subtasks first in their order."""
        present = set(self.turns.group)
        order = list(task_groups("spec_bench"))
        return [g for g in order if g in present] + sorted(present - set(order))

    @property
    def missing_baseline(self) -> str | None:
        """One line saying why the speedups are n/a, or None."""
        if self.baseline is None:
            return f"{self.title}: no `{BASELINE}` answers in this source, so every speedup is {NA}."
        return None

    @cached_property
    def noise(self) -> float:
        """The per-question timing noise the A/A column measured over the whole cell (metrics.noise_floor): every
        interval's floor; 0.0 without an A/A column."""
        if self.baseline is None or AA not in self.by_method:
            return 0.0
        return metrics.noise_floor(self.by_method[AA][0], self.baseline)

    @cached_property
    def order(self) -> metrics.OrderEffect | None:
        """Whether the A/A ratio depends on where a question ran (metrics.order_effect); None without A/A."""
        if self.baseline is None or AA not in self.by_method:
            return None
        return metrics.order_effect(self.by_method[AA][0], self.baseline)

    @cached_property
    def stats(self) -> dict[str, MethodStats]:
        out = {}
        baseline = self.turns.iloc[:0] if self.baseline is None else self.baseline
        for method, (turns, steps) in self.by_method.items():
            s = MethodStats(method, turns, steps)
            categories = [*self.groups, OVERALL]
            ratios = {c: metrics.paired_ratios(select(turns, c), select(baseline, c)).to_numpy() for c in categories}
            s.paired = speedups(ratios, self.noise)
            s.spec_bench = {c: metrics.spec_bench_speedup(select(turns, c), select(baseline, c)) for c in categories}
            out[method] = s
        return out

    def ranked(self) -> list[MethodStats]:
        """Methods other than the baseline, best overall paired speedup first."""
        rows = [s for m, s in self.stats.items() if m != BASELINE]
        return sorted(rows, key=lambda s: (-_or(s.paired[OVERALL].value, -math.inf), s.method))


def file_stem(*parts: str) -> str:
    """A file-name-safe stem from its parts."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", "-".join(parts))


def _or(x: float, default: float) -> float:
    return default if math.isnan(x) else x


def select(rows: pd.DataFrame, category: str) -> pd.DataFrame:
    """The turn or step rows of one category (a task group), or all of them for OVERALL."""
    return rows if category == OVERALL else rows[rows.group == category]


def speedups(ratios: dict[str, np.ndarray], noise: float) -> dict[str, metrics.Speedup]:
    """Paired ratios by category and OVERALL as speedups: each category's interval from the spread pooled over the
    categories (metrics.pooled_speedups: a category of two questions alone would have one degree of freedom),
    OVERALL's from its own questions; `noise`: every interval's floor."""
    pooled = metrics.pooled_speedups({c: r for c, r in ratios.items() if c != OVERALL}, noise)
    return {c: metrics.geometric_mean(r, noise) if c == OVERALL else pooled[c] for c, r in ratios.items()}


def collect_cells(sources: list[Source]) -> list[Cell]:
    """Cells in source order, then model, task, temperature."""
    cells = []
    for source in sources:
        turns, steps = from_sources([source]), steps_from_sources([source])
        steps_of = dict(list(steps.groupby(CELL_KEY)))
        for key, cell_turns in turns.groupby(CELL_KEY):
            model, task, temperature, batch = key
            cells.append(
                Cell(source, model, task, temperature, int(batch), cell_turns, steps_of.get(key, steps.iloc[:0]))
            )
    return cells


def _recorded(rows: pd.DataFrame, column: str) -> bool:
    return not rows.empty and bool(rows[column].notna().all())


def mean_tree_size(steps: pd.DataFrame) -> float | None:
    """Mean tokens verified per step, when recorded."""
    return float(steps.tree_size.mean()) if _recorded(steps, "tree_size") else None


def drafts_nothing(steps: pd.DataFrame) -> bool:
    """Every step verified its root alone (vanilla, the A/A column): with no proposal, what the loop timed as its
    drafting (core.decode's window around propose and update) was the loop's own calls, not a drafter's."""
    return _recorded(steps, "tree_size") and bool(steps.tree_size.eq(1).all())


def draft_share(turns: pd.DataFrame, steps: pd.DataFrame) -> float | None:
    """Share of draft time in draft + verify time, when recorded; none for a method that drafts nothing."""
    if drafts_nothing(steps) or not (_recorded(turns, "draft_time") and _recorded(turns, "verify_time")):
        return None
    draft = turns.draft_time.sum()
    total = draft + turns.verify_time.sum()
    return float(draft / total) if total else None


def forward_time(profile: dict[int, float], n: float) -> float:
    """T(n): the profiled target forward time, linearly interpolated between measured sizes."""
    sizes = sorted(profile)
    return float(np.interp(n, sizes, [profile[k] for k in sizes]))


def roofline(cell: Cell, s: MethodStats) -> float | None:
    """metrics.roofline_efficiency with the overall paired speedup, when every input was recorded. A method that
    drafts nothing has D = 0 (`drafts_nothing`): its efficiency is its paired speedup, 100% for vanilla itself;
    the loop's own calls counted as D read vanilla at 1 + D/T(1), above the roofline it defines."""
    profile, n = cell.source.profile, mean_tree_size(s.steps)
    speedup = s.paired[OVERALL].value
    if not profile or 1 not in profile or n is None or not _recorded(s.turns, "draft_time") or math.isnan(speedup):
        return None
    draft = 0.0 if drafts_nothing(s.steps) else s.turns.draft_time.sum() / s.turns.steps.sum()
    return metrics.roofline_efficiency(speedup, s.tau, profile[1], forward_time(profile, n), draft)


def from_spec_bench(turns: pd.DataFrame) -> bool:
    """Some of these answers were written by Spec-Bench itself (none of our per-step fields)."""
    return bool((turns.seed.isna() & turns.draft_time.isna() & turns.mean_tree_size.isna()).any())


def source_line(s: Source, folder: Path | None = None) -> str:
    """`**name (device)**: `path` (dtype, torch, transformers)`; the path relative to `folder` when given (a
    report's: `Source.where`)."""
    extra = []
    if s.manifest:
        cfg, mach = s.manifest.get("config", {}), s.manifest.get("machine", {})
        extra = [
            f"{k} {v}"
            for k, v in (
                ("dtype", cfg.get("dtype")),
                ("torch", mach.get("torch")),
                ("transformers", mach.get("transformers")),
            )
            if v
        ]
    path = s.path if folder is None else s.where(folder)
    return f"**{s.label}**: `{path}`" + (f" ({', '.join(extra)})" if extra else "")
