"""Runs the matrix tasks x temperatures x methods for one model: warm-up, seeding, timing, resumable output."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import __version__, acceptance, methods, metrics, models, tasks
from . import plan as planning
from .cached_lm import CachedLM
from .chat import prompt_ids
from .decode import Generation, decode
from .errors import SpecbenchError
from .losslessness import greedy_check
from .progress import Progress
from .results import Answer, append, read_file


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


def question_seed(base: int, question_id: int | str, temperature: float) -> int:
    """A seed per question (and temperature), stable across methods and runs."""
    return zlib.crc32(f"{base}/{question_id}/{temperature}".encode())


def default_out(cfg: RunConfig) -> Path:
    """The same command resumes into the same folder."""
    key = json.dumps([cfg.model, sorted(cfg.tasks), cfg.limit, cfg.max_new_tokens, cfg.dtype, cfg.seed])
    shard = f"-shard{cfg.shard[0]}of{cfg.shard[1]}" if cfg.shard else ""
    return (
        Path("results")
        / f"{Path(cfg.model).name}-{'+'.join(Path(t).stem for t in cfg.tasks)}-{zlib.crc32(key.encode()):08x}{shard}"
    )


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {
        "device": device.type,
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specbench": __version__,
        "git_revision": _git_revision(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "busy_cpus": busy_cpus(),
    }


def busy_cpus(seconds: float = 0.5) -> float | None:
    """CPUs' worth of work other processes do right now (from /proc/stat over `seconds`; None off Linux).
    Unlike the load average, it does not remember a job that has just finished."""

    first = _cpu_ticks()
    time.sleep(seconds)
    last = _cpu_ticks()
    if first is None or last is None:
        return None
    return (1 - (last[1] - first[1]) / max(last[0] - first[0], 1)) * (os.cpu_count() or 1)


def _cpu_ticks() -> tuple[int, int] | None:
    """All CPUs' (total, idle + iowait) clock ticks since boot, from /proc/stat; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]
    except (OSError, ValueError, IndexError):
        return None


class OtherLoad:
    """CPUs' worth of work other processes did over an interval: all CPUs' busy time (/proc/stat) minus this
    process's own CPU time, over the wall time. None off Linux."""

    def __enter__(self) -> OtherLoad:
        self.start = self._sample()
        self.value: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        end = self._sample()
        if self.start is not None and end is not None and end[2] > self.start[2]:
            busy, own, wall = (e - s for e, s in zip(end, self.start, strict=True))
            self.value = max(0.0, (busy - own) / wall)

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        """(all CPUs' busy seconds, this process's CPU seconds, wall clock)."""
        ticks = _cpu_ticks()
        if ticks is None:
            return None
        own = os.times()
        return (ticks[0] - ticks[1]) / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()


@contextmanager
def without_gc() -> Iterator[None]:
    """Collect first, then keep Python's cyclic collector out of a timed region (as timeit does): its pauses
    would land on whichever method happens to be running."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def warn_if_busy(info: dict) -> None:
    """Timing on a loaded machine is wrong (and CPU thread pools degrade badly under contention): say so."""
    busy, cpus = info.get("busy_cpus"), info.get("cpu_count") or 1
    if busy is not None and busy > metrics.BUSY_SHARE * cpus:
        print(
            f"specbench: warning: other processes keep {busy:.1f} of {cpus} CPUs busy; they will distort the timings",
            file=sys.stderr,
        )


@torch.inference_mode()
def forward_profile(
    target: CachedLM, context: int = 256, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 5
) -> dict[int, float]:
    """Median seconds of one target forward over k new tokens after `context` cached tokens (for roofline)."""
    context = min(context, target.context_length - max(sizes) - 1)
    vocab = target.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    filler = torch.randint(0, vocab, (context + max(sizes),), generator=generator).tolist()
    target.reset()
    target.forward(filler[:context], last_only=True)
    out = {}
    for k in sizes:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            target.forward(filler[context : context + k])
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            times.append(time.perf_counter() - start)
            target.crop(context)
        out[k] = sorted(times[1:])[len(times[1:]) // 2]
    return out


def prepare(cfg: RunConfig) -> planning.Plan:
    """The run's plan (nothing loaded yet); skipped methods are announced one line each."""
    models.pick_dtype(cfg.dtype, models.pick_device(cfg.device))  # a bad --device/--dtype fails first
    plan = planning.make(cfg)
    for name, why in plan.skipped.items():
        print(f"{name} skipped: {why}", file=sys.stderr)
    return plan


