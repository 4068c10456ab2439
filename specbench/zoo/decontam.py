"""Keeping the evaluation prompts (Spec-Bench, hence also MT-bench) out of the training corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

# Instructions that Spec-Bench (and the corpus) put in front of the actual content.
_PREFIXES = ("Summarize: ", "Translate German to English: ")
_KEY_CHARS = 100


def content_key(text: str) -> str:
    """Normalised start of a prompt's content, the unit two prompts are compared by."""
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    return re.sub(r"\s+", " ", text).strip().lower()[:_KEY_CHARS]


def eval_keys(data_dir: Path) -> set[str]:
    """Keys of every Spec-Bench turn."""
    keys: set[str] = set()
    with open(data_dir / "spec_bench" / "question.jsonl", encoding="utf-8") as f:
        for line in f:
            keys.update(content_key(turn) for turn in json.loads(line)["turns"])
    return keys
