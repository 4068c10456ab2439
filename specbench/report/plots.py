"""Plots of cells (matplotlib, each figure as PNG and PDF), one colour per method across all of them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator, StrMethodFormatter

from .. import presets
from . import metrics
from .cells import BASELINE, OVERALL, Cell, MethodStats, drafts_nothing, file_stem, mean_tree_size, roofline

EXTRA_COLORS = (
    "#17becf",
    "#393b79",
    "#ad494a",
    "#637939",
    "#8c6d31",
    "#7b4173",
    "#3182bd",
    "#e6550d",
    "#31a354",
    "#756bb1",
    "#e7ba52",
    "#6b6ecf",
    "#de9ed6",
)  # for methods whose presets name none
TIME_COLORS = ("#525252", "#bdbdbd", "#ffffff")  # draft, verify, other: greys, so no method colour is reused


def method_colors(methods: set[str]) -> dict[str, str]:
    """The colours the method presets name (`color:`). A variant without one (vanilla-aa, medusa-typical, sps-68m,
    eagle2[top_k=6]) takes its family's, the colour of the preset named like its implementation, or a lighter shade
    of it where the family is shown too; the others take extra colours that no preset names, sorted by name. Read
    from the presets, so a report imports no method."""
    declared, family = {}, {}
    for name in presets.names("methods"):
        preset = presets.load("methods", name)
        family[name] = preset.implementation or name
        if preset.color:
            declared[name] = preset.color
    out: dict[str, str] = {}
    for m in sorted(methods):
        if m in declared and declared[m] not in out.values():  # a plugin's preset may name a colour already taken
            out[m] = declared[m]
    rest = sorted(methods - set(out))
    for m in rest:
        base = m.split("[")[0]
        color = declared.get(family.get(base, base.split("-")[0]))
        free = [c for c in ([color, _lighter(color)] if color else []) if c not in out.values()]
        if free:
            out[m] = free[0]
    spare = [c for c in EXTRA_COLORS if c not in declared.values()]
    for i, m in enumerate(m for m in rest if m not in out):
        out[m] = spare[i % len(spare)]
    return out


def _lighter(color: str) -> str:
    """`color` halfway to white."""
    red, green, blue = to_rgb(color)
    return to_hex((0.5 + 0.5 * red, 0.5 + 0.5 * green, 0.5 + 0.5 * blue))


def _yerr(speedups: list[metrics.Speedup]) -> np.ndarray:
    """Matplotlib error bars from 95% intervals; none where there is no interval (one question)."""
    return np.nan_to_num(np.array([[p.value - p.low for p in speedups], [p.high - p.value for p in speedups]]))


CUT = 2.0  # a speedup axis reaches at most this many times the largest speedup (or 1×)


def _ratio_axis(ax, speedups: list[metrics.Speedup]) -> str:
    """Fit the axis to the speedups, not to their widest interval: two questions can honestly give [0.01, 90], and
    one such bar flattened every other. Returns the title's note when some interval runs past the top."""
    values = [p.value for p in speedups if not np.isnan(p.value)] or [1.0]
    highs = [p.high for p in speedups if p.has_interval]
    cap = CUT * max(1.0, *values)
    top = max([1.15 * max(1.0, *values), *(h for h in highs if h <= cap)])
    ax.set_ylim(0, top)
    return f" (intervals beyond {top:.2g}× cut)" if any(h > top for h in highs) else ""


def _display(cells: list[Cell], method: str) -> str:
    return next(c.stats[method].display for c in cells if method in c.stats)


