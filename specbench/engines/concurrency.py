"""Concurrency sweeps of engine mode (`run --engine vllm --concurrency 1,4,...`): the sweeps a run still owes, their
per-request rows in the run folder's concurrency.jsonl, and the per-level numbers the report shows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..tasks import Question
from .steps import step_lengths

FILE = "concurrency.jsonl"


@dataclass
class Sweep:
    """A task's questions answered by one method at one temperature with `level` conversations in flight."""

    task: str
    temperature: float
    method: str
    level: int
    budget: int
    questions: list[Question]


def read(path: Path) -> pd.DataFrame:
    """The rows of a concurrency.jsonl (a line cut short by a killed run is ignored); empty when there is none."""
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if line.endswith("\n") and line.strip():
                records.append(json.loads(line))
    return pd.DataFrame.from_records(records)


def done(path: Path) -> set[tuple]:
    """(task, temperature, method, level) of every sweep already on disk (a level's rows are written together)."""
    rows = read(path)
    if rows.empty:
        return set()
    return set(rows[["task", "temperature", "method", "concurrency"]].itertuples(index=False, name=None))


def append(path: Path, rows: list[dict]) -> None:
    """A level's rows, written in one go and flushed."""
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
        f.flush()


def rows(sweep: Sweep, conversations: list, wall: float) -> list[dict]:
    """One row per request (turn) of a finished sweep; `wall` is the whole level's wall time."""
    out = []
    for conv in conversations:
        for number, turn in enumerate(conv.turns):
            steps = turn.steps or len(step_lengths(len(turn.tokens), turn.accepted, turn.drafted)[0])
            out.append(
                {
                    "task": sweep.task,
                    "temperature": sweep.temperature,
                    "method": sweep.method,
                    "concurrency": sweep.level,
                    "question_id": conv.question.id,
                    "turn": number,
                    "prompt_tokens": turn.prompt_tokens,
                    "new_tokens": len(turn.tokens),
                    "steps": steps,
                    "ttft": turn.first,
                    "latency": turn.end,
                    "level_wall": wall,
                }
            )
    return out


def levels(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (task, temperature, method, concurrency): throughput (new tokens / the level's wall time), its ratio to
    vanilla's at the same level, per-user throughput (Σ new tokens / Σ each request's latency: the rate one
    conversation sees, as the batch sweep's), τ, median time to first token, mean time per output token after the
    first, and mean request latency."""
    rows = rows.assign(tpot=(rows.latency - rows.ttft) / (rows.new_tokens - 1).where(rows.new_tokens > 1))
    keys = ["task", "temperature", "method", "concurrency"]
    out = (
        rows.groupby(keys)
        .agg(
            new_tokens=("new_tokens", "sum"),
            steps=("steps", "sum"),
            wall=("level_wall", "max"),
            ttft=("ttft", "median"),
            tpot=("tpot", "mean"),
            latency=("latency", "mean"),
            waited=("latency", "sum"),
            requests=("new_tokens", "size"),
        )
        .reset_index()
    )
    out["throughput"] = out.new_tokens / out.wall
    out["per_user"] = out.new_tokens / out.waited
    out["tau"] = out.new_tokens / out.steps
    vanilla = out[out.method == "vanilla"].set_index(["task", "temperature", "concurrency"]).throughput
    base = out.set_index(["task", "temperature", "concurrency"]).index.map(vanilla.to_dict())
    out["speedup"] = out.throughput / pd.Series(base, index=out.index, dtype=float)
    return out
