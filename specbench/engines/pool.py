"""What engine mode's pools share (`run --engine vllm|llamacpp`): the target's tokenizer and stop ids, prompts
checked against its context, each unit's methods answered back to back and checked against vanilla's answer in the
same engine, and an engine's turns written as our answers. A pool names how its engine answers one question."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .. import methods
from ..config import Plan, RunConfig, Unit, base_method, question_seed
from ..models import loading
from ..models.chat import fitting_prompt
from ..results import Answer, TurnSteps, answer, check_greedy
from ..tasks import Question
from . import concurrency
from .process import Turn
from .steps import step_lengths

Asked = tuple[list[Turn], list[str]]  # one question's turns as the engine ran them, and their texts


class EnginePool:
    """The runner's pool for an engine: answers by method, per unit, as the engine reports them."""

    engine = ""  # the engine's name, in messages

    def __init__(self, cfg: RunConfig, plan: Plan, paths: dict[str, Path], logs: Path | None = None) -> None:
        """`logs`: the folder where each engine process writes its own output (None: the terminal)."""
        from transformers import GenerationConfig

        self.cfg, self.plan, self.paths, self.logs = cfg, plan, paths, logs
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            print(f"specbench: {self.engine}'s own output goes to {logs}/", file=sys.stderr)
        self.device, self.dtype = loading.device_and_dtype(cfg.device, cfg.dtype)
        self.tokenizer = loading.load_tokenizer(paths["target"], cfg.trust_remote_code)
        try:
            generation = GenerationConfig.from_pretrained(paths["target"])
        except OSError:
            generation = None
        self.stop_ids = sorted(loading.stop_ids(self.tokenizer, generation))
        self.sweeps: list[concurrency.Sweep] = []
        self.vanilla: dict[tuple, Answer] = {}  # (task, temperature, question id) -> vanilla's answer in this run
        self.margin_model = None  # the target in transformers, loaded only to measure a greedy mismatch's margin

    def profile(self) -> dict[int, float]:
        return {}  # the engine's forward is not ours to time: no roofline in engine mode

    def check(self, units: list[Unit]) -> None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.paths["target"], trust_remote_code=self.cfg.trust_remote_code)
        context = config.get_text_config().max_position_embeddings
        for question in (q for unit in units for q in unit.questions):
            fitting_prompt(self.tokenizer, question.turns, [], context, question.id, question.thinking)

    def set_sweeps(self, sweeps: list[concurrency.Sweep]) -> None:
        self.sweeps = sweeps

    def start(self, name: str, engines: int = 1, slots: int = 1):
        """Method `name`'s engine, started but not yet ready (`ready()`, `close()`): one of `engines` sharing the
        device, serving `slots` conversations at once (a sweep level)."""
        raise NotImplementedError

    def groups(self, order: list[str]) -> list[list[str]]:
        """The methods whose engines run together, group after group (default: all of them at once)."""
        return [order] if order else []

    def swept(self, engine, sweep: concurrency.Sweep) -> list[dict]:
        """A sweep level's rows, answered by `engine` (started for it)."""
        raise NotImplementedError

    def _unit(self, unit: Unit, names: list[str], engines: dict) -> list[Answer]:
        """A unit's answers by `names` from the running `engines` (method -> engine)."""
        raise NotImplementedError

    def answers(self, units: list[Unit], bar) -> Iterator[tuple[int, list[Answer], list[dict]]]:
        """Each group's engines running at once, each question's methods back to back in the unit's rotated order,
        as our loop times them; then each sweep level in an engine of its own."""
        wanted = {base_method(m) for u in units for m in u.methods}
        for group in self.groups([m for m in self.plan.methods if m in wanted]):  # vanilla first
            bar.set_description(f"starting {self.engine} for {', '.join(group)}")
            engines = {}
            try:
                for m in group:
                    engines[m] = self.start(m, len(group))
                for engine in engines.values():
                    engine.ready()
                for unit in units:
                    names = [n for n in unit.methods if base_method(n) in engines]
                    if names:
                        bar.set_description(f"{unit.task} T={unit.temperature:g} {unit.label()}")
                        yield 0, self._unit(unit, names, engines), []
            finally:
                for engine in engines.values():
                    engine.close()
        for sweep in self.sweeps:
            bar.set_description(f"{sweep.method}: {sweep.task} T={sweep.temperature:g}, {sweep.level} in flight")
            engine = self.start(sweep.method, slots=sweep.level)
            try:
                engine.ready()
                yield 0, [], self.swept(engine, sweep)
            finally:
                engine.close()

    def log(self, name: str) -> Path | None:
        """Where the engine serving method `name` writes its output."""
        return self.logs / (re.sub(r"[^\w.=,-]", "_", name) + ".log") if self.logs is not None else None

    def unit(self, unit: Unit, names: list[str], ask: Callable[[str, Question, int], Asked]) -> list[Answer]:
        """A unit's answers by `names`, question by question and in that order, each from `ask(name, question, seed)`
        (its turns and texts); at T=0 each checked against vanilla's in this engine."""
        out: list[Answer] = []
        for question in unit.questions:
            seed = question_seed(self.cfg.seed, question.id, unit.temperature)
            answers = {name: self._answer(name, unit, question, *ask(name, question, seed), seed) for name in names}
            key = (unit.task, unit.temperature, question.id)
            if "vanilla" in answers:
                self.vanilla[key] = answers["vanilla"]
            reference = self.vanilla.get(key) or unit.vanilla.get(question.id)
            check_greedy(answers, reference, question, self.tokenizer, self._margin_model)
            out += answers.values()
        return out

    def _answer(
        self, name: str, unit: Unit, question: Question, turns: list[Turn], texts: list[str], seed: int
    ) -> Answer:
        steps = []
        for t in turns:
            assert t.end is not None  # a finished request's
            steps.append(TurnSteps(t.tokens, t.end, *step_lengths(len(t.tokens), t.accepted, t.drafted)))
        return answer(
            question,
            unit.task,
            name,
            unit.temperature,
            self.plan.spec.name,
            seed,
            methods.preset(base_method(name)).lossless,
            texts,
            steps,
        )

    def _margin_model(self):
        """The target in transformers on the CPU, in the run's dtype, to measure a greedy mismatch's margin (the
        engine's logits are not ours to read); loaded at the first mismatch, once."""
        if self.margin_model is None:
            print(
                f"\nspecbench: a greedy mismatch in {self.engine}: loading the target in transformers to measure its "
                "margin",
                file=sys.stderr,
            )
            self.margin_model = loading.load_causal_lm(
                self.paths["target"], torch.device("cpu"), self.dtype, "target", self.cfg.trust_remote_code
            )
        return self.margin_model

    def close(self) -> None:
        pass  # each method's engine has ended by the time its answers are in
