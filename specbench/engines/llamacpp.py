"""Engine mode in llama.cpp (`run --engine llamacpp`): a run's questions answered by llama-server, one server per
method on the loopback (its speculative flags are set at start), all started at once so each question is answered by
every method back to back as in our loop. Prompts are our chat template's token ids, sent as ids; each response's
tokens and the server's own clock are the answer, each speculative step's counts come from the server's log. Each
concurrency level (`--concurrency`) runs in a fresh server with that many slots."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from ..config import Plan, RunConfig, Unit, base_method, question_seed
from ..machine import machine
from ..models import gguf
from ..models.chat import messages, prompt_ids
from ..results import Answer
from ..tasks import Question
from . import concurrency, llamacpp_build, llamacpp_gguf
from .llamacpp_server import Completion, Server
from .pool import Asked, EnginePool
from .process import Conversation, Turn
from .translate import needed, server_flags

NAME = "llamacpp"


class LlamaCppPool(EnginePool):
    """The runner's pool for `--engine llamacpp`: a llama-server per method, then one per concurrency level."""

    engine = "llama.cpp"

    def __init__(self, cfg: RunConfig, plan: Plan, paths: dict[str, Path], logs: Path | None = None) -> None:
        self.binary = llamacpp_build.server()
        super().__init__(cfg, plan, paths, logs)
        target = plan.checkpoints["target"].source
        if target.gguf:  # served as published (quantized as it is), not our dequantized copy
            self.model = gguf.local_file(target.id, target.revision)
        else:
            self.model = llamacpp_gguf.convert(paths["target"])
        self.files: dict[str, Path] = {}  # need -> its checkpoint as GGUF, converted when a method first asks
        self.started: list[Server] = []  # every server this pool started: `close` stops any still running
        self.cuda = _built_with_cuda(self.binary)
        self.context = json.loads((paths["target"] / "config.json").read_text()).get("max_position_embeddings", 4096)

    def infos(self) -> list[dict]:
        held = str(gguf.describe(self.model)["file_type"]).removeprefix("MOSTLY_").removeprefix("ALL_")
        device = "cuda" if self.cuda else "cpu"
        engine = {"name": NAME, "version": _version(self.binary), "build": device, "model": self.model.name}
        engine["quantization"] = held  # the served GGUF's (F32 for our conversions; as published otherwise)
        return [{"machine": machine(self.device), "device": device, "dtype": held.lower(), "engine": engine}]

    def start(self, name: str, engines: int = 1, slots: int = 1) -> Server:
        """A server for a method (its needed checkpoint converted to GGUF first), not yet ready."""
        if (need := needed(name, NAME)) is not None and need not in self.files:
            head = need.endswith(" head")  # a head is converted against its target's folder
            self.files[need] = llamacpp_gguf.convert(self.paths[need], self.paths["target"] if head else None)
        flags = ["-c", str(self.context * slots), "--seed", str(self.cfg.seed), *server_flags(name, self.files)]
        if self.cfg.threads:  # --threads K: the server's generation and batch threads (default: its own choice)
            flags += ["-t", str(self.cfg.threads), "-tb", str(self.cfg.threads)]
        if self.cuda:
            flags += ["-ngl", "all"] + (["--spec-draft-ngl", "all"] if need else [])
        log = self.log(name) or Path(self.cfg.out or ".") / "llamacpp.log"
        self.started.append(Server(self.binary, self.model, flags, log, name, slots))
        return self.started[-1]

    def _unit(self, unit: Unit, names: list[str], servers: dict[str, Server]) -> list[Answer]:
        def ask(name: str, question: Question, seed: int) -> Asked:
            return self._converse(servers[base_method(name)], question, unit.temperature, unit.budget, seed, True)

        return self.unit(unit, names, ask)

    def _converse(self, server: Server, question: Question, temperature: float, budget: int, seed: int, steps: bool):
        """A question's turns one after another, each prompt built from the answers before it. `steps`: one request
        at a time, each step's counts read from the log and each turn timed by the server's clock; otherwise (a
        sweep) the totals alone, and the client's clock, which counts a request's wait for a slot."""
        turns: list[Turn] = []
        texts: list[str] = []
        for number in range(len(question.turns)):
            ids = prompt_ids(self.tokenizer, messages(question.turns[: number + 1], texts), question.thinking)
            sampled = seed + number if temperature > 0 else None
            done = server.complete(ids, budget, temperature, sampled, steps)
            turns.append(self._turn(ids, done, steps))
            texts.append(self.tokenizer.decode(turns[-1].tokens, skip_special_tokens=True).strip())
        return turns, texts

    def _turn(self, ids: list[int], done: Completion, server_clock: bool) -> Turn:
        """A response as a turn: its tokens up to our first stop id (llama.cpp stops at its own end-of-generation
        tokens), its times, and its steps (from their total when the log was not read)."""
        tokens = done.tokens
        stops = [i for i, t in enumerate(tokens) if t in self.stop_ids]
        tokens = tokens[: stops[0] + 1] if stops else tokens
        generating = done.seconds - done.prompt_seconds  # from the first token to the last
        end = done.seconds if server_clock else done.latency
        turn = Turn(len(ids), 0.0, tokens, first=end - generating, end=end)
        turn.accepted, turn.drafted = [a for a, _ in done.steps], [d for _, d in done.steps]
        if not server_clock:  # forwards: one per token, less the accepted drafts (each step yields accepted + 1)
            turn.steps = max(1, len(tokens) - done.accepted)
        return turn

    def swept(self, server: Server, sweep: concurrency.Sweep) -> list[dict]:
        """The sweep's questions with `sweep.level` conversations in flight (a thread each); its rows."""
        waiting = deque(sweep.questions)
        done: dict[int | str, Asked] = {}
        failures: list[BaseException] = []
        lock = threading.Lock()

        def work() -> None:
            while not failures:
                with lock:
                    if not waiting:
                        return
                    question = waiting.popleft()
                seed = question_seed(self.cfg.seed, question.id, sweep.temperature)
                try:
                    done[question.id] = self._converse(server, question, sweep.temperature, sweep.budget, seed, False)
                except BaseException as err:  # the sweep stops; the first failure is raised below
                    failures.append(err)

        start = time.perf_counter()
        threads = [threading.Thread(target=work) for _ in range(sweep.level)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        if failures:
            raise failures[0]
        convs = [Conversation(q, None, *done[q.id]) for q in sweep.questions]
        return concurrency.rows(sweep, convs, wall)

    def close(self) -> None:
        """Stop every server still running (a run interrupted or failed between a start and its own stop)."""
        for server in self.started:
            server.close()


def _version(binary: Path) -> str:
    """The pinned source's version for our build; otherwise what the server says ("version: 4567 (abc1234)")."""
    if binary.is_relative_to(llamacpp_build.home()):
        return llamacpp_build.VERSION
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version: ")]
    return lines[0].removeprefix("version: ").strip() if lines else "unknown"


def _built_with_cuda(binary: Path) -> bool:
    """Whether the server was built with CUDA (its build folder's CMake cache says; a server built elsewhere:
    whether a libggml-cuda lies beside it)."""
    cache = binary.parent.parent / "CMakeCache.txt"
    if cache.is_file():
        return "GGML_CUDA:BOOL=ON" in cache.read_text(errors="replace")
    return any(binary.parent.glob("libggml-cuda*"))