def _legend(ax) -> None:
    """The legend beside the axes, on the right: inside them, a dozen methods' entries hid bars and points."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    fig.tight_layout()
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    return paths


def plot_speedups(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Grouped bars: category on x, one bar per method, 95% CI as error bars, a dashed line at 1."""
    rows = cell.ranked()
    if cell.baseline is None or not rows:
        return []
    cats = [*cell.groups, OVERALL]
    fig = Figure(figsize=(max(7.5, 1.1 * len(cats) + 0.4 * len(rows) + 1.5), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / len(rows)
    x = np.arange(len(cats))
    for i, s in enumerate(rows):
        sp = [s.paired[c] for c in cats]
        ax.bar(
            x + (i - (len(rows) - 1) / 2) * width,
            [p.value for p in sp],
            width,
            yerr=_yerr(sp),
            capsize=2,
            label=s.display,
            color=colors[s.method],
        )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(x, [c.replace("_", " ") for c in cats])
    ax.set_ylabel("speedup over vanilla (×)")
    cut = _ratio_axis(ax, [s.paired[c] for s in rows for c in cats])
    ax.set_title(f"Paired speedup, 95% CI{cut}\n{cell.title}", fontsize=10)
    _legend(ax)
    return _save(fig, out_dir, stem)


def plot_accept_lengths(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Share of decoding steps by accepted length, one bar per method at each length."""
    stats = _drafting(cell)
    lengths = {m.method: m.steps.accepted.to_numpy(dtype=np.int64) for m in stats}
    lengths = {m: v for m, v in lengths.items() if v.size}
    if not lengths:
        return []
    top = max(int(v.max()) for v in lengths.values())
    x = np.arange(1, top + 1)
    fig = Figure(figsize=(min(13.5, max(7.5, 0.4 * top + 3.5)), 4.0))
    ax = fig.add_subplot()
    width = 0.8 / len(lengths)
    for i, (m, v) in enumerate(lengths.items()):
        share = np.bincount(v, minlength=top + 1)[1:] / v.size
        ax.bar(
            x + (i - (len(lengths) - 1) / 2) * width,
            share,
            width,
            color=colors[m],
            label=f"{m} (τ={cell.stats[m].tau:.2f})",
        )
    ax.set_xticks(x)
    ax.set_xlabel("tokens accepted per step (target's own token included)")
    ax.set_ylabel("share of steps")
    ax.set_title(f"Accepted length per step\n{cell.title}", fontsize=10)
    _legend(ax)
    return _save(fig, out_dir, stem)


def _drafting(cell: Cell) -> list[MethodStats]:
    """The methods other than vanilla, or vanilla alone when nothing else ran."""
    return [s for s in cell.stats.values() if s.method != BASELINE] or list(cell.stats.values())


def plot_acceptance(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Per-position acceptance alpha_k against draft depth k, one line per method that drafts, and below it the
    drafts each alpha_k rests on: a deep alpha_k from two drafts is not drawn as firmly as one from hundreds
    (hollow markers on a dashed line under `metrics.MIN_DRAFTS`)."""
    curves = [
        (s, metrics.acceptance_by_position(s.steps), metrics.acceptance_counts(s.steps)) for s in cell.stats.values()
    ]
    curves = [curve for curve in curves if curve[1]]
    if not curves:
        return []
    fig = Figure(figsize=(7.5, 5.6))  # (the legend beside the axes)
    ax, below = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.6])
    for s, alpha, counts in curves:
        k = np.arange(1, len(alpha) + 1)
        firm = sum(n >= metrics.MIN_DRAFTS for n in counts)  # counts never grow with k: the firm points lead
        color = colors[s.method]
        if firm < len(alpha):  # dashed from the last firm point on (the firm line covers that one)
            thin = max(firm - 1, 0)
            ax.plot(
                k[thin:],
                alpha[thin:],
                linestyle="--",
                linewidth=1,
                marker="o",
                markerfacecolor="white",
                color=color,
                label=None if firm else s.display,
                zorder=2,
            )
        if firm:
            ax.plot(k[:firm], alpha[:firm], marker="o", color=color, label=s.display, zorder=3)
        below.plot(k, counts, marker="o", markersize=3, linewidth=1, color=color)
    ax.plot(
        [],
        [],
        linestyle="--",
        linewidth=1,
        marker="o",
        markerfacecolor="white",
        color="grey",
        label=f"α_k from < {metrics.MIN_DRAFTS} drafts",
    )
    below.axhline(metrics.MIN_DRAFTS, color="black", linestyle=":", linewidth=1)
    ax.plot([], [], color="black", linestyle=":", linewidth=1, label=f"{metrics.MIN_DRAFTS} drafts (below)")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("acceptance rate α_k")
    ax.set_title(f"Per-position acceptance\n{cell.title}", fontsize=10)
    _legend(ax)  # one legend: a second, beside the lower axes, met the first's tail with a dozen methods
    below.set_yscale("log")
    below.yaxis.set_major_formatter(LogFormatter())  # counts: 6, 30, 100 rather than 6×10^0
    below.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    below.xaxis.set_major_locator(MaxNLocator(integer=True))
    below.set_xlabel("draft depth k")
    below.set_ylabel("drafts reaching k")
    return _save(fig, out_dir, stem)


def _power_ticks(ax, values: list[float]) -> None:
    """x ticks at every power of two from the one at or below the smallest value to the one at or above the
    largest, the view spanning them: a log axis ticks only inside its data's view, so points at 5-7 sat past the
    last tick (4)."""
    low, high = math.floor(math.log2(min(values))), math.ceil(math.log2(max(values)))
    ticks = 2.0 ** np.arange(low, high + 1)
    ax.set_xticks(ticks)
    ax.set_xlim(ticks[0] / 1.15, ticks[-1] * 1.15)


def plot_tau_vs_tree(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """tau against the mean verified tree size, one point per method; the diagonal accepts every verified token."""
    sizes = [(s, mean_tree_size(s.steps)) for s in cell.stats.values()]
    points = [(s, size) for s, size in sizes if size is not None]
    if not points:
        return []
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.add_subplot()
    diagonal = np.geomspace(1, max(size for _, size in points), 50)
    ax.plot(diagonal, diagonal, color="black", linestyle="--", linewidth=1, label="every verified token accepted")
    for s, size in points:
        ax.scatter(size, s.tau, s=40, color=colors[s.method], label=s.display, zorder=3)
    ax.set_xscale("log", base=2)
    _power_ticks(ax, [size for _, size in points])
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.set_ylim(0.8, 1.2 * max(s.tau for s, _ in points))
    ax.set_xlabel("mean verified tree size (tokens per target forward)")
    ax.set_ylabel("τ (mean accepted length)")
    ax.set_title(f"τ against verification cost\n{cell.title}", fontsize=10)
    _legend(ax)
    return _save(fig, out_dir, stem)


def _bars_height(n: int) -> float:
    """Inches for n horizontal bars, each method's name on a line of its own: side by side under vertical bars,
    names like `lookahead-shifted` and `medusa-typical (lossy)` overlapped their neighbours' from a dozen methods on."""
    return max(3.0, 0.3 * n + 1.6)


def _method_ticks(ax, stats: list[MethodStats], colors: dict[str, str]) -> None:
    """Horizontal bars' method names, first at the top, each in its method's colour."""
    ax.set_yticks(np.arange(len(stats)), [s.display for s in stats])
    ax.set_ylim(len(stats) - 0.5, -0.5)
    for tick, s in zip(ax.get_yticklabels(), stats, strict=True):
        tick.set_color(colors[s.method])


def plot_time_split(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Stacked horizontal bars, one per method: milliseconds per generated token in drafting, verification and the
    rest of the wall time. A method that drafts nothing has no draft bar: the loop's own calls its drafting window
    timed are the rest's (`cells.drafts_nothing`)."""
    stats = [s for s in cell.stats.values() if s.turns[["draft_time", "verify_time"]].notna().all(axis=None)]
    if not stats:
        return []
    parts: dict[str, list[float]] = {"draft": [], "verify": [], "other (prefill, loop)": []}
    for s in stats:
        tokens, draft, verify, wall = s.turns[["new_tokens", "draft_time", "verify_time", "wall_time"]].sum()
        draft = 0.0 if drafts_nothing(s.steps) else draft
        for key, seconds in zip(parts, (draft, verify, wall - draft - verify), strict=True):
            parts[key].append(1000 * seconds / tokens)
    fig = Figure(figsize=(7.5, _bars_height(len(stats))))
    ax = fig.add_subplot()
    y = np.arange(len(stats))
    left = np.zeros(len(stats))
    for (key, values), color in zip(parts.items(), TIME_COLORS, strict=True):
        width = np.asarray(values)
        drawn = width > 0  # (an empty part draws no outlined sliver, and no method's: no legend entry)
        if drawn.any():
            ax.barh(
                y[drawn], width[drawn], 0.6, left=left[drawn], label=key, color=color, edgecolor="black", linewidth=0.5
            )
        left += width
    _method_ticks(ax, stats, colors)
    ax.set_xlabel("milliseconds per generated token")
    ax.set_title(f"Where the time goes (bar length = 1 / tokens/s)\n{cell.title}", fontsize=10)
    _legend(ax)
    return _save(fig, out_dir, stem)


def plot_roofline(cell: Cell, colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Roofline efficiency per method (horizontal bars): measured speedup / the overhead-free speedup at the same
    tau."""
    efficiencies = [(s, roofline(cell, s)) for s in _drafting(cell)]
    bars = [(s, value) for s, value in efficiencies if value is not None]
    if not bars:
        return []
    fig = Figure(figsize=(6.5, _bars_height(len(bars))))
    ax = fig.add_subplot()
    ax.barh(np.arange(len(bars)), [100 * value for _, value in bars], 0.6, color=[colors[s.method] for s, _ in bars])
    ax.axvline(100, color="black", linestyle="--", linewidth=1)
    _method_ticks(ax, [s for s, _ in bars], colors)
    ax.set_xlabel("roofline efficiency (%)")
    ax.set_title(f"Speedup reached / overhead-free speedup at the same τ\n{cell.title}", fontsize=10)
    return _save(fig, out_dir, stem)


def plot_speedup_vs_temperature(cells: list[Cell], colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Overall paired speedup against temperature, one line per method, for cells of one source, model and task."""
    cells = sorted((c for c in cells if c.baseline is not None and c.ranked()), key=lambda c: c.temperature)
    if len(cells) < 2:
        return []
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.add_subplot()
    shown = []
    for m in sorted({s.method for c in cells for s in c.ranked()}):
        having = [c for c in cells if m in c.stats]
        sp = [c.stats[m].paired[OVERALL] for c in having]
        shown += sp
        ax.errorbar(
            [c.temperature for c in having],
            [p.value for p in sp],
            yerr=_yerr(sp),
            capsize=3,
            marker="o",
            color=colors[m],
            label=_display(having, m),
        )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("temperature")
    ax.set_ylabel("speedup over vanilla (×)")
    c, cut = cells[0], _ratio_axis(ax, shown)
    ax.set_title(
        f"Paired speedup against temperature, 95% CI{cut}\n{c.source.label} · {c.model} · {c.task}", fontsize=10
    )
    _legend(ax)
    return _save(fig, out_dir, stem)


def plot_overview(cells: list[Cell], colors: dict[str, str], out_dir: Path, stem: str) -> list[Path]:
    """Overall paired speedup of every method in every cell side by side (runs, models, machines, temperatures)."""
    cells = [c for c in cells if c.baseline is not None and c.ranked()]
    if len(cells) < 2:
        return []
    methods = sorted({s.method for c in cells for s in c.ranked()})
    fig = Figure(figsize=(max(7.5, 1.2 * len(cells) + 0.3 * len(methods) * len(cells) + 1.5), 4.6))
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j for j, c in enumerate(cells) if m in c.stats]
        sp = [cells[j].stats[m].paired[OVERALL] for j in xs]
        ax.bar(
            np.array(xs) + (i - (len(methods) - 1) / 2) * width,
            [p.value for p in sp],
            width,
            yerr=_yerr(sp),
            capsize=2,
            color=colors[m],
            label=_display(cells, m),
        )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(
        range(len(cells)), [f"{c.source.label}\n{c.model} · {c.task}\nT={c.temperature:g}" for c in cells], fontsize=8
    )
    ax.set_ylabel("speedup over vanilla (×)")
    cut = _ratio_axis(ax, [s.paired[OVERALL] for c in cells for s in c.ranked()])
    ax.set_title(f"Overall paired speedup, 95% CI{cut}, every run side by side (speedups never mix runs)", fontsize=10)
    _legend(ax)
    return _save(fig, out_dir, stem)


CELL_PLOTS = (
    ("speedup_by_category", plot_speedups),
    ("accept_length_hist", plot_accept_lengths),
    ("acceptance_by_position", plot_acceptance),
    ("tau_vs_tree_size", plot_tau_vs_tree),
    ("time_split", plot_time_split),
    ("roofline", plot_roofline),
)


def all_plots(cells: list[Cell], out_dir: Path) -> list[tuple[str, list[Path]]]:
    """(heading, figure files): every cell side by side, speedup against temperature per run, model and task,
    then each cell's own figures. One colour per method in all of them."""
    colors = method_colors({m for c in cells for m in c.by_method})
    out = [("Every run side by side", plot_overview(cells, colors, out_dir, "speedup_overview"))]
    groups: dict[tuple[str, str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.source.name, c.model, c.task), []).append(c)
    for key, group in groups.items():
        stem = "speedup_vs_temperature" + (f"-{file_stem(*key)}" if len(groups) > 1 else "")
        title = f"{group[0].source.label} · {group[0].model} · {group[0].task}: speedup against temperature"
        out.append((title, plot_speedup_vs_temperature(group, colors, out_dir, stem)))
    for cell in cells:
        suffix = f"-{cell.slug}" if len(cells) > 1 else ""
        out.append((cell.title, [p for name, plot in CELL_PLOTS for p in plot(cell, colors, out_dir, name + suffix)]))
    return [(heading, paths) for heading, paths in out if paths]


def plot_concurrency(levels, colors: dict[str, str], out_dir: Path, stem: str, title: str) -> list[Path]:
    """An engine run's sweeps (`concurrency.levels` of one task and temperature), the batch sweep's figure from
    the engine's own counts: throughput over vanilla's against the conversations in flight; total against per-user
    throughput, each point labelled with its level; and τ against the level. One line per method."""
    fig = Figure(figsize=(14.0, 4.0))
    speed, pareto, tau = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    for method, rows in levels.sort_values("concurrency").groupby("method"):
        color = colors.get(method, "black")
        if method != BASELINE:
            speed.plot(rows.concurrency, rows.speedup, marker="o", color=color, label=method)
        pareto.plot(rows.per_user, rows.throughput, marker="o", color=color, label=method)
        for r in rows.itertuples():
            pareto.annotate(
                f"{r.concurrency}", (r.per_user, r.throughput), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
        tau.plot(rows.concurrency, rows.tau, marker="o", color=color, label=method)
    speed.axhline(1.0, color="black", linestyle="--", linewidth=1)
    levels_run = sorted(levels.concurrency.unique())
    for ax, label in ((speed, "throughput ÷ vanilla's (×)"), (tau, "τ (mean accepted length)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels_run, [str(n) for n in levels_run])
        ax.minorticks_off()
        ax.set_xlabel("conversations in flight")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    pareto.set_xlabel("per-user tokens/s")
    pareto.set_ylabel("total tokens/s")
    _legend(pareto)
    fig.suptitle(f"Engine mode: speedup, throughput and acceptance against concurrency\n{title}", fontsize=10)
    return _save(fig, out_dir, stem)
