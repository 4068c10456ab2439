"""The training corpus: single-turn chat conversations from the permissively licensed data sets."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specbench.models.chat import vicuna_prompt
from specbench.zoo.decontam import content_key, eval_keys


@dataclass(frozen=True)
class Conversation:
    """One user prompt and the assistant's answer."""

    source: str
    prompt: str
    answer: str

    def render(self, bos: str = "<s>", eos: str = "</s>") -> str:
        """The conversation as the chat template renders it, answer and end of turn included."""
        return self.render_prompt(bos) + " " + self.answer + eos

    def render_prompt(self, bos: str = "<s>") -> str:
        """The templated text before the answer (what the model sees at evaluation time)."""
        return vicuna_prompt([{"role": "user", "content": self.prompt}], bos=bos)


@dataclass
class Corpus:
    """Shuffled train and held-out conversations, with what went into them."""

    train: list[Conversation]
    heldout: list[Conversation]
    manifest: dict[str, dict[str, int]]  # source -> conversations, characters (train + held out)
    removed_as_eval: int  # conversations dropped because their prompt is a Spec-Bench prompt


def _jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _cut(article: str, max_chars: int) -> str:
    """The article shortened to at most `max_chars`, ending at a sentence end where there is one."""
    article = article.strip()
    if len(article) <= max_chars:
        return article
    head = article[:max_chars]
    end = max(head.rfind(". "), head.rfind(".\n"))
    return head[: end + 1] if end > max_chars // 2 else head


def _join(instruction: str, extra: str) -> str:
    instruction, extra = instruction.strip(), extra.strip()
    return f"{instruction}\n\n{extra}" if extra else instruction


def _gsm8k(d: Path, _: int) -> Iterator[tuple[str, str]]:
    for row in _jsonl(d / "gsm8k" / "train.jsonl"):
        yield row["question"], row["answer"]


def _gpteacher(d: Path, _: int) -> Iterator[tuple[str, str]]:
    for name in ("codegen-instruct.json", "roleplay-simple-deduped-roleplay-instruct.json"):
        for row in json.loads((d / "gpteacher" / name).read_text(encoding="utf-8")):
            yield _join(row["instruction"], row["input"]), row["response"]


def _dolly(d: Path, _: int) -> Iterator[tuple[str, str]]:
    pattern = re.compile(r"^### Human:(.*?)### Assistant:(.*)$", re.S)
    for row in _jsonl(d / "dolly_open_qa" / "chinkara-open_qa.jsonl"):
        match = pattern.match(row["text"])
        if match:
            yield match.group(1), match.group(2)


def _self_instruct(d: Path, _: int) -> Iterator[tuple[str, str]]:
    for row in _jsonl(d / "self_instruct_user_oriented" / "text-davinci-003_predictions.jsonl"):
        yield _join(row["instruction"], row["input"]), row["response"]


def _xsum(d: Path, max_chars: int) -> Iterator[tuple[str, str]]:
    for row in _jsonl(d / "xsum" / "test.jsonl"):
        yield "Summarize: " + _cut(row["document"], max_chars), row["summary"]


def _cnn_dailymail(d: Path, max_chars: int) -> Iterator[tuple[str, str]]:
    for row in _jsonl(d / "cnn_dailymail" / "cnn_dailymail_200_article_highlights.jsonl"):
        highlights = " ".join(line.strip() for line in row["highlights"].splitlines() if line.strip())
        yield "Summarize: " + _cut(row["article"], max_chars), highlights


def _tatoeba(d: Path, _: int) -> Iterator[tuple[str, str]]:
    for row in _jsonl(d / "tatoeba_de_en" / "tatoeba_de_en.jsonl"):
        yield "Translate German to English: " + row["de"], row["en"]


SOURCES = {
    "gsm8k_train": _gsm8k,
    "gpteacher": _gpteacher,
    "dolly_open_qa": _dolly,
    "self_instruct_user_oriented": _self_instruct,
    "xsum": _xsum,
    "cnn_dailymail": _cnn_dailymail,
    "tatoeba_de_en": _tatoeba,
}


def build_corpus(
    data_dir: Path, *, seed: int, heldout_frac: float, max_article_chars: int, per_source_limit: int | None
) -> Corpus:
    """Read every source, drop empty and evaluation prompts, shuffle with `seed`, hold out a part."""
    banned = eval_keys(data_dir)
    conversations: list[Conversation] = []
    manifest: dict[str, dict[str, int]] = {}
    removed = 0
    for source, read in SOURCES.items():
        kept = []
        for prompt, answer in read(data_dir, max_article_chars):
            prompt, answer = prompt.strip(), answer.strip()
            if not prompt or not answer:
                continue
            if content_key(prompt) in banned:
                removed += 1
                continue
            kept.append(Conversation(source, prompt, answer))
        kept = kept[:per_source_limit]
        manifest[source] = {
            "conversations": len(kept),
            "characters": sum(len(c.prompt) + len(c.answer) for c in kept),
        }
        conversations += kept
    random.Random(seed).shuffle(conversations)
    n_heldout = max(1, round(len(conversations) * heldout_frac))
    return Corpus(conversations[n_heldout:], conversations[:n_heldout], manifest, removed)
