"""A run's settings and its loaded target: the plan worked out, checkpoints fetched, the target loaded with its
tokenizer, and one question answered turn by turn with a method's proposer."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Hashable
from pathlib import Path
from typing import NamedTuple

import torch

from .. import methods, tasks
from ..config import Plan, RunConfig
from ..core import acceptance, synthetic
from ..core.cached_lm import CachedLM
from ..core.decode import Generation, Job, decode_batch
from ..core.one_slot import OneSlot, Target
from ..core.proposer import Drafter, Proposer
from ..core.static_lm import BUCKETS, BatchedLM
from ..errors import SpecbenchError
from ..models import decoder, loading
from ..models.chat import fitting_prompt
from . import lock, tuned
from . import plan as planning
from .profiling import forward_profile

CONTEXT_SLACK = 16  # tokens an answer may grow by when tokenized again in the next prompt


class Conversation(NamedTuple):
    """A question's answer: each turn's generation, prompt ids and text."""

    generations: list[Generation]
    prompts: list[list[int]]
    texts: list[str]


def prepare(cfg: RunConfig) -> Plan:
    """The run's plan (nothing loaded yet); skipped methods are announced one line each."""
    # a bad --device/--dtype fails first; with Ray workers, the devices are theirs
    device, dtype = loading.device_and_dtype("cpu" if cfg.workers else cfg.device, cfg.dtype)
    plan = planning.make(cfg)
    for name, why in plan.skipped.items():
        print(f"{name} skipped: {why}", file=sys.stderr)
    for line in lock.cached_only(plan):
        print(line, file=sys.stderr)
    if cfg.tuned:
        key = tuned.device_key(device, cfg.threads)
        entries = tuned.lookup(Path(cfg.tuned), key, plan.spec.name, str(dtype).removeprefix("torch."))
        plan.methods, used = tuned.with_tuned(plan.methods, entries)
        plan.tuned = {m: {**entries[m], "file": str(cfg.tuned), "device": key} for m in used}
        for name in [m for m in plan.methods if m not in entries and m != "vanilla" and m not in used.values()]:
            print(f"{name}: not tuned for {plan.spec.name} on this device; its default runs alone", file=sys.stderr)
    return plan


