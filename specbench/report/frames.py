"""Results as pandas data frames: one row per answered turn (`frame`) or per decoding step (`steps_frame`).

Both read run folders, folders of answer files or single answer files (Spec-Bench's own included) through
`sources.load_sources`, so a notebook sees exactly what `report` and `compare` see (they build the same frames
from the sources they loaded, with `from_sources` and `steps_from_sources`). Columns that a file does not record
(Spec-Bench's files have no tree sizes, seeds or greedy checks) are missing values.

An answer records some fields once for all its turns. They sit on its turn-0 row, so that sums and counts over
rows take each answer once: `draft_time` and `verify_time` (seconds, all turns) are 0.0 on later turns;
`greedy_match`, `greedy_near_tie`, `busy_cpus`, `position` and `order` are missing there. Where an answer did not
record one, it is missing on all its rows. `batch_size` is the number of sequences decoded together (1 unless
run with `--batch`); `batch_start` and `batch_end`, a batched turn's span in seconds from its batch's start;
`batch_steps`, `batch_forward` and `batch_profiled`, its shares of its batch's steps, of their forwards' measured
seconds and of their profiled T(rows) (summed over a batch's turns: its steps and seconds).
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.synthetic import Profile
from ..errors import SpecbenchError
from ..results import Answer
from . import metrics
from .sources import Source, load_sources

KEY = ["source", "model", "task", "temperature", "batch_size", "method", "question_id"]  # one answer
ANSWER_FIELDS = [
    *KEY,
    "category",
    "group",
    "lossless_rule",
    "synthetic",
    "seed",
    "greedy_match",
    "greedy_near_tie",
    "busy_cpus",
    "position",
    "order",
    "draft_time",
    "verify_time",
    "device",
    "dtype",
    "run_started",
]  # _answer_row keys, also for no answers
COUNTED_ONCE = ["greedy_match", "greedy_near_tie", "busy_cpus", "position", "order"]  # missing on later turns
SUMMED_ONCE = ["draft_time", "verify_time"]  # 0.0 on later turns


def _answer_row(source: Source, answer: Answer) -> dict:
    if len(answer.accept_lengths) != sum(answer.decoding_steps):
        raise SpecbenchError(
            f"{source.path}: question {answer.question_id} of {answer.method} records "
            f"{len(answer.accept_lengths)} accepted lengths for {sum(answer.decoding_steps)} steps"
        )
    manifest, check = source.manifest or {}, answer.greedy_check or {}
    return {
        "source": source.name,
        "model": answer.model,
        "task": answer.task,
        "temperature": answer.temperature,
        "batch_size": answer.batch_size,
        "method": answer.method,
        "question_id": answer.question_id,
        "category": answer.category,
        "group": answer.group,
        "lossless_rule": answer.lossless_rule,
        "synthetic": None if answer.synthetic is None else Profile(tuple(answer.synthetic)).label,
        "seed": answer.seed,
        "greedy_match": check.get("match"),
        "greedy_near_tie": check.get("near_tie"),
        "busy_cpus": answer.busy_cpus,
        "position": answer.position,
        "order": answer.order,
        "draft_time": answer.draft_time,
        "verify_time": answer.verify_time,
        "device": (manifest.get("machine") or {}).get("device_name"),
        "dtype": (manifest.get("config") or {}).get("dtype"),
        "run_started": manifest.get("started"),
    }


def _answers(sources: list[Source]) -> tuple[list[Answer], pd.DataFrame]:
    """Every answer, and its answer-level fields as a frame of one row per answer, in the same order."""
    answers = [a for s in sources for a in s.answers]
    return answers, pd.DataFrame([_answer_row(s, a) for s in sources for a in s.answers], columns=ANSWER_FIELDS)


def _within(counts: np.ndarray) -> np.ndarray:
    """Each row's index in its block, for consecutive blocks of `counts` rows: [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def _repeat(per_answer: pd.DataFrame, counts: np.ndarray) -> pd.DataFrame:
    """Row i of per_answer counts[i] times."""
    return per_answer.take(np.repeat(np.arange(len(per_answer)), counts)).reset_index(drop=True)


def _joined(answers: list[Answer], name: str) -> list:
    """The per-step list `name` of every answer, one after another; None for each step where not recorded."""
    return list(
        chain.from_iterable(
            values if (values := getattr(a, name)) is not None else [None] * len(a.accept_lengths) for a in answers
        )
    )


def _ints(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64)


