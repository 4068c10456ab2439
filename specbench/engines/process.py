"""One vLLM engine in a spawned process of its own (its exit frees the memory), stepped request by request, so
each request's latency, time to first token and vLLM's per-step counts are measured. The pool asks it for one
question's answer or one sweep level at a time, through two queues."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import question_seed
from ..errors import SpecbenchError
from ..models import loading
from ..models.chat import messages, prompt_ids
from ..tasks import Question
from . import concurrency


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
    steps: int | None = None  # target forwards, when only the totals are known (llama.cpp's concurrent requests)


@dataclass
class Conversation:
    """A question's turns sent one after another, each prompt built from the answers before it."""

    question: Question
    params: Callable[[int], object] | None  # turn number -> vLLM SamplingParams
    turns: list[Turn] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


@dataclass
class EngineConfig:
    """What one engine process is built from."""

    target: str
    spec: dict | None  # the method's speculative_config (None: plain decoding)
    dtype: str
    seed: int
    trust_remote_code: bool
    compile: bool  # vLLM's own compilation and graphs (otherwise eager)
    warmup: bool
    stop_ids: list[int]
    memory_share: float | None = None  # of the GPU, when several engines share it (vLLM's gpu_memory_utilization)
    log: str | None = None  # where the process's own output goes (vLLM's INFO lines, warnings); None: the terminal


WARM_UP = Question("warm-up", "warm-up", "warm-up", ["Write a short note to a friend about the weather."])
CPU_KV_CACHE_GB = "1"  # each engine's KV cache on a CPU unless VLLM_CPU_KVCACHE_SPACE says otherwise


def sampling(config: EngineConfig, temperature: float, budget: int, seed: int) -> Callable[[int], object]:
    """Each turn's SamplingParams: the budget, the stop ids, the seed (+ turn) when sampling; tokens as they come."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(turn: int):
        return SamplingParams(
            temperature=temperature,
            max_tokens=budget,
            stop_token_ids=config.stop_ids,
            seed=seed + turn if temperature > 0 else None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    return params


class Engine:
    """A vLLM engine over the target (plus one method's speculative_config), stepped request by request."""

    def __init__(self, config: EngineConfig) -> None:
        from vllm import LLM

        options: dict[str, Any] = {"speculative_config": config.spec, "per_request_spec_decode_metrics": "detailed"}
        options = options if config.spec else {}
        if config.memory_share:
            options["gpu_memory_utilization"] = config.memory_share
        self.llm = LLM(
            model=config.target,
            tokenizer=config.target,
            dtype=config.dtype,
            seed=config.seed,
            trust_remote_code=config.trust_remote_code,
            enforce_eager=not config.compile,
            **options,
        )
        self.engine = self.llm.llm_engine
        self.tokenizer = loading.load_tokenizer(config.target, config.trust_remote_code)
        self.ids = itertools.count()

    def serve(self, conversations: list[Conversation], in_flight: int) -> float:
        """Answer every conversation with at most `in_flight` of them running at once; returns the wall time."""
        from vllm.inputs import TokensPrompt

        waiting, live = deque(conversations), {}
        start = time.perf_counter()

        def submit(conv: Conversation) -> None:
            turns = conv.question.turns[: len(conv.texts) + 1]
            ids = prompt_ids(self.tokenizer, messages(turns, conv.texts), conv.question.thinking)
            request = f"r{next(self.ids)}"
            assert conv.params is not None  # a conversation served has its sampling
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


def _loop(config: EngineConfig, inbox, outbox) -> None:
    """The engine process: build and warm the engine, say ("ready",), then answer ("answer", question,
    temperature, budget, seed) with ("answer", turns, texts) and ("sweep", sweep) with ("rows", rows) until
    ("stop",). A failure is ("error", one line)."""
    if config.log:  # vLLM's hundreds of lines to the run folder, out of the way of the user's progress bar
        out = os.open(config.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GB)
    try:
        engine = Engine(config)
        if config.warmup:  # a discarded question no run asks: an engine's first requests are slow
            engine.serve([Conversation(WARM_UP, sampling(config, 0.0, 64, 0))], 1)
        outbox.put(("ready",))
        while (message := inbox.get())[0] != "stop":
            if message[0] == "answer":
                _, question, temperature, budget, seed = message
                conv = Conversation(question, sampling(config, temperature, budget, seed))
                engine.serve([conv], 1)
                outbox.put(("answer", conv.turns, conv.texts))
            else:
                sweep = message[1]
                convs = [
                    Conversation(
                        q,
                        sampling(
                            config, sweep.temperature, sweep.budget, question_seed(config.seed, q.id, sweep.temperature)
                        ),
                    )
                    for q in sweep.questions
                ]
                wall = engine.serve(convs, sweep.level)
                outbox.put(("rows", concurrency.rows(sweep, convs, wall)))
    except Exception as err:  # the pool turns it into one line naming the method
        outbox.put(("error", f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1]}"))


class EngineProcess:
    """A method's engine in its own process: started at once, `ready()` waits for it, `ask` sends one request."""

    def __init__(self, name: str, config: EngineConfig) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.name, self.log = name, config.log
        self.inbox, self.outbox = context.Queue(), context.Queue()
        self.process = context.Process(target=_loop, args=(config, self.inbox, self.outbox), daemon=True)
        self.process.start()

    def _reply(self) -> tuple:
        import queue

        while True:
            try:
                message = self.outbox.get(timeout=5)
            except queue.Empty:
                if not self.process.is_alive():
                    raise SpecbenchError(
                        f"{self.name}: vLLM's process ended (exit code {self.process.exitcode}); {self._why()}"
                    ) from None
                continue
            if message[0] == "error":
                raise SpecbenchError(f"{self.name} in vLLM: {message[1]}; {self._why()}")
            return message

    def _why(self, lines: int = 8) -> str:
        """Where the engine's own output says what went wrong; its last lines go to stderr first."""
        if not self.log:
            return "its output above says why"
        path = Path(self.log)
        tail = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:] if path.is_file() else []
        if tail:
            print(f"\n{self.name}: the last lines of vLLM's output:\n  " + "\n  ".join(tail), file=sys.stderr)
        return f"its whole output is in {path}"

    def ready(self) -> None:
        self._reply()

    def ask(self, *request) -> tuple:
        self.inbox.put(request)
        return self._reply()[1:]

    def close(self) -> None:
        if self.process.is_alive():
            self.inbox.put(("stop",))
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
