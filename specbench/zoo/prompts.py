"""Prompts whose greedy answers the model card shows."""

from __future__ import annotations

import json
from pathlib import Path

GENERAL = [
    "Translate German to English: Der Zug nach Berlin hat heute eine Stunde Verspätung.",
    "Summarize: The city council voted on Tuesday to turn the old railway station into a public library. "
    "The building has stood empty for twelve years since the last trains stopped running. Supporters say the "
    "library will bring visitors back to the town centre, while critics worry about the cost of repairing "
    "the roof. Work is expected to begin next spring and to take about two years.",
    "What are the main causes of climate change?",
    "Write a short poem about the sea.",
]


def gsm8k_test(data_dir: Path, n: int) -> list[str]:
    """The first `n` GSM8K test questions."""
    with open(data_dir / "gsm8k" / "test.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f, strict=False)]


def quick_first_turns() -> list[str]:
    """The first turn of every question of the built-in `quick` task (the default benchmark's prompts)."""
    from specbench.tasks import load

    return [q.turns[0] for q in load("quick").questions]


def spec_bench_first_turns(data_dir: Path, per_subtask: int) -> dict[str, list[str]]:
    """First turns of the first `per_subtask` Spec-Bench questions of each subtask, by subtask (the corpus
    never contains them: they are only evaluated). Empty when `data_dir` lacks Spec-Bench's question file."""
    from specbench import presets
    from specbench.tasks import limit_per_category, load

    if not (data_dir / presets.load("tasks", "spec_bench").source.file).is_file():
        return {}
    by_subtask: dict[str, list[str]] = {}
    for q in limit_per_category(load("spec_bench", data_dir).questions, per_subtask):
        by_subtask.setdefault(q.group, []).append(q.turns[0])
    return by_subtask
