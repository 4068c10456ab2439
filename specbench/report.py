"""Reports: Markdown and LaTeX tables plus plots from run folders or Spec-Bench answer files.

Every number comes from `metrics`; this module only groups answers into cells and formats them.
A cell is (source, model, task, temperature); its baseline is `vanilla` from the same source.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter

from . import metrics
from .results import Answer
from .sources import Source, load_sources
from .tasks import groups as task_groups

BASELINE = "vanilla"
OVERALL = "overall"
TEX_LABELS = {"mt_bench": "MT", "translation": "Trans", "summarization": "Summ", "qa": "QA",
              "math_reasoning": "Math", "rag": "RAG", OVERALL: "Overall"}
EXTRA_COLORS = ("#17becf", "#393b79", "#ad494a", "#637939", "#8c6d31", "#7b4173", "#3182bd", "#e6550d",
                "#31a354", "#756bb1")
TIME_COLORS = ("#525252", "#bdbdbd", "#ffffff")  # draft, verify, other: greys, so no method colour is reused
ALPHA_DEPTH = 5
NA = "n/a"  # no baseline to compare with
MISSING = "—"  # not recorded


# ---------------------------------------------------------------- numbers


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
        return _slug(self.source.name, self.model, self.task, f"t{self.temperature:g}")

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


def _slug(*parts: str) -> str:
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


def _from_spec_bench(a: Answer) -> bool:
    """Written by Spec-Bench itself (none of our per-step fields)."""
    return a.seed is None and a.tree_size is None and a.draft_time is None


# ---------------------------------------------------------------- formatting


def fmt_speedup(s: metrics.Speedup) -> str:
    """`2.31× [2.10, 2.55]`: the paired speedup with its 95% interval."""
    if s.pairs == 0 or math.isnan(s.value):
        return NA
    return metrics.format_ratio(s.value, s.low, s.high)


def fmt_ratio(x: float) -> str:
    return NA if math.isnan(x) else metrics.format_ratio(x)


def _num(x: float | None, spec: str, none: str = MISSING) -> str:
    return none if x is None or math.isnan(x) else format(x, spec)


def md_table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A Markdown table (pandas through tabulate): the first `left` columns left-aligned, the rest right."""
    align = ["left"] * left + ["right"] * (len(header) - left)
    table = pd.DataFrame(rows, columns=header)
    return table.to_markdown(index=False, tablefmt="pipe", colalign=align, disable_numparse=True)


def leaderboard_md(cell: Cell) -> str:
    cats = cell.groups
    rows = [[s.display, *(fmt_speedup(s.paired[c]) for c in cats), f"{s.tau:.2f}", fmt_speedup(s.paired[OVERALL])]
            for s in cell.ranked()]
    if not rows:
        return f"Only `{BASELINE}` was run here: nothing to compare."
    return md_table(["method", *cats, "τ", "Overall"], rows)


def spec_bench_md(cell: Cell) -> str:
    cats = [*cell.groups, OVERALL]
    rows = [[s.display, *(fmt_ratio(s.spec_bench[c]) for c in cats)] for s in cell.ranked()]
    return md_table(["method", *cats[:-1], "Overall"], rows) if rows else ""