def from_sources(sources: list[Source]) -> pd.DataFrame:
    """One row per (source, model, task, temperature, method, question, turn) with every recorded field."""
    answers, per_answer = _answers(sources)
    n_turns = _ints(len(a.decoding_steps) for a in answers)
    data = _repeat(per_answer, n_turns)
    turn = _within(n_turns)
    for name in COUNTED_ONCE:
        data[name] = data[name].where(turn == 0)
    for name in SUMMED_ONCE:
        data[name] = data[name].where((turn == 0) | data[name].isna(), 0.0)
    steps = _ints(chain.from_iterable(a.decoding_steps for a in answers))  # [turns]
    new = _ints(chain.from_iterable(a.new_tokens for a in answers))
    wall = np.fromiter(chain.from_iterable(a.wall_time for a in answers), dtype=float)
    spans = np.array(
        [span for a, n in zip(answers, n_turns, strict=True) for span in (a.batch_times or [[np.nan, np.nan]] * n)],
        dtype=float,
    ).reshape(-1, 2)  # [turns, 2]: a batched turn's start and end in its batch
    shares = np.array(
        [part for a, n in zip(answers, n_turns, strict=True) for part in (a.batch_shares or [[np.nan] * 3] * n)],
        dtype=float,
    ).reshape(-1, 3)  # [turns, 3]: its shares of the batch's steps, forward seconds and profiled seconds
    tree = np.array(_joined(answers, "tree_size"), dtype=float)  # [steps], nan where not recorded
    tree_sum = np.bincount(np.repeat(np.arange(steps.size), steps), weights=tree, minlength=steps.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_turn = pd.DataFrame(
            {
                "turn": turn,
                "new_tokens": new,
                "wall_time": wall,
                "steps": steps,
                "tau": np.where(steps > 0, new / steps, np.nan),
                "tokens_per_s": np.where(wall > 0, new / wall, np.nan),
                "batch_start": spans[:, 0],
                "batch_end": spans[:, 1],
                "batch_steps": shares[:, 0],
                "batch_forward": shares[:, 1],
                "batch_profiled": shares[:, 2],
                "mean_tree_size": np.where(steps > 0, tree_sum / steps, np.nan),
                "text": list(
                    chain.from_iterable(
                        a.turns[:n] + [None] * (n - len(a.turns)) for a, n in zip(answers, n_turns, strict=True)
                    )
                ),
            }
        )
    return pd.concat([data, per_turn], axis=1)


def steps_from_sources(sources: list[Source]) -> pd.DataFrame:
    """One row per decoding step: tokens it added (`accepted`, the target's own included), draft depth examined
    (`tested`) and verified tree size, with its answer's key, category and group."""
    answers, per_answer = _answers(sources)
    per_turn = _ints(chain.from_iterable(a.decoding_steps for a in answers))  # steps of each turn
    data = _repeat(per_answer[[*KEY, "category", "group"]], _ints(len(a.accept_lengths) for a in answers))
    data["turn"] = np.repeat(_within(_ints(len(a.decoding_steps) for a in answers)), per_turn)
    data["step"] = _within(per_turn)
    data["accepted"] = _ints(chain.from_iterable(a.accept_lengths for a in answers))
    data["tested"] = _joined(answers, "tested")
    data["tree_size"] = _joined(answers, "tree_size")
    data["drafted"] = _joined(answers, "drafted")  # None where no schedule cut the answer's drafts
    return data


def acceptance_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Per-position acceptance as speculators' evaluation writes it (`metrics.speculators_acceptance`): one row
    per source, model, task, temperature, batch size, method and subset (a question category, then "all" for
    every category together), only where the method drafted; positions up to the deepest draft examined anywhere
    in `steps` (a shallower method's deeper positions are 0: it never accepted there)."""
    group = [c for c in KEY if c != "question_id"]
    tested = steps.tested.dropna()
    positions = int(tested.max()) if len(tested) else 0
    rows = []
    for key, part in steps.groupby(group, sort=False, dropna=False):
        for subset, cut in [*part.groupby("category", sort=False), ("all", part)]:
            row = metrics.speculators_acceptance(cut, positions)
            if row["num_drafts"]:
                rows.append({**dict(zip(group, key, strict=True)), "subset": subset, **row})
    if not rows:
        raise SpecbenchError(
            "no drafts recorded in these answers (vanilla only, or files without tree sizes such as Spec-Bench's): "
            "nothing to export as acceptance"
        )
    return pd.DataFrame(rows)


def frame(paths: list[str | Path]) -> pd.DataFrame:
    """One row per (source, model, task, temperature, method, question, turn) with every recorded field."""
    return from_sources(load_sources(list(map(Path, paths))))


def steps_frame(paths: list[str | Path]) -> pd.DataFrame:
    """One row per decoding step: tokens it added (`accepted`, the target's own included), draft depth
    examined (`tested`) and verified tree size."""
    return steps_from_sources(load_sources(list(map(Path, paths))))


FORMATS = ("csv", "parquet", "jsonl")


def export(data: pd.DataFrame, out: Path, fmt: str | None = None) -> None:
    """Write the frame in `fmt` (default: from out's suffix); a half-written file never stays behind."""
    fmt = fmt or out.suffix.lstrip(".")
    if fmt not in FORMATS:
        raise SpecbenchError(f"cannot tell the format of {out}: name it .csv, .parquet or .jsonl, or use --format")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    try:
        if fmt == "csv":
            data.to_csv(partial, index=False)
        elif fmt == "parquet":
            data.to_parquet(partial, index=False)
        else:
            data.to_json(partial, orient="records", lines=True, force_ascii=False)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