class Session:
    """A loaded target model with its tokenizer, ready to run methods over questions."""

    def __init__(self, cfg: RunConfig, plan: Plan, paths: dict[str, Path]) -> None:
        self.cfg = cfg
        self.spec = plan.spec
        self.plan = plan
        self.paths = paths
        self.device, self.dtype = loading.device_and_dtype(cfg.device, cfg.dtype)
        self.tokenizer = loading.load_tokenizer(paths["target"], cfg.trust_remote_code)
        self.model = loading.load_causal_lm(paths["target"], self.device, self.dtype, "target", cfg.trust_remote_code)
        batched = max(cfg.batch) > 1
        owned = loading.owned_decoder(self.model, "target") if cfg.graphs or batched else None
        if batched and owned is None:
            raise SpecbenchError(
                f"--batch {max(cfg.batch)} needs a target the owned decoder runs (the Llama family); "
                f"{paths['target'].name} has {decoder.unsupported(self.model)}: run it with --batch 1"
            )
        # what the manifest records of --graphs: the owned decoder, or why the target ran on transformers
        self.decoder = "owned" if owned is not None else decoder.unsupported(self.model) if cfg.graphs else None
        if cfg.compile:  # (once per run: every method verifies on this one target)
            loading.compile_forward(owned or self.model, graphs=owned is not None)
        self.owned = owned
        # a batch of one: on the owned decoder's static cache under --graphs, else on transformers' (eager)
        self.target: Target = BatchedLM(owned) if owned is not None and cfg.graphs else OneSlot(CachedLM(self.model))
        self._batched: BatchedLM | None = None
        self.costs: dict[int, dict[int, float]] = {}  # batch size -> its T(rows) (`step_costs`)
        self.stop_ids = loading.stop_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.rules: dict[str, acceptance.Rule] = {}  # method -> its acceptance rule, read from its preset once
        self.synthetic = synthetic.parse(cfg.acceptance) if cfg.acceptance else None  # forces every method's verdicts
        self.resources = methods.Resources(
            self.spec.name,
            self.model,
            self.tokenizer,
            self.device,
            self.dtype,
            draft_path=paths.get("draft"),
            head_paths={role.removesuffix(" head"): p for role, p in paths.items() if role.endswith(" head")},
            trust_remote_code=cfg.trust_remote_code,
            compile=cfg.compile,
            graphs=cfg.graphs,
            owned={id(self.model): owned},
            step_costs=self.step_costs,
        )

    @classmethod
    def open(cls, cfg: RunConfig) -> Session:
        """Plan, fetch and check every checkpoint, then load the target: mistakes surface before it loads."""
        plan = prepare(cfg)
        return cls(cfg, plan, planning.fetch(plan, cfg))

    def prompt(self, question: tasks.Question, answers: list[str]) -> list[int]:
        """The prompt ids of the question's turn after `answers`; a clear error when they fill the model's context."""
        return fitting_prompt(
            self.tokenizer, question.turns, answers, self.target.context_length, question.id, question.thinking
        )

    def answer(
        self,
        method: str,
        proposer: Drafter | Proposer,
        question: tasks.Question,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> Conversation:
        """One question answered alone (a batch of one on the run's target), every turn fed the model's own earlier
        answers: its generations, prompts and texts."""
        (answered,), _ = self.answer_batch(
            method, self.target, proposer, [question], max_new_tokens, temperature, [seed]
        )
        return answered

    def slot_context(self, questions: list[tasks.Question], budget: int) -> int:
        """The tokens a batch's slot holds at most for `questions`: the longest conversation's prompts and answers
        (an answer may grow by CONTEXT_SLACK tokens when tokenized again), and a verification's widest rows."""
        longest = max(len(self.prompt(q, [""] * (len(q.turns) - 1))) for q in questions)
        return longest + max(len(q.turns) for q in questions) * (budget + CONTEXT_SLACK) + BUCKETS[-1]

    def step_costs(self, batch: int) -> dict[int, float]:
        """T(rows) of the target's forward at `batch` slots (`forward_profile`), profiled once: on the batch's static
        target (made first by `batched`), or for one slot without one, on the run's target. A batch's steps are read
        against it (the report's batch sweep), and DSpark's adaptive schedule decides by it."""
        if batch not in self.costs:
            target: Target | None = (
                self._batched if self._batched is not None and self._batched.batch == batch else None
            )
            if target is None and batch == 1:
                target = self.target
            if target is None:
                raise SpecbenchError(f"no target of {batch} slots to profile yet (Session.batched makes it)")
            self.costs[batch] = forward_profile(target, repeats=5)
        return self.costs[batch]

    def target_for(self, batch: int, questions: list[tasks.Question], budget: int) -> Target:
        """The target a batch of `batch` answers `questions` on: the run's own for one slot (transformers' in the
        eager regime), else a static cache of `batch` slots their conversations fit in (`batched`)."""
        return self.target if batch == 1 else self.batched(batch, self.slot_context(questions, budget))

    def batched(self, batch: int, context: int) -> BatchedLM:
        """The target on a static cache of `batch` slots of `context` tokens (kept while the next batch fits in it;
        captured on a GPU with --graphs)."""
        old = self._batched
        if old is None or old.batch != batch or old.context_length < context:
            del old
            self._batched = None  # (the old cache's memory first)
            self._batched = BatchedLM(self.owned, batch, capture=None if self.cfg.graphs else False, context=context)
        assert self._batched is not None
        return self._batched

    def answer_batch(
        self,
        method: str,
        target: Target,
        drafting: Drafter | Proposer | list,
        questions: list[tasks.Question],
        max_new_tokens: int,
        temperature: float,
        seeds: list[int],
    ) -> tuple[list[Conversation], float]:
        """Every turn of every question decoded `target.batch` at a time, the method's `drafting` drafting for them: a
        question's next turn (its prompt holding the model's own answers) takes the slot its last turn freed, and
        otherwise the next question does. Returns each question's generations, prompts and texts, in order, and the
        wall seconds of the whole batch. Each question draws from a generator of its own, seeded by `seeds`, for all
        its turns."""
        if method not in self.rules:
            self.rules[method] = methods.rule(method)
        answered = [Conversation([], [], []) for _ in questions]
        queue = deque(
            Job(
                self.prompt(q, []),
                max_new_tokens,
                temperature,
                torch.Generator(self.device).manual_seed(seed),
                ((q.group, q.id), 0),
            )
            for q, seed in zip(questions, seeds, strict=True)
        )
        index: dict[Hashable, int] = {(q.group, q.id): i for i, q in enumerate(questions)}

        def finished(job: Job, gen: Generation) -> None:
            assert job.request is not None
            key, number = job.request
            i = index[key]
            gens, prompts, texts = answered[i]
            gens.append(gen)
            prompts.append(job.prompt)
            texts.append(self.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip())
            question = questions[i]
            if number + 1 < len(question.turns):  # its next turn, first in line
                prompt = self.prompt(question, texts)
                queue.appendleft(Job(prompt, max_new_tokens, temperature, job.generator, (key, number + 1)))

        wall = decode_batch(
            target,
            drafting,
            lambda: queue.popleft() if queue else None,
            finished,
            stop_ids=self.stop_ids,
            rule=self.synthetic or self.rules[method],
        )
        return answered, wall
