"""Runs the matrix tasks x temperatures x methods for one model: the plan, the run folder and its manifest, the
units of work still to do, and the only writer of answers (one line per answer, flushed, so a killed run resumes).
The units are answered by a Worker in this process, or by Ray workers (`--workers`, see `scaleout`)."""

from __future__ import annotations

import json
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from .. import methods, tasks
from ..config import AA, RunConfig, Unit
from ..core import synthetic
from ..core.static_lm import BUCKETS
from ..engines import concurrency
from ..errors import SpecbenchError
from ..interference import too_busy, warn_if_busy
from ..models.chat import has_thinking_switch
from ..progress import Progress
from ..results import Answer, append, read_file
from . import inputs, lock
from . import plan as planning
from .session import prepare
from .worker import Worker

if TYPE_CHECKING:
    from ..engines.llamacpp import LlamaCppPool
    from ..engines.vllm import VllmPool
    from .scaleout import RayPool

ENGINE_LOGS = "engine-logs"  # engine mode: each method's engine output (vLLM's, llama-server's), a file per method


def default_out(cfg: RunConfig) -> Path:
    """The same command resumes into the same folder."""
    key = json.dumps(
        [cfg.model, sorted(cfg.tasks), cfg.limit, cfg.max_new_tokens, cfg.dtype, cfg.seed]
        + ([cfg.engine] if cfg.engine != "specbench" else [])
        + ([cfg.acceptance] if cfg.acceptance else [])
    )
    shard = f"-shard{cfg.shard[0]}of{cfg.shard[1]}" if cfg.shard else ""
    return (
        Path("results")
        / f"{Path(cfg.model).name}-{'+'.join(Path(t).stem for t in cfg.tasks)}-{zlib.crc32(key.encode()):08x}{shard}"
    )


def _check_manifest(path: Path, manifest: dict) -> None:
    """A resumed run must have the settings it started with; otherwise its numbers would mix."""
    if not path.exists():
        path.write_text(json.dumps(manifest, indent=2))
        return
    old = json.loads(path.read_text())
    keys = {
        "model": None,
        "dtype": None,
        "device": None,
        "max_new_tokens": None,
        "seed": None,
        "limit": None,
        "repeats": 1,
        "shard": None,
        "engine": "specbench",
        "acceptance": None,
    }  # key -> its value in manifests written before it
    differ = [k for k, default in keys.items() if old["config"].get(k, default) != manifest["config"].get(k)]
    if old["machine"]["device_name"] != manifest["machine"]["device_name"]:
        differ.append("machine")
    thinking = manifest.get("thinking", {})
    before = old.get("thinking", dict.fromkeys(thinking, True))  # runs before the switch rendered the template's own
    if any(before.get(task, on) != on for task, on in thinking.items()):
        differ.append("thinking")
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
    if "tuned" in old or "tuned" in manifest:
        merged["tuned"] = {**old.get("tuned", {}), **manifest.get("tuned", {})}
    if thinking:
        merged["thinking"] = {**before, **thinking}
    if "workers" in old or "workers" in manifest:  # every machine that answered a part of the run
        merged["workers"] = old.get("workers", [old["machine"]]) + manifest.get("workers", [manifest["machine"]])
    path.write_text(json.dumps(merged, indent=2))


def answer_path(run_dir: Path, task: str, method: str, temperature: float, batch: int = 1) -> Path:
    suffix = f"-batch-{batch}" if batch > 1 else ""
    return run_dir / "answers" / task / f"{method}-temperature-{temperature:g}{suffix}.jsonl"


class LocalPool:
    """One Worker in this process: the default path, free of Ray."""

    def __init__(self, cfg: RunConfig, plan: planning.Plan, paths: dict[str, Path]) -> None:
        self.worker = Worker(cfg, plan, paths)

    def infos(self) -> list[dict]:
        return [self.worker.info()]

    def profile(self) -> dict[int, float]:
        return self.worker.profile()

    def check(self, units: list[Unit]) -> None:
        self.worker.check(units)

    def answers(self, units: list[Unit], bar: Progress) -> Iterator[tuple[int, list[Answer], list[dict]]]:
        for unit in units:
            what = f"{unit.task} T={unit.temperature:g} {unit.label()}"
            bar.set_description(what)
            for answers in self.worker.answer(unit, partial(_doing, bar, what)):
                yield 0, answers, []  # a method's at a time

    def close(self) -> None:
        self.worker.close()


