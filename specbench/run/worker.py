"""One device's share of a run: the target and every method's proposer loaded once, and a unit (one question at
one temperature) answered by each of its methods back to back, timed, and checked against vanilla. The runner
drives one Worker in its own process; `scaleout` drives one per Ray actor."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import methods
from ..config import BatchUnit, Plan, RunConfig, Unit, base_method, question_seed
from ..core.decode import Generation
from ..core.proposer import Drafter
from ..core.schedule import step_cost
from ..interference import OtherLoad, set_aside, take_back, without_gc
from ..machine import machine, warm_gpu
from ..results import Answer, TurnSteps, answer, check_greedy
from .plan import fetch
from .profiling import forward_profile
from .session import Session

RETIMES = 3  # --compile: a timed decode during which torch.compile built a new graph runs again, at most this often


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters  # only under --compile: importing dynamo costs a second

    return counters["stats"]["unique_graphs"]


def batch_shares(gen: Generation, profile: dict[int, float]) -> list[float]:
    """A turn's shares of its batch's steps: Σ 1/slots (steps), Σ forward seconds/slots and Σ T(bucket of the
    widest slot's rows)/slots (the profiled forward), over its steps; summed over the turns of a batch they give
    its steps, measured forward seconds and profiled forward seconds."""
    return [
        sum(1 / s.slots for s in gen.steps),
        sum(s.verify_time / s.slots for s in gen.steps),
        sum(step_cost(profile, s.width) / s.slots for s in gen.steps),
    ]


class Worker:
    """The loaded target and proposers of one device, answering units as they come."""

    def __init__(
        self, cfg: RunConfig, plan: Plan, paths: dict[str, Path] | None = None, workdir: str | None = None
    ) -> None:
        if workdir and Path(workdir).is_dir():  # a Ray worker starts elsewhere: relative paths are the driver's
            os.chdir(workdir)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.session = Session(cfg, plan, paths or fetch(plan, cfg))
        self.proposers = {name: methods.build_batch(name, self.session.resources, 1) for name in plan.methods}
        self.lossless = {name: methods.preset(name).lossless for name in plan.methods}
        self.warmed: set[str] = set()
        self.drafters: dict[tuple[str, int], Drafter] = {}  # (method, batch size) -> its drafting for the batch
        self.warmed_batches: set[tuple[str, int]] = set()  # (method, batch size) warmed up
        self.neighbours = 0.0  # CPUs other workers on this machine may keep busy: not a foreign load
        set_aside()  # what it loaded lives as long as it does

    def close(self) -> None:
        take_back()

    def info(self) -> dict:
        """What the manifest records of this worker: its machine, device type and dtype, and under `--graphs` what
        the target ran on ("owned": models.decoder; else why it ran on transformers). A GPU's clock is brought
        up first (it idles low after loading), so the clocks recorded, and the forward profile that follows, are
        those a timing runs at."""
        device, dtype = self.session.device, self.session.dtype
        warm_gpu(device)
        return {
            "machine": machine(device),
            "device": device.type,
            "dtype": str(dtype).removeprefix("torch."),
            "decoder": self.session.decoder,
        }

    def set_neighbours(self, cpus: float) -> None:
        self.neighbours = cpus

    def profile(self) -> dict[int, float]:
        return forward_profile(self.session.target)

    def check(self, units: list[Unit]) -> None:
        """Every question's first prompt fits the target's context (a one-line error names the first that does not)."""
        for unit in units:
            self.session.prompt(unit.question, [])

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
                print(
                    f"\nspecbench: warning: {name} still compiled new graphs on question {unit.question.id} after "
                    f"{RETIMES} re-timings; its time includes compiling",
                    file=sys.stderr,
                )
        return gens, texts, None if load.value is None else max(0.0, load.value - self.neighbours)

    def _record(self, name: str, unit: Unit | BatchUnit, question, seed: int, gens: list, texts: list[str]) -> Answer:
        turns = [
            TurnSteps(
                g.tokens,
                g.wall_time,
                [s.accept_length for s in g.steps],
                [s.tested for s in g.steps],
                [s.tree_size for s in g.steps],
                g.target_top1,
                g.target_margin,
                drafted=[s.drafted for s in g.steps],
            )
            for g in gens
        ]
        return answer(
            question,
            unit.task,
            name,
            unit.temperature,
            self.session.spec.name,
            seed,
            self.lossless[base_method(name)],
            texts,
            turns,
            draft_time=sum(g.prefill_draft_time + sum(s.draft_time for s in g.steps) for g in gens),
            verify_time=sum(sum(s.verify_time for s in g.steps) for g in gens),
            synthetic=self.session.synthetic,
        )

    def answer(self, unit: Unit) -> list[Answer]:
        """The unit's answers, one per method in its order, each the median-time of `repeats` back-to-back rounds;
        at T=0 each carries its greedy check against vanilla."""
        if self.cfg.warmup:  # one discarded question per method before its first timed one
            cold = [name for name in unit.methods if name in self.proposers and name not in self.warmed]
            for name in cold:  # (the A/A column shares vanilla's warm-up)
                if self.cfg.compile:  # minutes of compiling, silent otherwise
                    print(f"specbench: warming up {name} (torch.compile compiles it now)", file=sys.stderr, flush=True)
                self._decode(name, unit, 0)
                self.warmed.add(name)
            if cold:  # after loading or compiling, the GPU's clock settles before a timed question
                warm_gpu(self.session.device)
        seed = question_seed(self.cfg.seed, unit.question.id, unit.temperature)
        timed: dict[str, list] = {name: [] for name in unit.methods}
        for _ in range(self.cfg.repeats):  # rounds: every method back to back on this question, in the rotated order
            for name in unit.methods:
                gens, texts, busy = self._timed(name, unit, seed)
                timed[name].append((sum(g.wall_time for g in gens), gens, texts, busy))
        answers = {}
        for name, runs in timed.items():
            if len({tuple(map(tuple, (g.tokens for g in r[1]))) for r in runs}) > 1:
                print(
                    f"\nspecbench: warning: {name} gave different tokens across the {self.cfg.repeats} repeats of "
                    f"question {unit.question.id} (nondeterministic kernels?); the median-time repeat is kept",
                    file=sys.stderr,
                )
            _, gens, texts, _ = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]  # the median timing
            answers[name] = a = self._record(name, unit, unit.question, seed, gens, texts)
            a.busy_cpus = max((r[3] for r in runs if r[3] is not None), default=None)
            a.position, a.order = unit.position, unit.methods.index(name)
        check_greedy(
            answers,
            answers.get("vanilla") or unit.vanilla,
            unit.question,
            self.session.tokenizer,
            lambda: self.session.model,
        )
        return list(answers.values())

    def _drafter(self, name: str, batch: int) -> Drafter:
        """The method `name`'s drafting for a batch of `batch` slots (the A/A column's is vanilla's): built once per
        batch size, those of other batch sizes let go."""
        method = base_method(name)
        for key in [k for k in self.drafters if k[1] != batch]:
            del self.drafters[key]
        if (method, batch) not in self.drafters:
            self.drafters[method, batch] = methods.build_batch(method, self.session.resources, batch)
        return self.drafters[method, batch]

    def answer_batch(self, unit: BatchUnit) -> Iterator[list[Answer]]:
        """The unit's methods one after another (vanilla first), each answering every question `unit.batch` at a
        time after a discarded warm-up of one batch of first turns: each method's answers, in question order, with
        their greedy checks against vanilla's at the same batch size."""
        session, questions = self.session, unit.questions
        seeds = [question_seed(self.cfg.seed, q.id, unit.temperature) for q in questions]
        target = session.batched(unit.batch, session.slot_context(questions, unit.budget))
        profile = session.step_costs(unit.batch)
        reference = dict(unit.vanilla)
        for order, name in enumerate(unit.methods):
            drafting = self._drafter(name, unit.batch)
            method = base_method(name)
            if self.cfg.warmup and (method, unit.batch) not in self.warmed_batches:
                first = [dataclasses.replace(q, turns=q.turns[:1]) for q in questions[: unit.batch]]
                session.answer_batch(
                    method, target, drafting, first, unit.budget, unit.temperature, seeds[: len(first)]
                )
                self.warmed_batches.add((method, unit.batch))
                warm_gpu(session.device)
            with without_gc(), OtherLoad() as load:
                answered, _ = session.answer_batch(
                    method, target, drafting, questions, unit.budget, unit.temperature, seeds
                )
            busy = None if load.value is None else max(0.0, load.value - self.neighbours)
            answers = []
            for position, (question, seed, (gens, _, texts)) in enumerate(zip(questions, seeds, answered, strict=True)):
                a = self._record(name, unit, question, seed, gens, texts)
                a.batch_size, a.batch_times = unit.batch, [[g.started, g.ended] for g in gens]
                a.batch_shares = [batch_shares(g, profile) for g in gens]
                a.busy_cpus, a.position, a.order = busy, position, order
                if name == "vanilla":
                    reference[question.id] = a
                else:
                    check_greedy(
                        {name: a}, reference.get(question.id), question, session.tokenizer, lambda: session.model
                    )
                answers.append(a)
            yield answers
