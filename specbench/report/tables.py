"""Tables of cells, each built once as rows and rendered as Markdown (pandas through tabulate) and LaTeX
(pandas' Styler: booktabs, escaped cells)."""

from __future__ import annotations

import math
import re

import pandas as pd

from . import metrics
from .cells import BASELINE, MISSING, NA, OVERALL, Cell, draft_share, mean_tree_size, roofline

TEX_LABELS = {
    "mt_bench": "MT",
    "translation": "Trans",
    "summarization": "Summ",
    "qa": "QA",
    "math_reasoning": "Math",
    "rag": "RAG",
    OVERALL: "Overall",
}
ALPHA_DEPTH = 5  # per-position acceptance columns


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
    rows = [
        [s.display, *(fmt_speedup(s.paired[c]) for c in cats), f"{s.tau:.2f}", fmt_speedup(s.paired[OVERALL])]
        for s in cell.ranked()
    ]
    if not rows:
        return f"Only `{BASELINE}` was run here: nothing to compare."
    return md_table(["method", *cats, "τ", "Overall"], rows)


def tuned_md(cell: Cell) -> str:
    """Each tuned method beside its default (a run with --tuned): speedups, tau and what tuning predicted."""
    tuned = (cell.source.manifest or {}).get("tuned") or {}
    rows = []
    for method, entry in tuned.items():
        default, mine = cell.stats.get(method), cell.stats.get(entry["variant"])
        if default is None or mine is None:
            continue
        predicted = entry.get("predicted")
        rows.append(
            [
                method,
                fmt_speedup(default.paired[OVERALL]),
                f"{default.tau:.2f}",
                entry["variant"],
                fmt_speedup(mine.paired[OVERALL]),
                f"{mine.tau:.2f}",
                fmt_ratio(predicted) if predicted is not None else NA,
            ]
        )
    header = ["method", "default", "τ", "tuned variant", "tuned", "τ (tuned)", "predicted by tune"]
    return md_table(header, rows) if rows else ""


def schedule_md(cell: Cell) -> str:
    """Each method whose verification was scheduled (DSpark's `confidence_threshold` or `verify: adaptive`): per
    step, the tokens drafted, those verified and those accepted, and the share of drafted tokens never verified."""
    rows = []
    for s in cell.stats.values():
        steps = s.steps.dropna(subset=["drafted"]) if "drafted" in s.steps else s.steps.iloc[:0]
        if steps.empty:
            continue
        drafted, verified = steps.drafted.astype(float), steps.tree_size.astype(float) - 1
        accepted = steps.accepted.astype(float) - 1
        rows.append(
            [
                s.display,
                f"{drafted.mean():.2f}",
                f"{verified.mean():.2f}",
                f"{accepted.mean():.2f}",
                f"{(drafted - verified).sum() / max(drafted.sum(), 1):.0%}",
                f"{s.tau:.2f}",
            ]
        )
    header = ["method", "drafted / step", "verified / step", "accepted / step", "drafted, not verified", "τ"]
    return md_table(header, rows) if rows else ""


def spec_bench_md(cell: Cell) -> str:
    cats = [*cell.groups, OVERALL]
    rows = [[s.display, *(fmt_ratio(s.spec_bench[c]) for c in cats)] for s in cell.ranked()]
    return md_table(["method", *cats[:-1], "Overall"], rows) if rows else ""


def detail_rows(cell: Cell) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-method detail table, the one source of its Markdown and LaTeX forms."""
    stats = list(cell.stats.values())
    alphas = {s.method: metrics.acceptance_by_position(s.steps, ALPHA_DEPTH) for s in stats}
    show_alpha = any(alphas.values())
    show_roof = cell.source.profile is not None
    header = ["method", "questions", "τ", "tokens/s", "mean tree size", "draft share"]
    header += [f"α_{k}" for k in range(1, ALPHA_DEPTH + 1)] if show_alpha else []
    header += ["roofline efficiency"] if show_roof else []
    rows = []
    for s in stats:
        row = [
            s.display,
            str(s.questions),
            f"{s.tau:.2f}",
            f"{metrics.tokens_per_second(s.turns):.1f}",
            _num(mean_tree_size(s.steps), ".1f"),
            _num(draft_share(s.turns, s.steps), ".1%"),
        ]
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
    rows, cost_only = [], False
    for cell in cells:
        if cell.temperature != 0:
            continue
        cost_only |= any(s.synthetic for s in cell.ranked())
        for s in [s for s in cell.ranked() if not s.synthetic]:  # cost-only tokens are not the target's
            check = metrics.losslessness(s.turns)
            where = [cell.source.label, cell.model, cell.task, s.display]
            if check.questions == 0:
                rows.append([*where, "not checked", MISSING, MISSING, MISSING])
            else:
                bugs = f"**{check.bugs}**" if check.bugs and not s.lossy else str(check.bugs)
                rows.append([*where, str(check.questions), f"{check.exact_rate:.1%}", str(check.near_ties), bugs])
    if not rows:
        real = " with real acceptance (cost-only answers are never checked)" if cost_only else ""
        return f"No temperature-0 runs of a method other than vanilla{real}."
    return md_table(
        [
            "run",
            "model",
            "task",
            "method",
            "questions checked",
            "exact match",
            "numerical divergences",
            "mismatches (bugs)",
        ],
        rows,
        left=4,
    )


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
    rows = [
        [_tex(s.display), *(_tex_speedup(s.paired[c]) for c in cats), f"{s.tau:.2f}", _tex_speedup(s.paired[OVERALL])]
        for s in cell.ranked()
    ]
    return _tabular(
        f"{cell.title}: paired speedup over vanilla (geometric mean, 95% CI: t, categories' spread pooled, "
        "A/A noise floor; none for one question); tau = mean accepted length",
        head,
        rows,
    )


def _tex_header(name: str) -> str:
    if name == "τ":
        return r"$\tau$"
    if name.startswith("α_"):
        return f"$\\alpha_{{{name[2:]}}}$"
    return _tex(name.capitalize())


def detail_tex(cell: Cell) -> str:
    """The per-method detail table in LaTeX, from the same rows as its Markdown form."""
    header, rows = detail_rows(cell)
    return _tabular(
        f"{cell.title}: per-method detail", [_tex_header(h) for h in header], [[_tex(c) for c in row] for row in rows]
    )


def concurrency_md(levels: pd.DataFrame) -> str:
    """One task and temperature of an engine run's sweeps (`concurrency.levels`): a row per method and level."""
    rows = [
        [
            r.method,
            str(r.concurrency),
            str(r.requests),
            f"{r.throughput:.1f}",
            f"{r.per_user:.1f}",
            fmt_ratio(r.speedup),
            f"{r.tau:.2f}",
            _num(1000 * r.ttft, ".0f"),
            _num(1000 * r.tpot, ".1f"),
            f"{r.latency:.2f}",
        ]
        for r in levels.sort_values(["method", "concurrency"], key=_vanilla_first).itertuples()
    ]
    header = [
        "method",
        "in flight",
        "requests",
        "tokens/s",
        "per-user tokens/s",
        "× vanilla",
        "τ",
        "TTFT ms (median)",
        "ms per token (mean)",
        "latency s (mean)",
    ]
    return md_table(header, rows)


def _vanilla_first(column: pd.Series) -> pd.Series:
    return column.map(lambda m: (m != BASELINE, m)) if column.name == "method" else column