class Session:
    """A loaded target model with its tokenizer, ready to run methods over questions."""

    def __init__(self, cfg: RunConfig, plan: planning.Plan, paths: dict[str, Path]) -> None:
        self.cfg = cfg
        self.spec = plan.spec
        self.plan = plan
        self.paths = paths
        self.device = models.pick_device(cfg.device)
        self.dtype = models.pick_dtype(cfg.dtype, self.device)
        self.tokenizer = models.load_tokenizer(paths["target"], cfg.trust_remote_code)
        self.model = models.load_causal_lm(paths["target"], self.device, self.dtype, "target", cfg.trust_remote_code)
        self.target = CachedLM(self.model)
        self.stop_ids = models.stop_ids(self.tokenizer, self.model)
        self.rules: dict[str, acceptance.Rule] = {}  # method -> its acceptance rule, read from its preset once
        self.resources = methods.Resources(
            self.spec.name,
            self.model,
            self.tokenizer,
            self.device,
            self.dtype,
            draft_path=paths.get("draft"),
            head_paths={role.removesuffix(" head"): p for role, p in paths.items() if role.endswith(" head")},
            trust_remote_code=cfg.trust_remote_code,
        )

    @classmethod
    def open(cls, cfg: RunConfig) -> Session:
        """Plan, fetch and check every checkpoint, then load the target: mistakes surface before it loads."""
        plan = prepare(cfg)
        return cls(cfg, plan, planning.fetch(plan, cfg.trust_remote_code))

    def check_fits(self, question: tasks.Question, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids for `messages`, or a clear error when they leave no room in the model's context."""
        ids = prompt_ids(self.tokenizer, messages)
        if len(ids) >= self.target.context_length:
            raise SpecbenchError(
                f"question {question.id}: its prompt has {len(ids)} tokens, more than the model's context of "
                f"{self.target.context_length}; drop it from the task or use a model with a longer context"
            )
        return ids

    def answer(
        self,
        method: str,
        proposer,
        question: tasks.Question,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ):
        """Decode every turn with the method's proposer and acceptance rule, feeding the model's own earlier
        answers back. Returns generations, prompts and texts."""
        if method not in self.rules:
            self.rules[method] = methods.rule(method)
        rule = self.rules[method]
        generator = torch.Generator(self.device).manual_seed(seed)
        messages: list[dict[str, str]] = []
        gens: list[Generation] = []
        prompts: list[list[int]] = []
        texts: list[str] = []
        for number, turn in enumerate(question.turns):
            messages.append({"role": "user", "content": turn})
            ids = self.check_fits(question, messages)
            gen = decode(
                self.target,
                proposer,
                ids,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                stop_ids=self.stop_ids,
                generator=generator,
                rule=rule,
                request=((question.group, question.id), number),
            )
            text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": text})
            gens.append(gen)
            prompts.append(ids)
            texts.append(text)
        return gens, prompts, texts


def _answer_record(question, task, method, lossless, temperature, model_name, seed, gens, texts) -> Answer:
    return Answer(
        question_id=question.id,
        category=question.category,
        group=question.group,
        method=method,
        temperature=temperature,
        model=model_name,
        task=task,
        new_tokens=[len(g.tokens) for g in gens],
        wall_time=[g.wall_time for g in gens],
        decoding_steps=[len(g.steps) for g in gens],
        accept_lengths=[s.accept_length for g in gens for s in g.steps],
        turns=texts,
        tested=[s.tested for g in gens for s in g.steps],
        tree_size=[s.tree_size for g in gens for s in g.steps],
        draft_time=sum(g.prefill_draft_time + sum(s.draft_time for s in g.steps) for g in gens),
        verify_time=sum(sum(s.verify_time for s in g.steps) for g in gens),
        output_ids=[g.tokens for g in gens],
        seed=seed,
        lossless_rule=lossless,
    )


def _check_manifest(path: Path, manifest: dict) -> None:
    """A resumed run must have the settings it started with; otherwise its numbers would mix."""
    if not path.exists():
        path.write_text(json.dumps(manifest, indent=2))
        return
    old = json.loads(path.read_text())
    keys = {"model": None, "dtype": None, "device": None, "max_new_tokens": None, "seed": None, "limit": None,
            "repeats": 1, "shard": None}  # key -> its value in manifests written before it was recorded
    differ = [k for k, default in keys.items() if old["config"].get(k, default) != manifest["config"].get(k)]
    if old["machine"]["device_name"] != manifest["machine"]["device_name"]:
        differ.append("machine")
    if differ:
        raise SpecbenchError(
            f"{path.parent} holds a run with different {', '.join(differ)}: pass another --out to start a new run"
        )
    merged = {
        **old,
        "config": {
            **old["config"],
            "methods": sorted(set(old["config"]["methods"]) | set(manifest["config"]["methods"])),
        },
    }
    path.write_text(json.dumps(merged, indent=2))


def answer_path(run_dir: Path, task: str, method: str, temperature: float) -> Path:
    return run_dir / "answers" / task / f"{method}-temperature-{temperature:g}.jsonl"


def run(cfg: RunConfig) -> Path:
    """Run the matrix; returns the run folder. Re-running the same command resumes where it stopped."""
    if cfg.max_new_tokens is not None and cfg.max_new_tokens <= 0:
        raise SpecbenchError(f"--max-new-tokens must be positive, got {cfg.max_new_tokens}")
    if any(t < 0 for t in cfg.temperatures):
        raise SpecbenchError("temperatures must be >= 0")
    if cfg.repeats < 1:
        raise SpecbenchError(f"--repeats must be at least 1, got {cfg.repeats}")
    if cfg.shard and not 1 <= cfg.shard[0] <= cfg.shard[1]:
        raise SpecbenchError(f"--shard {cfg.shard[0]}/{cfg.shard[1]}: write I/N with 1 <= I <= N, e.g. 2/4")
    plan = prepare(cfg)
    task_list = [tasks.load(t, cfg.data_dir, cfg.fields) for t in cfg.tasks]
    session = Session(cfg, plan, planning.fetch(plan, cfg.trust_remote_code))
    names = plan.methods
    run_dir = Path(cfg.out) if cfg.out else default_out(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "config": {
            **asdict(cfg),
            "methods": names,
            "device": session.device.type,
            "dtype": str(session.dtype).removeprefix("torch."),
        },
        "model": {"name": session.spec.name, "path": session.spec.path},
        "checkpoints": planning.revisions(session.plan, session.paths),
        "skipped": session.plan.skipped,
        "machine": machine(session.device),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    warn_if_busy(manifest["machine"])
    _check_manifest(run_dir / "manifest.json", manifest)
    profile_path = run_dir / "forward_profile.json"
    if not profile_path.exists():
        profile_path.write_text(json.dumps(forward_profile(session.target)))

    units = _units(run_dir, task_list, cfg, names, session)
    proposers = {name: methods.build(name, session.resources) for name in names}  # fail fast on bad checkpoints
    lossless = {name: methods.preset(name).lossless for name in names}
    bar = Progress(sum(len(u.methods) for u in units), "answers", "answers", enabled=cfg.progress)
    warmed: set[str] = set()
    warned = False
    for unit in units:
        if cfg.warmup:  # one discarded question per method before its first timed one
            for name in (n for n in unit.methods if _base(n) not in warmed):
                bar.set_description(f"warm-up {name}")
                session.answer(_base(name), proposers[_base(name)], unit.question, unit.budget, unit.temperature, 0)
                warmed.add(_base(name))
        bar.set_description(f"{unit.task} T={unit.temperature:g} question {unit.question.id}")
        seed = question_seed(cfg.seed, unit.question.id, unit.temperature)
        timed: dict[str, list] = {name: [] for name in unit.methods}
        for _ in range(cfg.repeats):  # rounds: every method back to back on this question, in the rotated order
            for name in unit.methods:
                with without_gc(), OtherLoad() as load:
                    gens, _, texts = session.answer(_base(name), proposers[_base(name)], unit.question, unit.budget,
                                                    unit.temperature, seed)  # fmt: skip
                timed[name].append((sum(g.wall_time for g in gens), gens, texts, load.value))
        answers = {}
        for name, runs in timed.items():
            if len({tuple(map(tuple, (g.tokens for g in r[1]))) for r in runs}) > 1:
                print(f"\nspecbench: warning: {name} gave different tokens across the {cfg.repeats} repeats of "
                      f"question {unit.question.id} (nondeterministic kernels?); the median-time repeat is kept",
                      file=sys.stderr)  # fmt: skip
            _, gens, texts, busy = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]  # the median timing
            answers[name] = _answer_record(unit.question, unit.task, name, lossless[_base(name)], unit.temperature,
                                           session.spec.name, seed, gens, texts)  # fmt: skip
            answers[name].busy_cpus = max((r[3] for r in runs if r[3] is not None), default=None)
            if busy is not None and busy > metrics.BUSY_SHARE * (os.cpu_count() or 1) and not warned:
                warned = True
                print(f"\nspecbench: warning: other processes kept {busy:.1f} CPUs busy while question "
                      f"{unit.question.id} was timed; the report flags the cells this touches", file=sys.stderr)
        reference = answers.get("vanilla") or unit.vanilla
        for name, answer in answers.items():  # written once the whole question is done: a kill loses nothing half
            if unit.temperature == 0 and name != "vanilla" and reference is not None:
                ref_prompts = _reference_prompts(session, unit.question, reference.turns)
                answer.greedy_check = greedy_check(session.model, answer.output_ids, reference.output_ids, ref_prompts)
            path = answer_path(run_dir, unit.task, name, unit.temperature)
            append(path, answer, f"{session.spec.name}-{name}-temperature-{unit.temperature:g}")
            bar.update(1)
    bar.close()
    return run_dir


AA = "vanilla-aa"  # vanilla timed a second time in the same interleaving: its "speedup" is the run's noise floor


def _base(name: str) -> str:
    """The method whose proposer and rule an answer column uses (the A/A column is vanilla's)."""
    return "vanilla" if name == AA else name


@dataclass
class Unit:
    """One question at one temperature: the methods still to answer it, in the order they run."""

    task: str
    question: tasks.Question
    budget: int
    temperature: float
    methods: list[str]
    vanilla: Answer | None  # vanilla's answer from an earlier, resumed part of the run


def _units(run_dir: Path, task_list: list, cfg: RunConfig, names: list[str], session: Session) -> list[Unit]:
    """Work in question order; each question's methods rotate by one place per question, so no method always
    runs first (or right after another) and slow drift of the machine spreads over all of them."""
    columns = [*names, AA] if cfg.noise_floor else names
    units = []
    for task in task_list:
        questions = tasks.limit_per_category(task.questions, cfg.limit)
        first, step = (cfg.shard[0] - 1, cfg.shard[1]) if cfg.shard else (0, 1)
        mine = set(range(first, len(questions), step))  # this shard's questions
        for i in sorted(mine):
            session.check_fits(questions[i], [{"role": "user", "content": questions[i].turns[0]}])
        budget = cfg.max_new_tokens or task.max_new_tokens or 256
        for temperature in cfg.temperatures:
            done = {}
            for name in columns:
                path = answer_path(run_dir, task.name, name, temperature)
                done[name] = {a.question_id: a for a in read_file(path)} if path.exists() else {}
            for i, question in enumerate(questions):
                if i not in mine:
                    continue
                order = columns[i % len(columns) :] + columns[: i % len(columns)]  # as in the unsharded run
                todo = [n for n in order if question.id not in done[n]]
                if todo:
                    vanilla = done["vanilla"].get(question.id)
                    units.append(Unit(task.name, question, budget, temperature, todo, vanilla))
    return units


def _reference_prompts(session: Session, question: tasks.Question, answers: list[str]) -> list[list[int]]:
    """Vanilla's prompt ids for each turn, rebuilt from its answer texts."""
    messages: list[dict[str, str]] = []
    prompts = []
    for turn, text in zip(question.turns, answers, strict=False):
        messages.append({"role": "user", "content": turn})
        prompts.append(prompt_ids(session.tokenizer, messages))
        messages.append({"role": "assistant", "content": text})
    return prompts