def _doing(bar: Progress, unit: str, what: str) -> None:
    """The bar names the unit and what decodes now (a method, its round)."""
    bar.set_description(f"{unit}: {what}")


def run(cfg: RunConfig) -> Path:
    """Run the matrix; returns the run folder. Re-running the same command resumes where it stopped."""
    inputs.check(cfg)  # `specbench run` has checked already, before its heavy imports; other callers have not
    plan = prepare(cfg)
    task_list = [tasks.load(t, cfg.data_dir, cfg.fields) for t in cfg.tasks]
    paths = planning.fetch(plan, cfg)
    questions = [q for task in task_list for _, q in _questions(task, cfg)]
    inputs.fit_prompts(cfg, plan.spec.name, paths["target"], questions)  # with the tokenizer, before the weights load
    run_dir = Path(cfg.out) if cfg.out else default_out(cfg)
    pool: LocalPool | RayPool | VllmPool | LlamaCppPool
    if cfg.workers:
        from .scaleout import RayPool

        pool = RayPool(cfg, plan)
    elif cfg.engine == "vllm":
        from ..engines.vllm import VllmPool

        pool = VllmPool(cfg, plan, paths, run_dir / ENGINE_LOGS)
    elif cfg.engine == "llamacpp":
        from ..engines.llamacpp import LlamaCppPool

        pool = LlamaCppPool(cfg, plan, paths, run_dir / ENGINE_LOGS)
    else:
        pool = LocalPool(cfg, plan, paths)
    try:
        return _drive(cfg, plan, paths, task_list, pool, run_dir)
    finally:
        pool.close()