def detail_rows(cell: Cell) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-method detail table, the one source of its Markdown and LaTeX forms."""
    stats = list(cell.stats.values())
    alphas = {s.method: metrics.acceptance_by_position(s.answers, ALPHA_DEPTH) for s in stats}
    show_alpha = any(alphas.values())
    show_roof = cell.source.profile is not None
    header = ["method", "questions", "τ", "tokens/s", "mean tree size", "draft share"]
    header += [f"α_{k}" for k in range(1, ALPHA_DEPTH + 1)] if show_alpha else []
    header += ["roofline efficiency"] if show_roof else []
    rows = []
    for s in stats:
        row = [s.display, str(len(s.answers)), f"{s.tau:.2f}", f"{metrics.tokens_per_second(s.answers):.1f}",
               _num(mean_tree_size(s.answers), ".1f"), _num(draft_share(s.answers), ".1%")]
        if show_alpha:
            a = alphas[s.method]
            row += [_num(a[k] if k < len(a) else None, ".2f") for k in range(ALPHA_DEPTH)]
        if show_roof:
            roof = roofline(cell, s)
            row.append(_num(roof, ".0%", NA if cell.baseline is None else MISSING))
        rows.append(row)
    return header, rows


def detail_md(cell: Cell) -> str:
    return md_table(*detail_rows(cell))


def lossless_md(cells: list[Cell]) -> str:
    rows = []
    for cell in cells:
        if cell.temperature != 0:
            continue
        for s in cell.ranked():
            check = metrics.losslessness(s.answers)
            where = [cell.source.label, cell.model, cell.task, s.display]
            if check.questions == 0:
                rows.append([*where, "not checked", MISSING, MISSING, MISSING])
            else:
                bugs = f"**{check.bugs}**" if check.bugs and not s.lossy else str(check.bugs)
                rows.append([*where, str(check.questions), f"{check.exact_rate:.1%}", str(check.near_ties), bugs])
    if not rows:
        return "No temperature-0 runs of a method other than vanilla."
    return md_table(["run", "model", "task", "method", "questions checked", "exact match", "near-tie divergences",
                     "mismatches (bugs)"], rows, left=4)


def _tex(text: str) -> str:
    return re.sub(r"([_&%#$])", r"\\\1", text).replace("~", r"\textasciitilde{}")


def _tex_speedup(s: metrics.Speedup) -> str:
    if s.pairs == 0 or math.isnan(s.value):
        return NA
    return metrics.format_ratio(s.value, s.low, s.high, times="$\\times$", interval="\\,{{\\scriptsize[{}, {}]}}")


def _tabular(comment: str, header: list[str], rows: list[list[str]]) -> str:
    """A booktabs tabular (pandas' Styler): the first column left-aligned, the rest right; cells already LaTeX."""
    styled = pd.DataFrame(rows, columns=header).style.hide(axis="index")
    return f"% {comment}\n" + styled.to_latex(column_format="l" + "r" * (len(header) - 1), hrules=True).rstrip()


def leaderboard_tex(cell: Cell) -> str:
    cats = cell.groups
    head = ["Method", *(_tex(TEX_LABELS.get(c, c)) for c in cats), r"$\tau$", "Overall"]
    rows = [[_tex(s.display), *(_tex_speedup(s.paired[c]) for c in cats), f"{s.tau:.2f}",
             _tex_speedup(s.paired[OVERALL])] for s in cell.ranked()]
    return _tabular(f"{cell.title}: paired speedup over vanilla (geometric mean, 95% bootstrap CI); tau = mean "
                    "accepted length", head, rows)


def _tex_header(name: str) -> str:
    if name == "τ":
        return r"$\tau$"
    if name.startswith("α_"):
        return f"$\\alpha_{{{name[2:]}}}$"
    return _tex(name.capitalize())


def detail_tex(cell: Cell) -> str:
    """The per-method detail table in LaTeX, from the same rows as its Markdown form."""
    header, rows = detail_rows(cell)
    return _tabular(f"{cell.title}: per-method detail", [_tex_header(h) for h in header],
                    [[_tex(c) for c in row] for row in rows])


# ---------------------------------------------------------------- plots


def method_colors(methods: set[str]) -> dict[str, str]:
    """The colours implementations registered for their own names (a variant such as sps-68m or eagle2[top_k=6]
    takes its family's colour when the family itself is absent), then a fixed order of extra colours for the
    others, sorted by name."""
    from .methods import registry  # importing the methods registers their colours

    colors = {name: impl.color for name, impl in registry.IMPLEMENTATIONS.items() if impl.color}
    out = {m: colors[m] for m in methods if m in colors}
    rest = sorted(methods - set(out))
    for m in rest:
        family = m.split("[")[0].split("-")[0]
        if family in colors and family not in methods and colors[family] not in out.values():
            out[m] = colors[family]
    for i, m in enumerate(m for m in rest if m not in out):
        out[m] = EXTRA_COLORS[i % len(EXTRA_COLORS)]
    return out


def _yerr(speedups: list[metrics.Speedup]) -> np.ndarray:
    """Matplotlib error bars from 95% intervals."""
    return np.array([[p.value - p.low for p in speedups], [p.high - p.value for p in speedups]])


def _display(cells: list[Cell], method: str) -> str:
    return next(c.stats[method].display for c in cells if method in c.stats)


def _save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    fig.tight_layout()
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    return paths


def plot_speedups(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Grouped bars: category on x, one bar per method, 95% CI as error bars, a dashed line at 1."""
    rows = cell.ranked()
    if cell.baseline is None or not rows:
        return []
    cats = [*cell.groups, OVERALL]
    fig = Figure(figsize=(max(6.0, 1.1 * len(cats) + 0.4 * len(rows)), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / len(rows)
    x = np.arange(len(cats))
    for i, s in enumerate(rows):
        sp = [s.paired[c] for c in cats]
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, [p.value for p in sp], width, yerr=_yerr(sp), capsize=2,
               label=s.display, color=colors[s.method])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(x, [c.replace("_", " ") for c in cats])
    ax.set_ylabel("speedup over vanilla (×)")
    ax.set_title(f"Paired speedup, 95% CI\n{cell.title}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, stem)


def plot_accept_lengths(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Share of decoding steps by accepted length, one bar per method at each length."""
    stats = _drafting(cell)
    lengths = {m.method: np.concatenate([a.accept_lengths for a in m.answers]).astype(int) for m in stats}
    lengths = {m: v for m, v in lengths.items() if v.size}
    if not lengths:
        return []
    top = max(int(v.max()) for v in lengths.values())
    x = np.arange(1, top + 1)
    fig = Figure(figsize=(min(12.0, max(6.0, 0.4 * top + 2)), 4.0))
    ax = fig.add_subplot()
    width = 0.8 / len(lengths)
    for i, (m, v) in enumerate(lengths.items()):
        share = np.bincount(v, minlength=top + 1)[1:] / v.size
        ax.bar(x + (i - (len(lengths) - 1) / 2) * width, share, width, color=colors[m],
               label=f"{m} (τ={cell.stats[m].tau:.2f})")
    ax.set_xticks(x)
    ax.set_xlabel("tokens accepted per step (target's own token included)")
    ax.set_ylabel("share of steps")
    ax.set_title(f"Accepted length per step\n{cell.title}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, stem)


def _drafting(cell: Cell) -> list[MethodStats]:
    """The methods other than vanilla, or vanilla alone when nothing else ran."""
    return [s for s in cell.stats.values() if s.method != BASELINE] or list(cell.stats.values())


def plot_acceptance(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Per-position acceptance alpha_k against draft depth k, one line per method that drafts."""
    curves = [(s, metrics.acceptance_by_position(s.answers)) for s in cell.stats.values()]
    curves = [(s, alpha) for s, alpha in curves if alpha]
    if not curves:
        return []
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.add_subplot()
    for s, alpha in curves:
        ax.plot(range(1, len(alpha) + 1), alpha, marker="o", color=colors[s.method], label=s.display)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft depth k")
    ax.set_ylabel("acceptance rate α_k")
    ax.set_title(f"Per-position acceptance\n{cell.title}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, stem)


def plot_tau_vs_tree(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """tau against the mean verified tree size, one point per method; the diagonal accepts every verified token."""
    points = [(s, mean_tree_size(s.answers)) for s in cell.stats.values()]
    points = [(s, size) for s, size in points if size is not None]
    if not points:
        return []
    fig = Figure(figsize=(5.5, 4.2))
    ax = fig.add_subplot()
    diagonal = np.geomspace(1, max(size for _, size in points), 50)
    ax.plot(diagonal, diagonal, color="black", linestyle="--", linewidth=1, label="every verified token accepted")
    for s, size in points:
        ax.scatter(size, s.tau, s=40, color=colors[s.method], label=s.display, zorder=3)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.set_ylim(0.8, 1.2 * max(s.tau for s, _ in points))
    ax.set_xlabel("mean verified tree size (tokens per target forward)")
    ax.set_ylabel("τ (mean accepted length)")
    ax.set_title(f"τ against verification cost\n{cell.title}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, stem)


def plot_time_split(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Stacked bars: milliseconds per generated token in drafting, verification and the rest of the wall time."""
    stats = [s for s in cell.stats.values() if draft_share(s.answers) is not None]
    if not stats:
        return []
    parts = {"draft": [], "verify": [], "other (prefill, loop)": []}
    for s in stats:
        tokens = sum(sum(a.new_tokens) for a in s.answers)
        draft, verify = (sum(getattr(a, f) for a in s.answers) for f in ("draft_time", "verify_time"))
        wall = sum(sum(a.wall_time) for a in s.answers)
        for key, seconds in zip(parts, (draft, verify, wall - draft - verify), strict=True):
            parts[key].append(1000 * seconds / tokens)
    fig = Figure(figsize=(max(5.0, 0.9 * len(stats) + 2), 4.2))
    ax = fig.add_subplot()
    x = np.arange(len(stats))
    bottom = np.zeros(len(stats))
    for (key, values), color in zip(parts.items(), TIME_COLORS, strict=True):
        ax.bar(x, values, 0.6, bottom=bottom, label=key, color=color, edgecolor="black", linewidth=0.5)
        bottom += values
    ax.set_xticks(x, [s.display for s in stats])
    for tick, s in zip(ax.get_xticklabels(), stats, strict=True):
        tick.set_color(colors[s.method])
    ax.set_ylabel("milliseconds per generated token")
    ax.set_title(f"Where the time goes (bar height = 1 / tokens/s)\n{cell.title}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, stem)


def plot_roofline(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Roofline efficiency per method: measured speedup / the overhead-free speedup at the same tau."""
    bars = [(s, roofline(cell, s)) for s in _drafting(cell)]
    bars = [(s, value) for s, value in bars if value is not None]
    if not bars:
        return []
    fig = Figure(figsize=(max(5.0, 0.9 * len(bars) + 2), 4.0))
    ax = fig.add_subplot()
    x = np.arange(len(bars))
    ax.bar(x, [100 * value for _, value in bars], 0.6, color=[colors[s.method] for s, _ in bars])
    ax.axhline(100, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(x, [s.display for s, _ in bars])
    ax.set_ylabel("roofline efficiency (%)")
    ax.set_title(f"Speedup reached / overhead-free speedup at the same τ\n{cell.title}", fontsize=10)
    return _save(fig, out_dir, stem)


def plot_speedup_vs_temperature(cells: list[Cell], colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Overall paired speedup against temperature, one line per method, for cells of one source, model and task."""
    cells = sorted((c for c in cells if c.baseline is not None and c.ranked()), key=lambda c: c.temperature)
    if len(cells) < 2:
        return []
    fig = Figure(figsize=(6.0, 4.2))
    ax = fig.add_subplot()
    for m in sorted({s.method for c in cells for s in c.ranked()}):
        having = [c for c in cells if m in c.stats]
        sp = [c.stats[m].paired[OVERALL] for c in having]
        ax.errorbar([c.temperature for c in having], [p.value for p in sp], yerr=_yerr(sp), capsize=3, marker="o",
                    color=colors[m], label=_display(having, m))
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("temperature")
    ax.set_ylabel("speedup over vanilla (×)")
    c = cells[0]
    ax.set_title(f"Paired speedup against temperature, 95% CI\n{c.source.label} · {c.model} · {c.task}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, stem)


def plot_overview(cells: list[Cell], colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Overall paired speedup of every method in every cell side by side (runs, models, machines, temperatures)."""
    cells = [c for c in cells if c.baseline is not None and c.ranked()]
    if len(cells) < 2:
        return []
    methods = sorted({s.method for c in cells for s in c.ranked()})
    fig = Figure(figsize=(max(6.0, 1.2 * len(cells) + 0.3 * len(methods) * len(cells)), 4.6))
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j for j, c in enumerate(cells) if m in c.stats]
        sp = [cells[j].stats[m].paired[OVERALL] for j in xs]
        ax.bar(np.array(xs) + (i - (len(methods) - 1) / 2) * width, [p.value for p in sp], width, yerr=_yerr(sp),
               capsize=2, color=colors[m], label=_display(cells, m))
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(cells)), [f"{c.source.label}\n{c.model} · {c.task}\nT={c.temperature:g}" for c in cells],
                  fontsize=8)
    ax.set_ylabel("speedup over vanilla (×)")
    ax.set_title("Overall paired speedup, 95% CI, every run side by side (speedups never mix runs)", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, stem)


# ---------------------------------------------------------------- the report


FOOTNOTES = """\
- **Speedup (paired, the headline)**: geometric mean over questions of tokens/s of the method on a question ÷
  tokens/s of vanilla on the same question (paired by question id), same source, model, task and temperature;
  95% percentile-bootstrap interval over questions in brackets. **Overall** pools every question of the cell
  (it is not the mean of the category columns). `n/a`: no vanilla answers (or no shared questions) to compare with.
- **Speedup (Spec-Bench definition)**: mean of per-question tokens/s of the method ÷ mean of per-question tokens/s
  of vanilla within a category, unpaired, as in Spec-Bench's `speed.py`; one run, not Spec-Bench's mean of 3.
- **τ (mean accepted length)**: Σ new tokens / Σ decoding steps (target forwards after prefill), the target's
  own bonus or corrected token included, so vanilla is 1.00. Comparable across machines; speedups are not.
  Published τ from the EAGLE, Medusa and Lookahead scripts counts differently: the token their prefill yields is
  free (their first tree hangs from it; ours from the last prompt token, one more forward), and their loops may
  count tokens drafted past the stop token or the budget, which we cut before counting. So on a short answer our τ
  is a little lower than theirs for the same accepted trees (the reference traces agree step by step).
- **tokens/s**: Σ new tokens / Σ wall time; wall time runs from the start of prefill to the last accepted token.
- **mean tree size**: tokens sent to the target per verification forward, averaged over steps.
- **draft share**: Σ draft time / (Σ draft time + Σ verify time).
- **time split** (figure): Σ draft time, Σ verify time and the rest of Σ wall time (the target's prefill, the loop
  itself) per generated token; a bar's height is 1 / tokens/s.
- **α_k**: among steps whose draft reached depth k, the share that accepted the k-th draft token (for a tree,
  along the accepted path).
- **roofline efficiency**: overall paired speedup ÷ τ·T(1) / (T(n) + D), the speedup an overhead-free loop would
  reach at the same τ. T(k) is the target's median forward time over k new tokens (`forward_profile.json`), n the
  mean tree size (T linearly interpolated between measured sizes), D = Σ draft time / Σ decoding steps.
- **Losslessness (temperature 0)**: each method's tokens are compared with vanilla's, question by question. A
  first divergence where the target's top-1/top-2 logit margin is below a small dtype-dependent threshold is a
  near-tie (numerical divergence from different kernel shapes); one with a clear margin is a real mismatch, a bug.
  Lossy acceptance rules (e.g. typical acceptance) are marked "(lossy)": they are not expected to match.
- `—`: not recorded by this source."""

SPEC_BENCH_NOTE = """\
- **Spec-Bench answer files**: token counts are taken from `new_tokens` as recorded for every method, baseline
  included. Spec-Bench's own `speed.py` re-tokenises the baseline's text instead (which needs the model's
  tokenizer), so its numbers can differ slightly. These files carry no draft/verify times, tree sizes, per-step
  draft depths or greedy checks, so those columns are `—` or "not checked"."""


CELL_PLOTS = (("speedup_by_category", plot_speedups), ("accept_length_hist", plot_accept_lengths),
              ("acceptance_by_position", plot_acceptance), ("tau_vs_tree_size", plot_tau_vs_tree),
              ("time_split", plot_time_split), ("roofline", plot_roofline))


def _plots(cells: list[Cell], out_dir: Path) -> list[tuple[str, list[Path]]]:
    """(heading, figure files): every cell side by side, speedup against temperature per run, model and task,
    then each cell's own figures. One colour per method in all of them."""
    colors = method_colors({m for c in cells for m in c.by_method})
    out = [("Every run side by side", plot_overview(cells, colors, out_dir, "speedup_overview"))]
    groups: dict[tuple[str, str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.source.name, c.model, c.task), []).append(c)
    for key, group in groups.items():
        stem = "speedup_vs_temperature" + (f"-{_slug(*key)}" if len(groups) > 1 else "")
        title = f"{group[0].source.label} · {group[0].model} · {group[0].task}: speedup against temperature"
        out.append((title, plot_speedup_vs_temperature(group, colors, out_dir, stem)))
    for cell in cells:
        suffix = f"-{cell.slug}" if len(cells) > 1 else ""
        out.append((cell.title, [p for name, plot in CELL_PLOTS for p in plot(cell, colors, out_dir, name + suffix)]))
    return [(heading, paths) for heading, paths in out if paths]


def source_line(s: Source) -> str:
    """`**name (device)**: `path` (dtype, torch, transformers)`."""
    extra = []
    if s.manifest:
        cfg, mach = s.manifest.get("config", {}), s.manifest.get("machine", {})
        extra = [f"{k} {v}" for k, v in (("dtype", cfg.get("dtype")), ("torch", mach.get("torch")),
                                          ("transformers", mach.get("transformers"))) if v]
    return f"**{s.label}**: `{s.path}`" + (f" ({', '.join(extra)})" if extra else "")


def _sources_md(sources: list[Source]) -> str:
    """One bullet per source; below it the hub revisions it loaded and the methods `all` skipped (why)."""
    lines = []
    for s in sources:
        lines.append(f"- {source_line(s)}")
        manifest = s.manifest or {}
        for role, ck in (manifest.get("checkpoints") or {}).items():
            if ck.get("revision"):
                lines.append(f"  - {role}: `{ck['source']}` at revision `{ck['revision']}`")
        lines += [f"  - skipped {name}: {why}" for name, why in (manifest.get("skipped") or {}).items()]
    return "\n".join(lines)


NOISE_FLOOR = "vanilla-aa"  # the runner's A/A column: vanilla timed twice per question in the same interleaving


def _notes(cells: list[Cell]) -> list[str]:
    notes = [f"- {c.missing_baseline}" for c in cells if c.missing_baseline]
    for c in cells:
        aa = c.stats.get(NOISE_FLOOR)
        if aa is not None and c.baseline is not None:
            notes.append(f"- {c.title}: noise floor (A/A: vanilla timed again in the same interleaving) "
                         f"{fmt_speedup(aa.paired[OVERALL])}; speedups inside it are not differences")
        cpus = ((c.source.manifest or {}).get("machine") or {}).get("cpu_count") or 1
        timed = [a for answers in c.by_method.values() for a in answers if a.busy_cpus is not None]
        busy = [a for a in timed if a.busy_cpus > metrics.BUSY_SHARE * cpus]
        if busy:
            notes.append(f"- {c.title}: **busy machine**: {len(busy)} of {len(timed)} answers were timed while other "
                         f"processes kept more than {metrics.BUSY_SHARE * cpus:.1f} of {cpus} CPUs busy; its "
                         "timings and speedups are not trustworthy")
    return notes


def write_profiles(cells: list[Cell], out_dir: Path) -> list[Path]:
    """Each method's acceptance profile per cell as SPEED-Bench's tools read it:
    `<out_dir>/<cell>/<method>/speculation_profile.json`."""
    written = []
    for c in cells:
        for method, answers in c.by_method.items():
            if method in (BASELINE, NOISE_FLOOR):
                continue
            deepest = max((d for a in answers for d in (a.tested or [])), default=0)
            k = max(deepest, max((n for a in answers for n in a.accept_lengths), default=1) - 1, 1)
            profile = metrics.speculation_profile(answers, k, method)
            profile["target_model"] = {"id": c.model}
            profile["draft_checkpoint"] = None
            config = (c.source.manifest or {}).get("config") or {}
            profile["measurement_conditions"] = {"tool": "specbench", "task": c.task, "temperature": c.temperature,
                                                 "device_name": c.source.device, "dtype": config.get("dtype")}
            path = out_dir / c.slug / method / "speculation_profile.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
            written.append(path)
    return written


def summary(sources: list[Path]) -> str:
    """The leaderboard table(s) as Markdown, for the terminal."""
    cells = collect_cells(load_sources(sources))
    parts = [f"{c.title}: paired speedup over vanilla [95% CI]\n\n{leaderboard_md(c)}" for c in cells]
    return "\n\n".join(parts + _notes(cells))


def build_report(sources: list[Path], out_dir: Path, title: str | None = None) -> Path:
    """Write report.md, tables.tex and the plots (PNG and PDF) into out_dir; returns report.md's path."""
    loaded = load_sources(sources)
    cells = collect_cells(loaded)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = _plots(cells, out_dir)
    title = title or "Speculative decoding report: " + ", ".join(s.name for s in loaded)

    md = [f"# {title}", "", "## Sources", "", _sources_md(loaded), ""]
    if len(loaded) > 1:
        md += ["Each source is a separate run (possibly another machine): speedups are never computed across "
               "sources; compare τ across machines, speedups only within one.", ""]
    if notes := _notes(cells):
        md += ["## Notes", "", *notes, ""]
    md += ["## Leaderboard: paired speedup over vanilla [95% CI]", ""]
    for c in cells:
        md += [f"### {c.title}", "", leaderboard_md(c), ""]
    md += ["## Speedup, Spec-Bench definition (unpaired; for comparison with published leaderboards)", ""]
    for c in cells:
        if c.ranked():
            md += [f"### {c.title}", "", spec_bench_md(c), ""]
    md += ["## Per-method detail", ""]
    for c in cells:
        md += [f"### {c.title}", "", detail_md(c), ""]
    md += ["## Losslessness at temperature 0", "", lossless_md(cells), ""]
    md += ["## Plots (PNG shown; PDF beside each)", ""]
    for heading, paths in plots:
        md += [f"### {heading}", ""]
        md += [line for p in paths if p.suffix == ".png" for line in (f"![{p.stem}]({p.name})", "")]
    md += ["## Definitions", "", FOOTNOTES]
    if any(_from_spec_bench(a) for s in loaded for a in s.answers):
        md += [SPEC_BENCH_NOTE]
    report = out_dir / "report.md"
    report.write_text("\n".join(md) + "\n", encoding="utf-8")

    write_profiles(cells, out_dir / "speculation_profiles")
    tex = ["% Tables generated by specbench.report; needs \\usepackage{booktabs}", ""]
    tex += [leaderboard_tex(c) + "\n" for c in cells if c.ranked()]
    tex += [detail_tex(c) + "\n" for c in cells]
    (out_dir / "tables.tex").write_text("\n".join(tex), encoding="utf-8")
    return report
