"""Reports: report.md (tables and plots), tables.tex and acceptance profiles from run folders or Spec-Bench
answer files. Cells hold the numbers (`cells`), `tables` and `plots` render them; this module assembles them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..engines import concurrency
from ..interference import BUSY_SHARE
from . import batches, crosscheck, metrics, regimes
from .cells import AA, BASELINE, OVERALL, Cell, collect_cells, file_stem, from_spec_bench, source_line
from .plots import all_plots, method_colors, plot_concurrency
from .sources import Source, load_sources
from .tables import (
    concurrency_md,
    detail_md,
    detail_tex,
    fmt_speedup,
    leaderboard_md,
    leaderboard_tex,
    lossless_md,
    schedule_md,
    spec_bench_md,
    tuned_md,
)

FOOTNOTES = """\
- **Speedup (paired, the headline)**: geometric mean over questions of tokens/s of the method on a question ÷
  tokens/s of vanilla on the same question (paired by question id), same source, model, task and temperature;
  95% interval in brackets: Student's t over the questions' log ratios, their spread taken no smaller than the
  per-question timing noise of the cell's A/A column; none with one question (a ratio without brackets). A
  category's interval takes the spread within categories pooled over all of the cell's categories, with its
  degrees of freedom (the cell's questions less its categories): timing noise is much the same in every category,
  and two questions alone would give t = 12.7. Few questions give wide intervals: that is what they can tell.
  **Overall** pools every question of the cell (it is not the mean of the category columns), with its own
  spread. `n/a`: no vanilla answers (or no shared questions) to compare with.
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
- **draft share**: Σ draft time / (Σ draft time + Σ verify time); `—` for a method that drafts nothing (every step
  verified its root alone: vanilla, the A/A column), whose drafting window timed only the loop's own calls.
- **time split** (figure): Σ draft time, Σ verify time and the rest of Σ wall time (the target's prefill, the loop
  itself) per generated token; a bar's length is 1 / tokens/s.
- **α_k**: among steps whose draft reached depth k, the share that accepted the k-th draft token (for a tree,
  along the accepted path). The figure's lower panel gives how many drafts reached each depth; an α_k resting on
  fewer than 10 drafts is drawn hollow, on a dashed line (its 95% interval spans about ±0.3 or more).
- **roofline efficiency**: overall paired speedup ÷ τ·T(1) / (T(n) + D), the speedup an overhead-free loop would
  reach at the same τ. T(k) is the target's median forward time over k new tokens (`forward_profile.json`), n the
  mean tree size (T linearly interpolated between measured sizes), D = Σ draft time / Σ decoding steps (0 for a
  method that drafts nothing: its efficiency is its paired speedup, vanilla's 100%).
- **Losslessness (temperature 0)**: each method's tokens are compared with vanilla's, question by question. At
  a first divergence the target's top-1/top-2 margins (vanilla's one-token step, the method's verification row)
  are set against the target's rounding spread measured there: within it the divergence is numerical, beyond it
  (or where the method emitted a token its own verification did not rank first) a real mismatch, a bug.
  Lossy acceptance rules (e.g. typical acceptance) are marked "(lossy)": they are not expected to match.
- `—`: not recorded by this source."""

SPEC_BENCH_NOTE = """\
- **Spec-Bench answer files**: token counts are taken from `new_tokens` as recorded for every method, baseline
  included. Spec-Bench's own `speed.py` re-tokenises the baseline's text instead (which needs the model's
  tokenizer), so its numbers can differ slightly. These files carry no draft/verify times, tree sizes, per-step
  draft depths or greedy checks, so those columns are `—` or "not checked"."""


COST_ONLY = """\
**Cost-only**: {} forced every verdict inside the real verification at those per-position acceptance rates (`run
--acceptance synthetic:...`, docs/metrics.md): the target and the drafter did all their work, but the tokens are
not the model's and τ and α are the profile's, not the method's. Its speedups say what a method costs at that
acceptance; its answers are marked "(cost-only)" and never checked for losslessness."""


SCHEDULES = """\
A method that verifies fewer tokens than it drafted (DSpark's `confidence_threshold`, or its `verify: adaptive`
schedule from the confidence head and the target's profiled step costs): the means per step over every answer, and
the share of drafted tokens left unverified. Accepted counts the drafts kept, without the target's own token."""


CONCURRENCY_NOTE = """\
Each level answers the task's questions with that many conversations in flight (a conversation's turns one after
another), each level in a fresh engine. tokens/s: all new tokens over the level's wall time; × vanilla: over
vanilla's tokens/s at the same level in the same engine; TTFT: from a request's submission to its first token;
ms per token: after the first, per request; per-user tokens/s: Σ new tokens / Σ each request's latency, as the batch
sweep's; τ as everywhere, from the engine's own counts. The same figure as our batch sweep's, beside it and never
paired with it: the engine's scheduler, batching and kernels are in these numbers."""


def _sweeps_md(sources: list[Source], out_dir: Path) -> list[str]:
    """Each engine run's concurrency sweeps: a table and a figure per task and temperature."""
    md = []
    for source in [s for s in sources if s.concurrency is not None]:
        levels = concurrency.levels(source.concurrency)
        colors = method_colors(set(levels.method))
        for (task, temperature), part in levels.groupby(["task", "temperature"]):
            title = f"{source.label} · {task} · T={temperature:g}"
            stem = file_stem("concurrency", source.name, task, f"t{temperature:g}")
            figure = plot_concurrency(part, colors, out_dir, stem, title)[0]
            md += [f"### {title}", "", concurrency_md(part), "", f"![{figure.stem}]({figure.name})", ""]
    return md


def _sources_md(sources: list[Source], out_dir: Path) -> str:
    """One bullet per source, its path relative to the report; below it the hub revisions it loaded and the methods
    `all` skipped (why)."""
    lines = []
    for s in sources:
        lines.append(f"- {source_line(s, out_dir)}")
        manifest = s.manifest or {}
        engine = manifest.get("engine") or {}
        if engine.get("name") == "llamacpp":  # what it served, as served
            lines.append(
                f"  - llama-server: llama.cpp {engine['version']}, {engine['build']} build, serving "
                f"`{engine['model']}` ({engine['quantization']})"
            )
        for role, ck in (manifest.get("checkpoints") or {}).items():
            if ck.get("revision"):
                lines.append(f"  - {role}: `{ck['source']}` at revision `{ck['revision']}`")
            if ck.get("gguf") and engine.get("name") != "llamacpp":
                g, dtype = ck["gguf"], (manifest.get("config") or {}).get("dtype", "?")
                lines.append(
                    f"  - {role}: GGUF `{g['file']}` ({g['file_type']}, sha256 `{g['sha256'][:16]}`), "
                    f"dequantized to {g['stored_dtype']}, run in {dtype}"
                )
        lines += [f"  - skipped {name}: {why}" for name, why in (manifest.get("skipped") or {}).items()]
    return "\n".join(lines)


def _nodes_md(sources: list[Source], shown: int = 20) -> list[str]:
    """For each run whose Ray workers ran on more than one node: one bullet per node, with its workers, how many
    answers it gave and (the first `shown` of) its questions, so a suspect node's share of a run can be found."""
    lines = []
    for s in sources:
        nodes: dict[tuple[str, str, str], list] = {}
        for a in s.answers:
            if a.node:
                nodes.setdefault((a.node["host"], a.node["ip"], a.node["id"]), []).append(a)
        if len(nodes) < 2:
            continue
        for (host, ip, node_id), answers in sorted(nodes.items()):
            workers = sorted({a.node["worker"] for a in answers})
            ids = sorted({a.question_id for a in answers}, key=lambda q: (isinstance(q, str), q))
            more = f", … ({len(ids)} in all)" if len(ids) > shown else ""
            lines.append(
                f"- {s.name}: node `{node_id[:8]}` ({host}, {ip}), worker "
                f"{', '.join(map(str, workers))}: {len(answers)} answers, questions "
                f"{', '.join(map(str, ids[:shown]))}{more}"
            )
    return lines


def _notes(cells: list[Cell]) -> list[str]:
    notes = [f"- {c.missing_baseline}" for c in cells if c.missing_baseline]
    for c in cells:
        decoder = ((c.source.manifest or {}).get("graphs") or {}).get("decoder")
        if decoder not in (None, "owned"):
            notes.append(f"- {c.title}: under --graphs the target ran eagerly on transformers, as {decoder}")
        aa = c.stats.get(AA)
        if aa is not None and c.baseline is not None:
            notes.append(
                f"- {c.title}: noise floor (A/A: vanilla timed again in the same interleaving) "
                f"{fmt_speedup(aa.paired[OVERALL])}; speedups inside it are not differences"
            )
        if c.order is not None and c.order.flagged:
            o = c.order
            notes.append(
                f"- {c.title}: **order effect**: the A/A ratio depends on where a question ran "
                f"(over {o.pairs} questions: trend along the run p = {o.drift_p:.3g}; A/A timed after "
                f"vanilla / before it {o.first_shift:.2f}×, p = {o.first_p:.3g}); the machine drifted or "
                "warmed up during the run, so its speedups carry more than timing noise"
            )
        cpus = ((c.source.manifest or {}).get("machine") or {}).get("cpu_count") or 1
        timed = c.turns.busy_cpus.dropna()  # one value per answer that recorded it
        busy = int((timed > BUSY_SHARE * cpus).sum())
        if busy:
            notes.append(
                f"- {c.title}: **busy machine**: {busy} of {len(timed)} answers were timed while other "
                f"processes kept more than {BUSY_SHARE * cpus:.1f} of {cpus} CPUs busy; its "
                "timings and speedups are not trustworthy"
            )
    return notes


def write_profiles(cells: list[Cell], out_dir: Path) -> list[Path]:
    """Each method's acceptance profile per cell as SPEED-Bench's tools read it:
    `<out_dir>/<cell>/<method>/speculation_profile.json`."""
    written = []
    for c in cells:
        for method, (_, steps) in c.by_method.items():
            if method in (BASELINE, AA):
                continue
            k = int(np.nanmax([steps.tested.max(), steps.accepted.max() - 1, 1]))  # nan: not recorded
            profile = metrics.speculation_profile(steps, k, method)
            profile["target_model"] = {"id": c.model}
            profile["draft_checkpoint"] = None
            config = (c.source.manifest or {}).get("config") or {}
            profile["measurement_conditions"] = {
                "tool": "specbench",
                "task": c.task,
                "temperature": c.temperature,
                "device_name": c.source.device,
                "dtype": config.get("dtype"),
            }
            path = out_dir / c.slug / method / "speculation_profile.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
            written.append(path)
    return written


def summary(sources: list[Path], mixed_devices: bool = False) -> str:
    """The leaderboard table(s) as Markdown, for the terminal."""
    cells = collect_cells(load_sources(sources, mixed_devices))
    parts = [f"{c.title}: paired speedup over vanilla [95% CI]\n\n{leaderboard_md(c)}" for c in cells]
    return "\n\n".join(parts + _notes(cells))


def build_report(sources: list[Path], out_dir: Path, title: str | None = None, mixed_devices: bool = False) -> Path:
    """Write report.md, tables.tex and the plots (PNG and PDF) into out_dir; returns report.md's path."""
    loaded = load_sources(sources, mixed_devices)
    cells = collect_cells(loaded)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = all_plots(cells, out_dir)
    title = title or "Speculative decoding report: " + ", ".join(s.name for s in loaded)

    md = [f"# {title}", "", "## Sources", "", _sources_md(loaded, out_dir), ""]
    if len(loaded) > 1:
        md += [
            "Each source is a separate run (possibly another machine): speedups are never computed across "
            "sources; compare τ across machines, speedups only within one.",
            "",
        ]
    if cost_only := [s for s in loaded if s.synthetic - {None}]:
        md += [COST_ONLY.format(", ".join(f"{s.name} ({s.acceptance})" for s in cost_only)), ""]
    if nodes := _nodes_md(loaded):
        md += ["## Which node answered what", "", *nodes, ""]
    if notes := _notes(cells):
        md += ["## Notes", "", *notes, ""]
    md += ["## Leaderboard: paired speedup over vanilla [95% CI]", ""]
    for c in cells:
        md += [f"### {c.title}", "", leaderboard_md(c), ""]
    if sweeps_b := batches.groups(cells):
        colors = method_colors({m for g in sweeps_b for c in g for m in c.by_method})
        md += ["## Batch sweep: speedup and throughput against batch size", "", batches.NOTES, ""]
        for group in sweeps_b:
            c = group[0]
            stem = file_stem("batches", c.source.name, c.model, c.task, f"t{c.temperature:g}")
            figure = batches.plot(group, colors, out_dir, stem)[0]
            md += [f"### {c.source.label} · {c.model} · {c.task} · T={c.temperature:g}", "", batches.table(group), ""]
            md += [f"![{figure.stem}]({figure.name})", ""]
    if sweeps := _sweeps_md(loaded, out_dir):
        md += ["## Concurrency sweeps (engine mode)", "", CONCURRENCY_NOTE, "", *sweeps]
    if tuned := [(c, table) for c in cells if (table := tuned_md(c))]:
        md += ["## Tuned vs default (`specbench tune`, run with --tuned)", ""]
        md += [line for c, table in tuned for line in (f"### {c.title}", "", table, "")]
    if scheduled := [(c, table) for c in cells if (table := schedule_md(c))]:
        md += ["## Verification schedules: tokens drafted, verified and accepted per step", "", SCHEDULES, ""]
        md += [line for c, table in scheduled for line in (f"### {c.title}", "", table, "")]
    if groups := regimes.groups(cells):
        md += ["## Regimes side by side", "", regimes.NOTES, ""]
        for group in groups:
            md += [f"### {group[0].model} · {group[0].task} · T={group[0].temperature:g}", "", regimes.table(group), ""]
    if pairs := crosscheck.pairs(cells):
        md += ["## Cross-check: our loop / the engine", "", crosscheck.NOTES, ""]
        for ours, engine in pairs:
            md += [f"### {ours.title} / {engine.title}", "", crosscheck.table(ours, engine), ""]
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
    if any(from_spec_bench(c.turns) for c in cells):
        md += [SPEC_BENCH_NOTE]
    report = out_dir / "report.md"
    report.write_text("\n".join(md) + "\n", encoding="utf-8")

    write_profiles(cells, out_dir / "speculation_profiles")
    tex = ["% Tables generated by specbench.report; needs \\usepackage{booktabs}", ""]
    tex += [leaderboard_tex(c) + "\n" for c in cells if c.ranked()]
    tex += [detail_tex(c) + "\n" for c in cells]
    (out_dir / "tables.tex").write_text("\n".join(tex), encoding="utf-8")
    return report
