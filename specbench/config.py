"""What a run is: the settings it is asked for (RunConfig), what it will do once worked out (Plan), the seed of each
question, and the units of work it splits into (a question at one temperature, with the methods still to answer it).
Our loop, engine mode and Ray workers all speak these types."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from .models.aliases import ModelSpec
from .models.hub import Checkpoint
from .results import Answer
from .tasks import Question

AA = "vanilla-aa"  # vanilla timed a second time in the same interleaving: its "speedup" is the run's noise floor


@dataclass
class RunConfig:
    model: str = "tiny"
    methods: list[str] = field(default_factory=lambda: ["default"])  # names, variants, "all" or "default"
    tasks: list[str] = field(default_factory=lambda: ["quick"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    limit: int | None = None  # questions per category
    max_new_tokens: int | None = None  # None: each task's own default
    device: str = "auto"
    dtype: str = "auto"
    out: str | None = None
    data_dir: str | None = None
    seed: int = 0
    draft: str | None = None
    heads: dict[str, str] = field(default_factory=dict)  # method family (or "*") -> head checkpoint (--head)
    revision: str | None = None  # of a hub target given by id (aliases pin their own)
    trust_remote_code: bool = False
    fields: dict[str, str] = field(default_factory=dict)
    warmup: bool = True
    progress: bool = True
    noise_floor: bool = True  # time vanilla twice per question (the A/A column) to report the run's noise
    repeats: int = 1  # timings per question and method; the median one is kept
    shard: list[int] | None = None  # [I, N]: only every N-th question from the I-th (1-based), for array jobs
    workers: int | None = None  # Ray workers of one device each; None: this process alone, without Ray
    ray_address: str | None = None  # an existing Ray cluster to join (None: start a local one)
    threads: int | None = None  # torch CPU threads per worker (None: torch's default alone, cores / workers on Ray)
    tuned: str | None = None  # a tuned-presets file (--tuned): each tuned method's chosen variant runs beside it
    compile: bool = False  # torch.compile the target, draft and heads (--compile); vLLM's compilation in engine mode
    graphs: bool = False  # the target and draft model on static caches, forwards captured as CUDA graphs (--graphs)
    engine: str = "specbench"  # "vllm": engine mode, the questions answered inside vLLM (specbench.engines)
    concurrency: list[int] | None = None  # engine mode: conversations in flight, one sweep per level
    one_engine_at_a_time: bool = False  # engine mode: methods one after another instead of every engine at once


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
