"""`specbench compare BASELINE NEW`: a regression check of one run against another, cell by cell.

A row is (model, task, temperature, method, category), the category a task group or `overall`. Speed is
judged against noise: tokens/s per question, paired by question id, new over baseline, geometric mean with
a 95% interval (metrics.ratio_interval, floored by both runs' A/A noise; a category's with the spread pooled over
the cell's categories, as a report's); a slowdown fails only when it is larger than the limit and its interval
excludes 1.
The paired speedup over vanilla is compared the same way (run-internal, so robust to machine drift).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeGuard

import numpy as np
import pandas as pd

from ..errors import SpecbenchError
from . import metrics
from .cells import BASELINE, MISSING, OVERALL, Cell, collect_cells, select, source_line, speedups
from .sources import Source, load_sources
from .tables import md_table

MACHINE_KEYS = (("config", "dtype"), ("machine", "device"), ("machine", "device_name"), ("machine", "cpu_count"))
SOFTWARE_KEYS = (
    ("machine", "torch"),
    ("machine", "transformers"),
    ("machine", "python"),
    ("machine", "git_revision"),
    ("machine", "source_digest"),
)
DOWN, UP = "▼", "▲"  # the 95% interval lies below / above 1
MIN_PAIRS = 5  # fewer shared questions: speed is not judged (the interval is too wide to gate a release on)


@dataclass(frozen=True)
class Limits:
    """When a row fails."""

    max_slowdown: float = 0.05  # of tokens/s or of the speedup over vanilla, beyond noise
    min_tau_ratio: float = 0.95  # tau new / tau baseline
    speedup_only: bool = False  # judge speed by the speedup over vanilla only, not by absolute tokens/s
    strict: bool = False  # cells or questions present in only one run fail too


@dataclass
class Row:
    """One method in one category of one cell, present in both runs."""

    model: str
    task: str
    temperature: float
    method: str
    category: str
    tokens_per_s: tuple[float, float]  # baseline, new
    throughput: metrics.Speedup  # tokens/s new / baseline, paired by question
    speedup: tuple[metrics.Speedup, metrics.Speedup] | None  # over vanilla, baseline and new; None for vanilla
    speedup_change: metrics.Speedup | None  # speedup new / baseline, paired by question
    tau: tuple[float, float]  # baseline, new
    bugs: tuple[int, int] | None  # real greedy mismatches, baseline and new (overall rows of lossless methods, T=0)
    failures: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return _label(self.model, self.task, self.temperature, self.method, self.category)

    @property
    def speed_judged(self) -> bool:
        return self.throughput.pairs >= MIN_PAIRS

    @property
    def tau_ratio(self) -> float:
        return self.tau[1] / self.tau[0] if self.tau[0] else math.nan


@dataclass
class Comparison:
    baseline: Source
    new: Source
    limits: Limits
    rows: list[Row]
    only_in_baseline: list[str]
    only_in_new: list[str]
    machine_differences: list[str]  # allowed by the caller, else compare() refused
    software_differences: list[str]

    @property
    def failures(self) -> list[str]:
        out = [f for r in self.rows for f in r.failures]
        if self.limits.strict:
            out += [f"only in baseline: {x}" for x in self.only_in_baseline]
            out += [f"only in new: {x}" for x in self.only_in_new]
        return out

    @property
    def passed(self) -> bool:
        return not self.failures


def _label(model: str, task: str, temperature: float, method: str | None = None, category: str | None = None) -> str:
    return " · ".join([model, task, f"T={temperature:g}", *(x for x in (method, category) if x)])


def _differences(baseline: Source, new: Source, keys: tuple[tuple[str, str], ...]) -> list[str]:
    """`key baseline-value → new-value` for each manifest entry that differs."""
    out = []
    for section, key in keys:
        old, now = ((s.manifest or {}).get(section, {}).get(key) for s in (baseline, new))
        if old != now:
            out.append(f"{key} {old if old is not None else 'unknown'} → {now if now is not None else 'unknown'}")
    return out


def machine_differences(baseline: Source, new: Source) -> list[str]:
    """Differences of dtype, device and CPU count; a run without a manifest counts as an unknown machine."""
    missing = [
        f"{role} has no manifest.json (machine unknown)"
        for role, s in (("baseline", baseline), ("new", new))
        if not s.manifest
    ]
    return missing or _differences(baseline, new, MACHINE_KEYS)


def _vanilla_first(method: str) -> tuple[bool, str]:
    return method != BASELINE, method


def change_ratios(
    base_method: pd.DataFrame, base_vanilla: pd.DataFrame, new_method: pd.DataFrame, new_vanilla: pd.DataFrame
) -> np.ndarray:
    """Per question, paired speedup over vanilla new / baseline (turn rows of each), over the questions present
    in all four."""
    throughputs = [metrics.question_throughput(t) for t in (base_method, base_vanilla, new_method, new_vanilla)]
    shared = sorted(set.intersection(*(set(t.index) for t in throughputs)), key=str)
    bm, bv, nm, nv = (t.loc[shared].to_numpy() for t in throughputs)
    return (nm / nv) / (bm / bv)


def _beyond(change: metrics.Speedup | None, limit: float) -> TypeGuard[metrics.Speedup]:
    """A drop larger than the limit whose 95% interval excludes no change, over enough questions to tell."""
    return change is not None and change.pairs >= MIN_PAIRS and change.value < 1 - limit and change.high < 1


def _judge(row: Row, limits: Limits, lossy: bool) -> None:
    if not limits.speedup_only and _beyond(row.throughput, limits.max_slowdown):
        row.failures.append(
            f"{row.label}: tokens/s {_pct(row.throughput)}, more than the {limits.max_slowdown:.0%} allowed"
        )
    if _beyond(row.speedup_change, limits.max_slowdown):
        row.failures.append(
            f"{row.label}: speedup over vanilla {_pct(row.speedup_change)}, more than the "
            f"{limits.max_slowdown:.0%} allowed"
        )
    if row.tau_ratio < limits.min_tau_ratio:
        row.failures.append(
            f"{row.label}: τ {row.tau[0]:.2f} → {row.tau[1]:.2f} ({row.tau_ratio:.3f}×), "
            f"below the {limits.min_tau_ratio:g}× allowed"
        )
    if row.bugs and not lossy and row.bugs[1] > row.bugs[0]:
        row.failures.append(f"{row.label}: real greedy mismatches with vanilla {row.bugs[0]} → {row.bugs[1]}")


def _rows(base: Cell, new: Cell, method: str, limits: Limits) -> tuple[list[Row], list[str], list[str]]:
    """The rows of one method, and the categories or questions found in only the baseline or only the new run."""
    only_base, only_new = [], []
    where = _label(base.model, base.task, base.temperature, method)
    b_ids = set(base.by_method[method][0].question_id)
    n_ids = set(new.by_method[method][0].question_id)
    if b_ids - n_ids:
        only_base.append(f"{where}: {len(b_ids - n_ids)} question(s)")
    if n_ids - b_ids:
        only_new.append(f"{where}: {len(n_ids - b_ids)} question(s)")
    vanilla = method != BASELINE and base.baseline is not None and new.baseline is not None
    shared = {}
    for cat in dict.fromkeys([*base.groups, *new.groups, OVERALL]):
        b, n = select(base.by_method[method][0], cat), select(new.by_method[method][0], cat)
        if b.empty or n.empty:
            (only_new if b.empty else only_base).append(f"{where} · {cat}")
        else:
            shared[cat] = b, n
    # the categories' intervals with the spread pooled over the shared categories, as a report's (cells.speedups)
    noise = math.hypot(base.noise, new.noise)
    throughput = speedups(
        {c: metrics.paired_ratios(n, b).to_numpy() for c, (b, n) in shared.items()}, noise / math.sqrt(2)
    )
    changes = (
        speedups(
            {c: change_ratios(b, select(base.baseline, c), n, select(new.baseline, c)) for c, (b, n) in shared.items()},
            noise,
        )
        if vanilla
        else {}
    )
    rows = []
    for cat, (b, n) in shared.items():
        checked = cat == OVERALL and base.temperature == 0 and method != BASELINE
        row = Row(
            base.model,
            base.task,
            base.temperature,
            method,
            cat,
            tokens_per_s=(metrics.tokens_per_second(b), metrics.tokens_per_second(n)),
            throughput=throughput[cat],
            speedup=(base.stats[method].paired[cat], new.stats[method].paired[cat]) if vanilla else None,
            speedup_change=changes.get(cat),
            tau=(metrics.tau(b), metrics.tau(n)),
            bugs=(metrics.losslessness(b).bugs, metrics.losslessness(n).bugs) if checked else None,
        )
        _judge(row, limits, base.stats[method].lossy or new.stats[method].lossy)
        rows.append(row)
    return rows, only_base, only_new


def compare(baseline: Path, new: Path, limits: Limits = Limits(), allow_different_machines: bool = False) -> Comparison:
    """Match the cells of two runs and judge every shared (model, task, temperature, method, category)."""
    base_src, new_src = (
        load_sources([p], allow_different_machines, "--allow-different-machines")[0] for p in (baseline, new)
    )
    if base_src.engine.split()[0] != new_src.engine.split()[0]:
        raise SpecbenchError(
            f"the baseline ran in {base_src.engine} and the new run in {new_src.engine}: compare runs "
            "of one engine (`specbench report` sets the two side by side)"
        )
    if base_src.synthetic != new_src.synthetic:  # cost-only speeds pair only with the same forced acceptance
        raise SpecbenchError(
            f"the baseline ran with {base_src.acceptance} and the new run with {new_src.acceptance}: compare runs "
            "of the same acceptance (a cost-only run with one of the same synthetic profile)"
        )
    differ = machine_differences(base_src, new_src)
    if differ and not allow_different_machines:
        raise SpecbenchError(
            f"the runs are not from the same machine and dtype ({'; '.join(differ)}): their speeds "
            "are not comparable; pass --allow-different-machines to compare anyway"
        )
    base_cells, new_cells = (
        {(c.model, c.task, c.temperature): c for c in collect_cells([s]) if c.batch_size == 1}
        for s in (base_src, new_src)
    )
    rows: list[Row] = []
    only_base, only_new = [], []
    for key in sorted(base_cells.keys() | new_cells.keys()):
        b, n = base_cells.get(key), new_cells.get(key)
        b_methods, n_methods = (b.by_method if b else {}), (n.by_method if n else {})
        for method in sorted(b_methods.keys() | n_methods.keys(), key=_vanilla_first):
            if method not in n_methods:
                only_base.append(_label(*key, method))
            elif method not in b_methods:
                only_new.append(_label(*key, method))
            else:
                assert b is not None and n is not None  # both list the method
                got_rows, got_base, got_new = _rows(b, n, method, limits)
                rows += got_rows
                only_base += got_base
                only_new += got_new
    if not rows:
        raise SpecbenchError(
            f"{baseline} and {new} share no (model, task, temperature, method) with common "
            "questions: nothing to compare"
        )
    return Comparison(
        base_src, new_src, limits, rows, only_base, only_new, differ, _differences(base_src, new_src, SOFTWARE_KEYS)
    )


# ---------------------------------------------------------------- output


def _pct(change: metrics.Speedup) -> str:
    """`-9.8% [-11.0%, -8.6%]`: a paired ratio as a relative change with its 95% interval."""
    return f"{change.value - 1:+.1%} [{change.low - 1:+.1%}, {change.high - 1:+.1%}]"


def _change(change: metrics.Speedup | None) -> str:
    if change is None or change.pairs == 0:
        return MISSING
    mark = "" if change.pairs < MIN_PAIRS else DOWN if change.high < 1 else UP if change.low > 1 else ""
    return f"{metrics.format_ratio(change.value, change.low, change.high, digits=3)} {mark}".rstrip()


def _pair(values: tuple, spec: str) -> str:
    return " → ".join(MISSING if math.isnan(v) else format(v, spec) for v in values)


def _verdict(row: Row) -> str:
    if row.failures:
        return "**FAIL**"
    return "ok" if row.speed_judged else f"ok (speed not judged: < {MIN_PAIRS} pairs)"


def _table(rows: list[Row]) -> str:
    header = [
        "method",
        "category",
        "pairs",
        "tokens/s",
        "tokens/s change [95% CI]",
        "speedup over vanilla",
        "speedup change [95% CI]",
        "τ",
        "real mismatches",
        "verdict",
    ]
    body = [
        [
            r.method,
            r.category,
            str(r.throughput.pairs),
            _pair(r.tokens_per_s, ".1f"),
            _change(r.throughput),
            _pair(tuple(s.value for s in r.speedup), ".2f") if r.speedup else MISSING,
            _change(r.speedup_change),
            _pair(r.tau, ".2f"),
            _pair(r.bugs, "d") if r.bugs else MISSING,
            _verdict(r),
        ]
        for r in rows
    ]
    return md_table(header, body, left=2)


def to_markdown(c: Comparison) -> str:
    """The comparison as Markdown: sources, limits, one table per cell, unmatched cells, verdict."""
    lim = c.limits
    speed = "the speedup over vanilla" if lim.speedup_only else "tokens/s or the speedup over vanilla"
    md = ["# specbench compare", "", f"- baseline: {source_line(c.baseline)}", f"- new: {source_line(c.new)}", ""]
    if c.software_differences:
        md += [f"Software differs: {'; '.join(c.software_differences)}.", ""]
    loads = [((s.manifest or {}).get("machine") or {}).get("load_average") for s in (c.baseline, c.new)]
    if any(load is not None for load in loads):
        baseline, new = ("unknown" if load is None else f"{load:.1f}" for load in loads)
        md += [
            f"Load average when the runs started (a busy machine distorts timings): baseline {baseline}, new {new}.",
            "",
        ]
    if c.machine_differences:
        md += [
            f"**Machines differ** (allowed by --allow-different-machines): {'; '.join(c.machine_differences)}. "
            "Absolute tokens/s are not comparable; the speedups over vanilla are.",
            "",
        ]
    md += [
        f"A row fails when {speed} drops by more than {lim.max_slowdown:.0%} and the 95% interval of "
        f"the change (over questions, paired by id; Student's t floored by both runs' A/A noise, a category's spread "
        f"pooled over the categories) excludes no "
        f"change; when τ new/baseline falls below {lim.min_tau_ratio:g}; or when a lossless method has more real "
        f"greedy mismatches with vanilla than in the baseline. Speed is judged only over at least {MIN_PAIRS} "
        f"shared questions. {DOWN}/{UP}: a change beyond noise (interval below/above 1).",
        "",
    ]
    cells: dict[str, list[Row]] = {}
    for r in c.rows:
        cells.setdefault(_label(r.model, r.task, r.temperature), []).append(r)
    for title, rows in cells.items():
        md += [f"## {title}", "", _table(rows), ""]
    if c.only_in_baseline or c.only_in_new:
        md += ["## Only in one run" + (" (fails with --strict)" if lim.strict else " (not compared)"), ""]
        md += [f"- only in baseline: {x}" for x in c.only_in_baseline]
        md += [f"- only in new: {x}" for x in c.only_in_new]
        md += [""]
    failures = c.failures
    md += [f"## Verdict: {'FAIL' if failures else 'PASS'}", ""]
    unjudged = sum(not r.speed_judged for r in c.rows)
    note = f"; {unjudged} of them not judged on speed (fewer than {MIN_PAIRS} shared questions)" if unjudged else ""
    md += [f"- {f}" for f in failures] or [f"All {len(c.rows)} rows within limits{note}."]
    return "\n".join(md)


def _finite(x):
    """JSON has no NaN: not-a-number becomes null, tuples become lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _run_json(s: Source) -> dict:
    manifest = s.manifest or {}
    return {"path": str(s.path), "config": manifest.get("config"), "machine": manifest.get("machine")}


def to_json(c: Comparison) -> dict:
    """The comparison as plain data (for `--json`): every row with its numbers, failures and the verdict."""
    return _finite(
        {
            "baseline": _run_json(c.baseline),
            "new": _run_json(c.new),
            "limits": asdict(c.limits),
            "machine_differences": c.machine_differences,
            "software_differences": c.software_differences,
            "rows": [{**asdict(r), "tau_ratio": r.tau_ratio, "speed_judged": r.speed_judged} for r in c.rows],
            "only_in_baseline": c.only_in_baseline,
            "only_in_new": c.only_in_new,
            "failures": c.failures,
            "passed": c.passed,
        }
    )
