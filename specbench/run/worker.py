"""One device's share of a run: the target and every method's drafting loaded once, and a unit (questions at one
temperature and batch size) answered by each of its methods in turn, timed, and checked against vanilla. The runner
drives one Worker in its own process; `scaleout` drives one per Ray actor."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from .. import methods
from ..config import Plan, RunConfig, Unit, base_method, question_seed
from ..core.decode import Generation
from ..core.one_slot import Target
from ..core.proposer import Drafter
from ..core.schedule import step_cost
from ..interference import OtherLoad, set_aside, take_back, without_gc
from ..machine import machine, warm_gpu
from ..results import Answer, TurnSteps, answer, check_greedy
from .plan import fetch
from .profiling import forward_profile
from .session import Conversation, Session

RETIMES = 3  # --compile: a timed decode during which torch.compile built a new graph runs again, at most this often


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters  # only under --compile: importing dynamo costs a second

    return counters["stats"]["unique_graphs"]


class Decoded(NamedTuple):
    """One timed decode of a unit's questions by one method."""

    answered: list[Conversation]  # per question
    wall: float  # seconds, the whole decode
    busy: float | None  # CPUs other processes kept busy meanwhile (None: not measured)


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
        self.drafters: dict[tuple[str, int], Drafter] = {}  # (method, batch size) -> its drafting for the batch
        for name in plan.methods:  # every method's weights load now, before anything is timed
            self._drafter(name, 1)
        self.lossless = {name: methods.preset(name).lossless for name in plan.methods}
        self.warmed: set[tuple[str, int]] = set()  # (method, batch size) warmed up
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
            for question in unit.questions:
                self.session.prompt(question, [])

    def _drafter(self, name: str, batch: int) -> Drafter:
        """The method `name`'s drafting for a batch of `batch` slots (the A/A column's is vanilla's): built once per
        batch size, those of other batch sizes let go."""
        method = base_method(name)
        for key in [k for k in self.drafters if k[1] != batch]:
            del self.drafters[key]
        if (method, batch) not in self.drafters:
            self.drafters[method, batch] = methods.build_batch(method, self.session.resources, batch)
        return self.drafters[method, batch]

    def _decode(
        self, name: str, unit: Unit, target: Target, questions: list, seeds: list[int]
    ) -> tuple[list[Conversation], float]:
        """`questions` answered `unit.batch` at a time by `name`: each question's (generations, prompts, texts), and
        the seconds of the whole decode."""
        drafting = self._drafter(name, unit.batch)
        return self.session.answer_batch(
            base_method(name), target, drafting, questions, unit.budget, unit.temperature, seeds
        )

    def _warm(self, unit: Unit, target: Target, seeds: list[int]) -> None:
        """Before a method's first timed decode at a batch size, a discarded one of the unit's first `batch`
        questions' first turns (the A/A column shares vanilla's); then the GPU's clock settles."""
        first = [dataclasses.replace(q, turns=q.turns[:1]) for q in unit.questions[: unit.batch]]
        cold = {base_method(n): n for n in unit.methods if (base_method(n), unit.batch) not in self.warmed}
        for method, name in cold.items():
            if self.cfg.compile:  # minutes of compiling, silent otherwise
                print(f"specbench: warming up {name} (torch.compile compiles it now)", file=sys.stderr, flush=True)
            self._decode(name, unit, target, first, seeds[: len(first)])
            self.warmed.add((method, unit.batch))
        if cold:
            warm_gpu(self.session.device)

    def _timed(self, name: str, unit: Unit, target: Target, seeds: list[int]) -> Decoded:
        """One timed decode of the unit's questions. Under --compile, a decode that compiled a new graph (a tree
        size or context length not seen yet) timed the compiler: it runs again."""
        for attempt in range(1 + (RETIMES if self.cfg.compile else 0)):
            graphs = compiled_graphs() if self.cfg.compile else 0
            with without_gc(), OtherLoad() as load:
                answered, wall = self._decode(name, unit, target, unit.questions, seeds)
            if not self.cfg.compile or compiled_graphs() == graphs:
                break
            if attempt == RETIMES:
                print(
                    f"\nspecbench: warning: {name} still compiled new graphs on {unit.label()} after {RETIMES} "
                    "re-timings; its time includes compiling",
                    file=sys.stderr,
                )
        return Decoded(answered, wall, None if load.value is None else max(0.0, load.value - self.neighbours))

    def _record(self, name: str, unit: Unit, question, seed: int, gens: list, texts: list[str]) -> Answer:
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

    def _kept(
        self, name: str, unit: Unit, runs: list[Decoded], seeds: list[int], profile: dict[int, float]
    ) -> list[Answer]:
        """A method's answers from its median-time decode of the unit, in question order."""
        for i, question in enumerate(unit.questions):
            if len({tuple(tuple(g.tokens) for g in run.answered[i].generations) for run in runs}) > 1:
                print(
                    f"\nspecbench: warning: {name} gave different tokens across the {len(runs)} repeats of "
                    f"question {question.id} (nondeterministic kernels?); the median-time repeat is kept",
                    file=sys.stderr,
                )
        kept = sorted(runs, key=lambda r: r.wall)[(len(runs) - 1) // 2]
        busy = max((r.busy for r in runs if r.busy is not None), default=None)
        answers = []
        for i, (question, seed, (gens, _, texts)) in enumerate(zip(unit.questions, seeds, kept.answered, strict=True)):
            a = self._record(name, unit, question, seed, gens, texts)
            if unit.batch > 1:
                a.batch_size, a.batch_times = unit.batch, [[g.started, g.ended] for g in gens]
                a.batch_shares = [batch_shares(g, profile) for g in gens]
            a.busy_cpus, a.position, a.order = busy, unit.position + i, unit.methods.index(name)
            answers.append(a)
        return answers

    def answer(self, unit: Unit, said: Callable[[str], None] | None = None) -> Iterator[list[Answer]]:
        """The unit's answers, a method's at a time (each in question order). Every method decodes the unit's
        questions in each of `repeats` rounds, back to back in the unit's order, and its median-time round is kept.
        At T=0 each answer carries its greedy check against vanilla's at the same batch size (this unit's, or on
        disk): a method that runs before vanilla waits for it. `said(what)`, if given, hears which method (and
        round) decodes next: a batch's decode can take minutes between answers."""
        session = self.session
        seeds = [question_seed(self.cfg.seed, q.id, unit.temperature) for q in unit.questions]
        target = session.target_for(unit.batch, unit.questions, unit.budget)
        profile = session.step_costs(unit.batch) if unit.batch > 1 else {}  # (read by a batch's shares only)
        if self.cfg.warmup:
            self._warm(unit, target, seeds)
        reference = dict(unit.vanilla)

        def target_lm():  # (what measures a greedy mismatch's margin)
            return session.model

        pending = "vanilla" in unit.methods  # vanilla has yet to answer: the others' checks wait for it
        waiting: list[list[Answer]] = []
        runs: dict[str, list[Decoded]] = {name: [] for name in unit.methods}
        repeats = self.cfg.repeats
        for round_ in range(repeats):
            last = round_ == repeats - 1
            for name in unit.methods:
                if said is not None:
                    said(name if repeats == 1 else f"{name}, round {round_ + 1} of {repeats}")
                runs[name].append(self._timed(name, unit, target, seeds))
                if not last:
                    continue
                waiting.append(self._kept(name, unit, runs[name], seeds, profile))
                if name == "vanilla":
                    reference.update({a.question_id: a for a in waiting[-1]})
                    pending = False
                if pending:
                    continue
                for answers in waiting:
                    for question, a in zip(unit.questions, answers, strict=True):
                        check_greedy({a.method: a}, reference.get(question.id), question, session.tokenizer, target_lm)
                    yield answers
                waiting = []
