"""Cells: answers grouped by (source, model, task, temperature), and each method's numbers in a cell (paired
speedups, τ, tree size, draft share, roofline efficiency), every one computed by `metrics`. A cell's baseline
is `vanilla` from the same source. Tables, plots and `compare` read cells.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from . import metrics
from .results import Answer
from .sources import Source
from .tasks import groups as task_groups

BASELINE = "vanilla"
OVERALL = "overall"
NA = "n/a"  # no baseline to compare with
MISSING = "—"  # not recorded


@dataclass
class MethodStats:
    """The numbers of one method in one cell; speedups are keyed by category and OVERALL."""

    method: str
    answers: list[Answer]
    paired: dict[str, metrics.Speedup] = field(default_factory=dict)
    spec_bench: dict[str, float] = field(default_factory=dict)

    @property
    def lossy(self) -> bool:
        return any(not a.lossless_rule for a in self.answers)

    @property
    def display(self) -> str:
        return f"{self.method} (lossy)" if self.lossy else self.method

    @cached_property
    def tau(self) -> float:
        return metrics.tau(self.answers)


@dataclass
class Cell:
    """All methods of one (source, model, task, temperature)."""

    source: Source
    model: str
    task: str
    temperature: float
    by_method: dict[str, list[Answer]]

    @property
    def title(self) -> str:
        return f"{self.source.label} · {self.model} · {self.task} · T={self.temperature:g}"

    @property
    def slug(self) -> str:
        return file_stem(self.source.name, self.model, self.task, f"t{self.temperature:g}")

    @property
    def baseline(self) -> list[Answer] | None:
        return self.by_method.get(BASELINE)

    @property
    def groups(self) -> list[str]:
        """The reporting groups present, Spec-Bench's subtasks first in their order."""
        present = {a.group for answers in self.by_method.values() for a in answers}
        order = list(task_groups("spec_bench"))
        return [g for g in order if g in present] + sorted(present - set(order))

    @property
    def missing_baseline(self) -> str | None:
        """One line saying why the speedups are n/a, or None."""
        if self.baseline is None:
            return f"{self.title}: no `{BASELINE}` answers in this source, so every speedup is {NA}."
        return None

    @cached_property
    def stats(self) -> dict[str, MethodStats]:
        out = {}
        for method, answers in self.by_method.items():
            s = MethodStats(method, answers)
            for cat in [*self.groups, OVERALL]:
                mine, base = select(answers, cat), select(self.baseline or [], cat)
                s.paired[cat] = metrics.paired_speedup(mine, base)
                s.spec_bench[cat] = metrics.spec_bench_speedup(mine, base)
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


def select(answers: list[Answer], category: str) -> list[Answer]:
    """The answers of one category (a task group), or all of them for OVERALL."""
    return [a for a in answers if category in (OVERALL, a.group)]


def collect_cells(sources: list[Source]) -> list[Cell]:
    """Cells in source order, then model, task, temperature."""
    cells = []
    for source in sources:
        keyed: dict[tuple, dict[str, list[Answer]]] = {}
        for a in source.answers:
            keyed.setdefault((a.model, a.task, a.temperature), {}).setdefault(a.method, []).append(a)
        for (model, task, temperature), by_method in sorted(keyed.items()):
            cells.append(Cell(source, model, task, temperature, dict(sorted(by_method.items()))))
    return cells


def _recorded(answers: list[Answer], attr: str) -> bool:
    return bool(answers) and all(getattr(a, attr) is not None for a in answers)


def mean_tree_size(answers: list[Answer]) -> float | None:
    """Mean tokens verified per step, when recorded."""
    if not _recorded(answers, "tree_size"):
        return None
    steps = sum(len(a.tree_size) for a in answers)
    return sum(sum(a.tree_size) for a in answers) / steps if steps else None


def draft_share(answers: list[Answer]) -> float | None:
    """Share of draft time in draft + verify time, when recorded."""
    if not (_recorded(answers, "draft_time") and _recorded(answers, "verify_time")):
        return None
    draft = sum(a.draft_time for a in answers)
    total = draft + sum(a.verify_time for a in answers)
    return draft / total if total else None


def forward_time(profile: dict[int, float], n: float) -> float:
    """T(n): the profiled target forward time, linearly interpolated between measured sizes."""
    sizes = sorted(profile)
    return float(np.interp(n, sizes, [profile[k] for k in sizes]))


def roofline(cell: Cell, s: MethodStats) -> float | None:
    """metrics.roofline_efficiency with the overall paired speedup, when every input was recorded."""
    profile, n = cell.source.profile, mean_tree_size(s.answers)
    speedup = s.paired[OVERALL].value
    if not profile or 1 not in profile or n is None or not _recorded(s.answers, "draft_time") or math.isnan(speedup):
        return None
    steps = sum(sum(a.decoding_steps) for a in s.answers)
    draft = sum(a.draft_time for a in s.answers) / steps
    return metrics.roofline_efficiency(speedup, s.tau, profile[1], forward_time(profile, n), draft)


def from_spec_bench(a: Answer) -> bool:
    """Written by Spec-Bench itself (none of our per-step fields)."""
    return a.seed is None and a.tree_size is None and a.draft_time is None


def source_line(s: Source) -> str:
    """`**name (device)**: `path` (dtype, torch, transformers)`."""
    extra = []
    if s.manifest:
        cfg, mach = s.manifest.get("config", {}), s.manifest.get("machine", {})
        extra = [f"{k} {v}" for k, v in (("dtype", cfg.get("dtype")), ("torch", mach.get("torch")),
                                          ("transformers", mach.get("transformers"))) if v]
    return f"**{s.label}**: `{s.path}`" + (f" ({', '.join(extra)})" if extra else "")
