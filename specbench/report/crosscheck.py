"""The cross-check of engine mode: the same methods, model, heads, prompts and temperature measured by our loop and
inside an engine (vLLM, llama.cpp), side by side (τ, tokens verified per step, per-position acceptance, greedy
agreement with vanilla)."""

from __future__ import annotations

from . import metrics
from .cells import BASELINE, MISSING, Cell, mean_tree_size
from .tables import md_table

DEPTH = 4  # α_k columns

NOTES = """\
Each engine's numbers are its own: τ counts the target forwards that produced the answer (an engine's prefill yields
the first token and counts as a step of one), greedy agreement is with vanilla in the same engine, and no ratio is
taken across engines. Where τ differs, look first at how each drafts:
- **tree vs chain**: EAGLE-1/2/3 and suffix decoding verify a tree in our loop and a single chain in the engines, so
  our τ is higher at the same head; α_k of a tree counts the accepted path, of a chain its only path.
- **draft length**: the presets' `vllm:` and `llamacpp:` keys set the engine's draft length (the column "verified per
  step" shows what each engine actually sent); a longer chain raises τ and lowers α at the deep positions.
- **matching**: llama.cpp's `ngram-simple` (pld) matches one n-gram size, where ours tries 3, 2, then 1.
- **checkpoint reading**: vLLM's EAGLE-1 drafter has no `fc` bias and ignores `fc.bias` in a checkpoint (the official
  Vicuna heads have one, as does the bundled head), so its EAGLE α_1 is lower than ours on the same head.
- **stop handling**: both cut the answer at the first stop token and the budget; the engines' counts include drafts
  accepted past them, which are cut before counting here.
- **T > 0**: both accept by rejection sampling, so a lossless method's α should agree within sampling noise when
  both draft alike; greedy agreement is checked at T=0 only."""


def pairs(cells: list[Cell]) -> list[tuple[Cell, Cell]]:
    """(our loop's cell, an engine's cell) for every engine cell with an our-loop cell of the same model, task and
    temperature."""
    ours = {(c.model, c.task, c.temperature): c for c in cells if c.source.engine == "specbench" and c.batch_size == 1}
    return [
        (ours[(c.model, c.task, c.temperature)], c)
        for c in cells
        if c.source.engine != "specbench" and (c.model, c.task, c.temperature) in ours
    ]


def _alphas(steps) -> list[str]:
    """α_1..α_DEPTH, formatted."""
    alpha = metrics.acceptance_by_position(steps, DEPTH)
    return [MISSING if k >= len(alpha) or alpha[k] != alpha[k] else f"{alpha[k]:.2f}" for k in range(DEPTH)]


def _exact(turns) -> str:
    check = metrics.losslessness(turns)
    return f"{check.exact_rate:.0%}" if check.questions else MISSING


def table(ours: Cell, engine: Cell) -> str:
    """One row per method run both ways: each engine's value as `ours / engine`."""
    rows = []
    for method in [m for m in ours.stats if m in engine.stats and m != BASELINE and not m.startswith("vanilla-")]:
        a, b = ours.stats[method], engine.stats[method]
        tree = [mean_tree_size(s.steps) for s in (a, b)]
        row = [method, f"{a.tau:.2f} / {b.tau:.2f}", " / ".join(MISSING if t is None else f"{t:.1f}" for t in tree)]
        row += [f"{x} / {y}" for x, y in zip(_alphas(a.steps), _alphas(b.steps), strict=True)]
        row.append(f"{_exact(a.turns)} / {_exact(b.turns)}")
        rows.append(row)
    if not rows:
        return "No method other than vanilla ran in both."
    header = ["method", "τ", "verified per step", *(f"α_{k}" for k in range(1, DEPTH + 1)), "greedy = vanilla"]
    return md_table(header, rows)
