"""One device's share of a run: the target and every method's proposer loaded once, and a unit (one question at
one temperature) answered by each of its methods back to back, timed, and checked against vanilla. The runner
drives one Worker in its own process; `scaleout` drives one per Ray actor."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import methods, tasks
from ..core.cached_lm import CachedLM
from ..core.losslessness import greedy_check
from ..machine import OtherLoad, machine, without_gc
from ..models.chat import prompt_ids
from ..results import Answer
from . import plan as planning
from .session import RunConfig, Session, question_seed

AA = "vanilla-aa"  # vanilla timed a second time in the same interleaving: its "speedup" is the run's noise floor


RETIMES = 3  # --compile: a timed decode during which torch.compile built a new graph runs again, at most this often


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters  # only under --compile: importing dynamo costs a second

    return counters["stats"]["unique_graphs"]


def base_method(name: str) -> str:
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


@torch.inference_mode()
def forward_profile(
    target: CachedLM, context: int = 256, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 9
) -> dict[int, float]:
    """Median seconds of one target forward over k new tokens after `context` cached tokens (for roofline and
    tune's cost model). The sizes are timed in interleaved rounds, the first discarded: this CPU's speed drifts by
    up to ~10% over seconds, and timing one size after another let a slow spell fall on some sizes only (a tune
    once profiled 8 rows at 20 ms, which its runs then verified in 26)."""
    context = min(context, target.context_length - max(sizes) - 1)
    vocab = target.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    filler = torch.randint(0, vocab, (context + max(sizes),), generator=generator).tolist()
    target.reset()
    target.forward(filler[:context], last_only=True)
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(repeats + 1):
        for k in sizes:
            start = time.perf_counter()
            target.forward(filler[context : context + k])
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            times[k].append(time.perf_counter() - start)
            target.crop(context)
    return {k: float(np.median(t[1:])) for k, t in times.items()}


class Worker:
    """The loaded target and proposers of one device, answering units as they come."""

    def __init__(self, cfg: RunConfig, plan: planning.Plan, paths: dict[str, Path] | None = None,
                 workdir: str | None = None) -> None:  # fmt: skip
        if workdir and Path(workdir).is_dir():  # a Ray worker starts elsewhere: relative paths are the driver's
            os.chdir(workdir)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.session = Session(cfg, plan, paths or planning.fetch(plan, cfg.trust_remote_code))
        self.proposers = {name: methods.build(name, self.session.resources) for name in plan.methods}
        self.lossless = {name: methods.preset(name).lossless for name in plan.methods}
        self.warmed: set[str] = set()
        self.neighbours = 0.0  # CPUs other workers on this machine may keep busy: not a foreign load

    def info(self) -> dict:
        """What the manifest records of this worker: its machine, device type and dtype."""
        device, dtype = self.session.device, self.session.dtype
        return {"machine": machine(device), "device": device.type, "dtype": str(dtype).removeprefix("torch.")}

    def set_neighbours(self, cpus: float) -> None:
        self.neighbours = cpus

    def profile(self) -> dict[int, float]:
        return forward_profile(self.session.target)

    def check(self, units: list[Unit]) -> None:
        """Every question's first prompt fits the target's context (a one-line error names the first that does not)."""
        for unit in units:
            self.session.check_fits(unit.question, [{"role": "user", "content": unit.question.turns[0]}])

    def _decode(self, name: str, unit: Unit, seed: int):
        method = base_method(name)
        return self.session.answer(method, self.proposers[method], unit.question, unit.budget, unit.temperature, seed)

    def _timed(self, name: str, unit: Unit, seed: int) -> tuple[list, list[str], float | None]:
        """One timed decode (generations, texts, other processes' CPU load). Under --compile, a decode that
        compiled a new graph (a tree size or context length not seen yet) timed the compiler: it runs again."""
        for attempt in range(1 + (RETIMES if self.cfg.compile else 0)):
            graphs = compiled_graphs() if self.cfg.compile else 0
            with without_gc(), OtherLoad() as load:
                gens, _, texts = self._decode(name, unit, seed)
            if not self.cfg.compile or compiled_graphs() == graphs:
                break
            if attempt == RETIMES:
                print(f"\nspecbench: warning: {name} still compiled new graphs on question {unit.question.id} after "
                      f"{RETIMES} re-timings; its time includes compiling", file=sys.stderr)  # fmt: skip
        return gens, texts, None if load.value is None else max(0.0, load.value - self.neighbours)

    def answer(self, unit: Unit) -> list[Answer]:
        """The unit's answers, one per method in its order, each the median-time of `repeats` back-to-back rounds;
        at T=0 each carries its greedy check against vanilla."""
        if self.cfg.warmup:  # one discarded question per method before its first timed one
            for name in [n for n in unit.methods if base_method(n) not in self.warmed]:
                self._decode(name, unit, 0)
                self.warmed.add(base_method(name))
        seed = question_seed(self.cfg.seed, unit.question.id, unit.temperature)
        timed: dict[str, list] = {name: [] for name in unit.methods}
        for _ in range(self.cfg.repeats):  # rounds: every method back to back on this question, in the rotated order
            for name in unit.methods:
                gens, texts, busy = self._timed(name, unit, seed)
                timed[name].append((sum(g.wall_time for g in gens), gens, texts, busy))
        answers = {}
        for name, runs in timed.items():
            if len({tuple(map(tuple, (g.tokens for g in r[1]))) for r in runs}) > 1:
                print(f"\nspecbench: warning: {name} gave different tokens across the {self.cfg.repeats} repeats of "
                      f"question {unit.question.id} (nondeterministic kernels?); the median-time repeat is kept",
                      file=sys.stderr)  # fmt: skip
            _, gens, texts, _ = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]  # the median timing
            answers[name] = _answer_record(unit.question, unit.task, name, self.lossless[base_method(name)],
                                           unit.temperature, self.session.spec.name, seed, gens, texts)  # fmt: skip
            answers[name].busy_cpus = max((r[3] for r in runs if r[3] is not None), default=None)
        reference = answers.get("vanilla") or unit.vanilla
        if unit.temperature == 0 and reference is not None:
            ref_prompts = reference_prompts(self.session.tokenizer, unit.question, reference.turns)
            for name, answer in answers.items():
                if name != "vanilla":
                    answer.greedy_check = greedy_check(self.session.model, answer.output_ids, reference.output_ids,
                                                       ref_prompts)  # fmt: skip
        return list(answers.values())


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


def reference_prompts(tokenizer, question: tasks.Question, answers: list[str]) -> list[list[int]]:
    """Vanilla's prompt ids for each turn, rebuilt from its answer texts."""
    messages: list[dict[str, str]] = []
    prompts = []
    for turn, text in zip(question.turns, answers, strict=False):
        messages.append({"role": "user", "content": turn})
        prompts.append(prompt_ids(tokenizer, messages))
        messages.append({"role": "assistant", "content": text})
    return prompts