def _drive(cfg: RunConfig, plan: planning.Plan, paths: dict[str, Path], task_list: list, pool, run_dir: Path) -> Path:
    """Write the manifest, then every unit's answers as they arrive; only this function writes the run folder."""
    names = plan.methods
    run_dir.mkdir(parents=True, exist_ok=True)
    infos = pool.infos()
    manifest = {
        "config": {**asdict(cfg), "methods": names, "device": infos[0]["device"], "dtype": infos[0]["dtype"]},
        "model": {"name": plan.spec.name, "path": plan.spec.path},
        "checkpoints": planning.revisions(plan, paths),
        "skipped": plan.skipped,
        "machine": infos[0]["machine"],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if cfg.workers:
        manifest["workers"] = [info["machine"] for info in infos]
    if "engine" in infos[0]:
        manifest["engine"] = infos[0]["engine"]
    if plan.tuned:
        manifest["tuned"] = plan.tuned
    if cfg.acceptance:  # cost-only: every verdict forced at these rates (core.synthetic)
        manifest["synthetic"] = {"cost_only": True, "rates": list(synthetic.parse(cfg.acceptance).rates)}
    if has_thinking_switch(paths["target"]):  # task -> whether its prompts asked the template to think
        manifest["thinking"] = {task.name: task.thinking for task in task_list}
    if cfg.graphs:  # which forwards ran on static caches, captured or not, and which drafting stayed eager
        manifest["graphs"] = {
            "captured": infos[0]["device"] == "cuda",
            "buckets": list(BUCKETS),
            "eager_drafting": [m for m in names if methods.eager_drafting(m)],
            "decoder": infos[0].get("decoder"),  # "owned" (models.decoder), or why the target ran on transformers
        }
    _check_manifest(run_dir / "manifest.json", manifest)
    lock.record(plan, run_dir)  # the commits unpinned checkpoints ran at, for `run --lock`
    units = _units(run_dir, task_list, cfg, names)
    pool.check(units)
    sweeps = _sweeps(run_dir, task_list, cfg, names) if cfg.concurrency else []
    profile_path = run_dir / "forward_profile.json"
    if units or sweeps or not profile_path.exists():  # a resumed run with every answer written times nothing
        for info in infos:
            warn_if_busy(info["machine"])
    if not profile_path.exists():
        profile_path.write_text(json.dumps(pool.profile()))
    if cfg.concurrency:
        pool.set_sweeps(sweeps)
    total = sum(len(u.methods) * len(u.questions) for u in units)
    bar = Progress(total, "answers", "answers", enabled=cfg.progress)
    done = [0] * len(infos)
    start, warned = time.perf_counter(), False
    for worker, answers, rows in pool.answers(units, bar):  # written as they come: a method's, or a whole unit
        if rows:
            concurrency.append(run_dir / concurrency.FILE, rows)
        done[worker] += len(answers)
        cpus = infos[worker]["machine"]["cpu_count"] or 1
        busy = max((a.busy_cpus for a in answers if a.busy_cpus is not None), default=None)
        if too_busy(busy, cpus) and not warned:
            warned = True
            print(
                f"\nspecbench: warning: other processes kept {busy:.1f} CPUs busy while question "
                f"{answers[0].question_id} was timed; the report flags the cells this touches",
                file=sys.stderr,
            )
        minutes = (time.perf_counter() - start) / 60
        rates = {"per worker": " ".join(f"{n / minutes:.1f}" for n in done) + " answers/min"} if len(done) > 1 else {}
        for answer in answers:
            path = answer_path(run_dir, answer.task, answer.method, answer.temperature, answer.batch_size)
            append(path, answer, f"{plan.spec.name}-{answer.method}-temperature-{answer.temperature:g}")
            bar.update(1, **rates)
    bar.close()
    return run_dir


def _questions(task, cfg: RunConfig) -> list[tuple[int, tasks.Question]]:
    """The task's questions this run answers, with their index (a shard takes every N-th from its I-th)."""
    questions = tasks.limit_per_category(task.questions, cfg.limit)
    first, step = (cfg.shard[0] - 1, cfg.shard[1]) if cfg.shard else (0, 1)
    return [(i, q) for i, q in enumerate(questions) if i >= first and (i - first) % step == 0]


def _budget(task, cfg: RunConfig) -> int:
    return cfg.max_new_tokens or task.max_new_tokens or tasks.MAX_NEW_TOKENS


def _sweeps(run_dir: Path, task_list: list, cfg: RunConfig, names: list[str]) -> list[concurrency.Sweep]:
    """The concurrency sweeps (engine mode) not yet on disk: every level for every method, task and temperature."""
    done = concurrency.done(run_dir / concurrency.FILE)
    return [
        concurrency.Sweep(
            task.name, temperature, name, level, _budget(task, cfg), [q for _, q in _questions(task, cfg)]
        )
        for task in task_list
        for temperature in cfg.temperatures
        for name in names
        for level in cfg.concurrency or []
        if (task.name, temperature, name, level) not in done
    ]


def _units(run_dir: Path, task_list: list, cfg: RunConfig, names: list[str]) -> list[Unit]:
    """The work not on disk yet. At batch 1, in question order: each question's methods rotate by one place per
    question, so no method always runs first (or right after another) and slow drift of the machine spreads over all
    of them. Then for each batch size above 1, task and temperature: the methods (vanilla first, then the A/A column)
    whose answers at that batch size are not on disk yet. A method's answers at a batch size are written together,
    once it has answered every question, so a file on disk is a whole one."""
    columns = [*names, AA] if cfg.noise_floor else names
    units = []
    for batch in sorted(set(cfg.batch)):
        for task in task_list:
            budget, questions = _budget(task, cfg), _questions(task, cfg)
            for temperature in cfg.temperatures:
                paths = {name: answer_path(run_dir, task.name, name, temperature, batch) for name in columns}
                if batch == 1:
                    done = {n: {a.question_id: a for a in read_file(p)} if p.exists() else {} for n, p in paths.items()}
                    for i, q in questions:
                        order = columns[i % len(columns) :] + columns[: i % len(columns)]  # as in the unsharded run
                        todo = [n for n in order if q.id not in done[n]]
                        vanilla = {q.id: done["vanilla"][q.id]} if q.id in done["vanilla"] else {}
                        if todo:
                            units.append(Unit(task.name, [q], budget, temperature, todo, 1, vanilla, i))
                    continue
                every = [q for _, q in questions]
                todo = [n for n in columns if not _whole(paths[n], every)]
                vanilla = {a.question_id: a for a in read_file(paths["vanilla"])} if paths["vanilla"].exists() else {}
                if todo:
                    units.append(Unit(task.name, every, budget, temperature, todo, batch, vanilla))
    return units


def _whole(path: Path, questions: list[tasks.Question]) -> bool:
    """Whether an answer file of a batch holds every question; one cut short by a killed run is removed (its
    method answers them all again, together)."""
    if not path.exists():
        return False
    if {a.question_id for a in read_file(path)} >= {q.id for q in questions}:
        return True
    path.unlink()
    return False
