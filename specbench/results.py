"""Answer files: Spec-Bench-compatible JSON lines plus our extra fields, appended and read back."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .core.synthetic import Profile
from .errors import SpecbenchError
from .models.chat import turn_prompts
from .tasks import Question


@dataclass
class Answer:
    """One question answered by one method at one temperature (all its turns)."""

    question_id: int | str
    category: str
    group: str
    method: str
    temperature: float
    model: str
    task: str
    new_tokens: list[int]  # per turn
    wall_time: list[float]  # per turn
    decoding_steps: list[int]  # per turn
    accept_lengths: list[int]  # per step, all turns
    turns: list[str] = field(default_factory=list)
    tested: list[int] | None = None  # per step: draft depth examined (None in Spec-Bench files)
    tree_size: list[int] | None = None  # per step
    drafted: list[int] | None = None  # per step, where a schedule verified fewer tokens than were drafted
    draft_time: float | None = None  # seconds, all turns
    verify_time: float | None = None
    output_ids: list[list[int]] | None = None  # per turn
    seed: int | None = None
    lossless_rule: bool = True
    synthetic: list[float] | None = None  # cost-only: the acceptance rates that forced its verdicts (core.synthetic)
    greedy_check: dict | None = None  # vs vanilla at T=0: match, turn, position, margins, noise, verdict
    busy_cpus: float | None = None  # CPUs' worth of other processes' work while this answer was timed
    position: int | None = None  # the question's place in its task's run order (at this temperature)
    order: int | None = None  # the method's place among the methods timed on this question, in the order they ran
    node: dict | None = None  # --workers: the worker (its number) and Ray node (id, ip, host) that answered it
    batch_size: int = 1  # sequences decoded together (`--batch`)
    batch_times: list[list[float]] | None = None  # per turn, B > 1: [start, end] in seconds from the batch's start
    batch_shares: list[list[float]] | None = None  # per turn, B > 1: its shares of the batch's steps, forward
    # seconds and profiled forward seconds (`run.worker.batch_shares`)
    target_top1: list[list[int]] | None = None  # per turn, T=0, in memory only: core.decode.Generation's
    target_margin: list[list[float]] | None = None

    def to_record(self, model_id: str) -> dict:
        """A Spec-Bench answer line, with our fields under "specbench"."""
        return {
            "question_id": self.question_id,
            "category": self.category,
            "answer_id": uuid.uuid4().hex[:22],
            "model_id": model_id,
            "choices": [
                {
                    "index": 0,
                    "turns": self.turns,
                    "decoding_steps": self.decoding_steps,
                    "new_tokens": self.new_tokens,
                    "wall_time": self.wall_time,
                    "accept_lengths": self.accept_lengths,
                }
            ],
            "tstamp": time.time(),
            "specbench": {
                "group": self.group,
                "method": self.method,
                "temperature": self.temperature,
                "model": self.model,
                "task": self.task,
                "seed": self.seed,
                "lossless_rule": self.lossless_rule,
                "synthetic": self.synthetic,
                "tested": self.tested,
                "tree_size": self.tree_size,
                "drafted": self.drafted,
                "draft_time": self.draft_time,
                "verify_time": self.verify_time,
                "output_ids": self.output_ids,
                "busy_cpus": self.busy_cpus,
                "position": self.position,
                "order": self.order,
                "node": self.node,
                "greedy_check": self.greedy_check,
                "batch_size": self.batch_size,
                "batch_times": self.batch_times,
                "batch_shares": self.batch_shares,
            },
        }


@dataclass(frozen=True)
class TurnSteps:
    """One answered turn as an engine measured it: its tokens, its wall time and, per target forward, the tokens it
    gained, the draft depth it examined and the rows it verified."""

    tokens: list[int]
    wall_time: float
    accept_lengths: list[int]
    tested: list[int]
    tree_size: list[int]
    target_top1: list[int] | None = None  # T=0, our loop only: see core.decode.Generation
    target_margin: list[float] | None = None
    drafted: list[int] | None = None  # tokens drafted (our loop), beside the tree_size - 1 verified


def answer(
    question: Question,
    task: str,
    method: str,
    temperature: float,
    model: str,
    seed: int,
    lossless: bool,
    texts: list[str],
    turns: list[TurnSteps],
    draft_time: float | None = None,
    verify_time: float | None = None,
    synthetic: Profile | None = None,
) -> Answer:
    """The record of one question answered by one method, from either engine; draft and verify seconds, all turns;
    `synthetic`: the profile that forced its verdicts (a cost-only answer)."""
    top1 = [t.target_top1 for t in turns if t.target_top1 is not None]
    margin = [t.target_margin for t in turns if t.target_margin is not None]
    drafted, sizes = [n for t in turns for n in (t.drafted or [])], [n for t in turns for n in t.tree_size]
    cut = len(drafted) == len(sizes) and any(n > size - 1 for n, size in zip(drafted, sizes, strict=True))
    return Answer(
        question_id=question.id,
        category=question.category,
        group=question.group,
        method=method,
        temperature=temperature,
        model=model,
        task=task,
        new_tokens=[len(t.tokens) for t in turns],
        wall_time=[t.wall_time for t in turns],
        decoding_steps=[len(t.accept_lengths) for t in turns],
        accept_lengths=[n for t in turns for n in t.accept_lengths],
        turns=texts,
        tested=[d for t in turns for d in t.tested],
        tree_size=[n for t in turns for n in t.tree_size],
        drafted=drafted if cut else None,
        output_ids=[t.tokens for t in turns],
        target_top1=top1 if len(top1) == len(turns) else None,
        target_margin=margin if len(margin) == len(turns) else None,
        seed=seed,
        lossless_rule=lossless,
        synthetic=None if synthetic is None else list(synthetic.rates),
        draft_time=draft_time,
        verify_time=verify_time,
    )


def check_greedy(answers: dict[str, Answer], reference: Answer | None, question: Question, tokenizer, model) -> None:
    """At T=0, set each method's `greedy_check` against vanilla's answer (`reference`, this run's or an earlier
    part's): token for token, and at a mismatch whether it is numerical or a bug (core.losslessness.greedy_check).
    `model()` gives the target that measures it, asked for only when some answer diverged. A cost-only answer
    (`synthetic`) has tokens the target never chose: it is not checked."""
    if reference is None or reference.synthetic or any(a.temperature != 0 for a in answers.values()):
        return
    from .core.losslessness import first_divergence, greedy_check  # torch: not needed to read answer files

    prompts = turn_prompts(tokenizer, question.turns, reference.turns, question.thinking)
    for name, ours in answers.items():
        if name != "vanilla" and not ours.synthetic:
            assert ours.output_ids is not None and reference.output_ids is not None  # as `answer` and our files have
            diverged = first_divergence(ours.output_ids, reference.output_ids) is not None
            ours.greedy_check = greedy_check(
                model() if diverged else None,
                ours.output_ids,
                reference.output_ids,
                prompts,
                ours.target_top1,
                ours.target_margin,
                reference.target_margin,
            )


def spec_bench_group(category: str) -> str:
    """The Spec-Bench subtask of a label in Spec-Bench's own answer files (its task preset's groups)."""
    from .tasks import groups

    return next((g for g, labels in groups("spec_bench").items() if category in labels), category)


_NAME = re.compile(
    r"^(?P<model>.+?)-(?P<method>vanilla|baseline|[a-z0-9_]+(?:-[0-9a-z]+)?)-(?:float16|float32|bfloat16)"
    r"-temp(?:erature)?-(?P<temp>[0-9.]+)$"
)


def _from_spec_bench_name(stem: str) -> tuple[str, str, float]:
    """Model, method and temperature from a Spec-Bench file name (vicuna-7b-v1.3-sps-68m-float16-temp-0.0)."""
    match = _NAME.match(stem)
    if not match:
        return stem, stem, 0.0
    method = "vanilla" if match["method"] == "baseline" else match["method"]
    return match["model"], method, float(match["temp"])


def from_record(record: dict, source: Path) -> Answer:
    choice = record["choices"][0]
    extra = record.get("specbench")
    if extra is None:  # written by Spec-Bench itself
        model, method, temperature = _from_spec_bench_name(source.stem)
        extra = {
            "group": spec_bench_group(record["category"]),
            "method": method,
            "temperature": temperature,
            "model": model,
            "task": "spec_bench",
        }
    return Answer(
        question_id=record["question_id"],
        category=record["category"],
        group=extra["group"],
        method=extra["method"],
        temperature=float(extra["temperature"]),
        model=extra["model"],
        task=extra["task"],
        new_tokens=list(choice["new_tokens"]),
        wall_time=list(choice["wall_time"]),
        decoding_steps=list(choice["decoding_steps"]),
        accept_lengths=list(choice["accept_lengths"]),
        turns=list(choice.get("turns", [])),
        tested=extra.get("tested"),
        tree_size=extra.get("tree_size"),
        drafted=extra.get("drafted"),
        draft_time=extra.get("draft_time"),
        verify_time=extra.get("verify_time"),
        output_ids=extra.get("output_ids"),
        seed=extra.get("seed"),
        lossless_rule=extra.get("lossless_rule", True),
        synthetic=extra.get("synthetic"),
        greedy_check=extra.get("greedy_check"),
        busy_cpus=extra.get("busy_cpus"),
        position=extra.get("position"),
        order=extra.get("order", extra.get("slot")),  # ("slot" in files written before 2026-11-29)
        node=extra.get("node"),
        batch_size=int(extra.get("batch_size") or 1),
        batch_times=extra.get("batch_times"),
        batch_shares=extra.get("batch_shares"),
    )


def read_file(path: Path) -> list[Answer]:
    """Complete lines of an answer file (a line cut short by a killed run is ignored)."""
    answers = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                answers.append(from_record(json.loads(line), path))
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise SpecbenchError(f"{path}:{lineno}: not valid JSON") from None
            except (KeyError, IndexError, TypeError) as err:
                raise SpecbenchError(f"{path}:{lineno}: not an answer record (missing {err})") from err
    return answers


def read_answers(path: str | Path) -> list[Answer]:
    """Every answer under a run folder or a folder of answer files, or in one answer file."""
    path = Path(path)
    if path.is_file():
        return read_file(path)
    if not path.is_dir():
        raise SpecbenchError(f"{path} is neither a run folder nor an answer file")
    if (path / "manifest.json").is_file() and (path / "answers").is_dir():  # a run folder: other files are not answers
        path = path / "answers"
    files = sorted(path.rglob("*.jsonl"))
    if not files:
        raise SpecbenchError(f"{path} holds no answer files (*.jsonl)")
    return [a for f in files for a in read_file(f)]


def append(path: Path, answer: Answer, model_id: str) -> None:
    """Append one answer and flush it to disk, so a killed run loses at most the question in progress."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        _drop_partial_line(path)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(answer.to_record(model_id), ensure_ascii=False) + "\n")
        f.flush()


def _drop_partial_line(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: data.rfind(b"\n") + 1])
