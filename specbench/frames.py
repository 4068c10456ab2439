"""Results as pandas data frames: one row per answered turn (`frame`) or per decoding step (`steps_frame`).

Both read run folders, folders of answer files or single answer files (Spec-Bench's own included) through
`sources.load_sources`, so a notebook sees exactly what `report` and `compare` see. Columns that a file does
not record (Spec-Bench's files have no tree sizes, seeds or greedy checks) are missing values.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .errors import SpecbenchError
from .results import Answer
from .sources import Source, load_sources


def _machine(source: Source) -> dict:
    manifest = source.manifest or {}
    config = manifest.get("config") or {}
    return {
        "device": (manifest.get("machine") or {}).get("device_name"),
        "dtype": config.get("dtype"),
        "run_started": manifest.get("started"),
    }


def _turn_steps(answer: Answer) -> list[range]:
    """The step indices of each turn (steps are recorded for all turns in one list)."""
    bounds, start = [], 0
    for n in answer.decoding_steps:
        bounds.append(range(start, start + n))
        start += n
    return bounds


def _key(source: Source, answer: Answer) -> dict:
    return {
        "source": source.name,
        "model": answer.model,
        "task": answer.task,
        "temperature": answer.temperature,
        "method": answer.method,
        "question_id": answer.question_id,
    }


def _turn_rows(source: Source, answer: Answer) -> list[dict]:
    check = answer.greedy_check or {}
    shared = {
        **_key(source, answer),
        "category": answer.category,
        "group": answer.group,
        "lossless_rule": answer.lossless_rule,
        "seed": answer.seed,
        "greedy_match": check.get("match"),
        "greedy_near_tie": check.get("near_tie"),
        "busy_cpus": answer.busy_cpus,
        "answer_draft_time": answer.draft_time,  # seconds over all turns: recorded per answer
        "answer_verify_time": answer.verify_time,
        **_machine(source),
    }
    rows = []
    for turn, steps in enumerate(_turn_steps(answer)):
        new, wall = answer.new_tokens[turn], answer.wall_time[turn]
        sizes = [answer.tree_size[i] for i in steps] if answer.tree_size else []
        rows.append(
            {
                **shared,
                "turn": turn,
                "new_tokens": new,
                "wall_time": wall,
                "steps": len(steps),
                "tau": new / len(steps) if steps else float("nan"),
                "tokens_per_s": new / wall if wall > 0 else float("nan"),
                "mean_tree_size": sum(sizes) / len(sizes) if sizes else float("nan"),
                "text": answer.turns[turn] if turn < len(answer.turns) else None,
            }
        )
    return rows


def _step_rows(source: Source, answer: Answer) -> list[dict]:
    key = _key(source, answer)
    rows = []
    for turn, steps in enumerate(_turn_steps(answer)):
        for step, i in enumerate(steps):
            rows.append(
                {
                    **key,
                    "turn": turn,
                    "step": step,
                    "accepted": answer.accept_lengths[i],
                    "tested": answer.tested[i] if answer.tested else None,
                    "tree_size": answer.tree_size[i] if answer.tree_size else None,
                }
            )
    return rows


def frame(paths: list[str | Path]) -> pd.DataFrame:
    """One row per (source, model, task, temperature, method, question, turn) with every recorded field."""
    rows = [row for s in load_sources(list(map(Path, paths))) for a in s.answers for row in _turn_rows(s, a)]
    return pd.DataFrame(rows)


def steps_frame(paths: list[str | Path]) -> pd.DataFrame:
    """One row per decoding step: tokens it added (`accepted`, the target's own included), draft depth
    examined (`tested`) and verified tree size."""
    rows = [row for s in load_sources(list(map(Path, paths))) for a in s.answers for row in _step_rows(s, a)]
    return pd.DataFrame(rows)


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
