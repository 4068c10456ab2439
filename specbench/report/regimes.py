"""The same methods on the same model, task and temperature timed in several regimes (the eager loop, `--graphs`,
an engine), side by side: each regime's tokens/s, its own paired speedup, τ, and a step's cost split into the target's
verification, drafting and the rest. Ratios are never taken across regimes."""

from __future__ import annotations

from .cells import BASELINE, MISSING, OVERALL, Cell, mean_tree_size
from .tables import fmt_speedup, md_table

NOTES = """\
Each regime is comparable with something else, so numbers are read down a column, never across:
- **eager**: our loop as the published scripts run theirs (Spec-Bench, the EAGLE and Medusa repositories): one
  kernel launch at a time from Python. Compare its speedups with papers.
- **graphs** (`run --graphs`): the same loop on static KV caches with each forward replayed as a CUDA graph (on a
  CPU: the same cache, nothing captured): what a method gives once the host's overhead is gone, the regime of
  gpt-fast-style stacks. The drafters' forwards are captured too (the manifest lists any that drafted eagerly).
  With **+compile** (`--compile`) torch.compile fuses what runs (under `--graphs`, before it is captured).
- **an engine** (`run --engine vllm`): what a server gets, with its own kernels, batching and chains for trees.

A step's milliseconds: verification (the target's forward over the proposal, acceptance and commit) at the mean rows
it verified (root, tree and any side branch), drafting, and the rest of the wall time (prefill, the loop itself),
each summed over the cell and divided by its steps."""


def groups(cells: list[Cell]) -> list[list[Cell]]:
    """Cells of the same model, task and temperature from sources of different regimes, eager first."""
    order = {"eager": 0, "eager+compile": 1, "graphs": 2, "graphs+compile": 3}
    by_key: dict[tuple, list[Cell]] = {}
    for c in cells:
        by_key.setdefault((c.model, c.task, c.temperature, c.batch_size), []).append(c)
    out = []
    for group in by_key.values():
        if len({c.source.regime for c in group}) > 1:
            out.append(sorted(group, key=lambda c: (order.get(c.source.regime, len(order)), c.source.name)))
    return out


def step_split(turns) -> tuple[float, float, float, float] | None:
    """Seconds per step of turn rows: the whole step, verification, drafting and the rest (None: not recorded)."""
    steps = turns.steps.sum()
    if not steps or turns.verify_time.isna().all():
        return None
    verify, draft, wall = turns.verify_time.sum(), turns.draft_time.fillna(0).sum(), turns.wall_time.sum()
    return wall / steps, verify / steps, draft / steps, (wall - verify - draft) / steps


def _step(cell: Cell, method: str) -> str:
    turns, steps = cell.by_method[method]
    split = step_split(turns)
    if split is None:
        return MISSING
    ms = [1e3 * x for x in split]
    rows = mean_tree_size(steps)
    at = "" if rows is None else f" at {rows:.0f} rows"
    return f"{ms[0]:.1f} ({ms[1]:.1f}{at} / {ms[2]:.1f} / {ms[3]:.1f})"


def table(group: list[Cell]) -> str:
    """One row per method; for each regime: tokens/s, paired speedup over its own vanilla, τ, ms per step."""
    methods = [BASELINE, *sorted({m for c in group for m in c.by_method} - {BASELINE})]
    header = ["method"]
    for c in group:
        tag = f"{c.source.regime} ({c.source.name})"
        header += [f"{tag} tokens/s", "× vanilla", "τ", "ms/step (verify at its rows / draft / rest)"]
    rows = []
    for method in methods:
        row = [method]
        for c in group:
            s = c.stats.get(method)
            if s is None:
                row += [MISSING] * 4
                continue
            rate = s.turns.new_tokens.sum() / s.turns.wall_time.sum()
            speedup = "1.00×" if method == BASELINE else fmt_speedup(s.paired[OVERALL])
            row += [f"{rate:.1f}", speedup, f"{s.tau:.2f}", _step(c, method)]
        rows.append(row)
    return md_table(header, rows)
