"""One llama-server on the loopback: started with a method's flags, ready when its health endpoint answers, asked
for completions by token ids, and stopped with everything it started. Its output goes to a log file; with
LLAMA_TRACE set the server logs each speculative step's accepted and drafted counts there, which is how a request's
steps are read (its response carries only the totals)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecbenchError

STEP = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens(?! \(restore)")  # server-context.cpp, LLAMA_TRACE=1


@dataclass
class Completion:
    """One request's answer: its tokens, the server's own clock and its speculative counts."""

    tokens: list[int]
    seconds: float  # prompt processing + generation by the server's clock (the HTTP exchange excluded)
    prompt_seconds: float
    drafted: int  # draft tokens sent to the target, all steps
    accepted: int
    steps: list[tuple[int, int]] = field(default_factory=list)  # per speculative step: (accepted, drafted)
    latency: float = 0.0  # the client's wall time for the request, queueing included


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`llama-server -m MODEL FLAGS...` on a free loopback port, `slots` requests served at once."""

    def __init__(self, binary: Path, model: Path, flags: list[str], log: Path, name: str, slots: int = 1) -> None:
        self.name, self.log, self.port = name, log, free_port()
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["-np", str(slots), "--no-webui", "--metrics", *flags]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "LLAMA_TRACE": "1", "LLAMA_LOG_COLORS": "0"},
                start_new_session=True,  # its own process group: stopped whole, never left behind
            )

    def _died(self) -> SpecbenchError:
        text = self.log.read_text(errors="replace")
        if "bind" in text and ("address already in use" in text.lower() or "couldn't bind" in text):
            where = f"port {self.port} is in use"
            return SpecbenchError(f"llama-server for {self.name}: {where}; run again (its log: {self.log})")
        lines = [line for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
        last = (errors or lines or ["no output"])[-1].strip()
        return SpecbenchError(
            f"llama-server for {self.name} exited with code {self.process.poll()}: {last} (its log: {self.log})"
        )

    def ready(self) -> None:
        """Wait until /health says the model is loaded; a server that exits or never answers is one line."""
        timeout = float(os.environ.get("SPECBENCH_LLAMACPP_TIMEOUT", "300"))  # seconds for a server to load
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._died()
            try:
                status, _ = self._request("GET", "/health", None, timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.close()
        raise SpecbenchError(
            f"llama-server for {self.name} was not ready after {timeout:.0f} s (its log: {self.log}); "
            "SPECBENCH_LLAMACPP_TIMEOUT sets the wait"
        )

    def _request(self, method: str, path: str, body: dict | None, timeout: float | None = None) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = json.dumps(body) if body is not None else None
            connection.request(method, path, payload, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            return response.status, json.loads(data) if data else {}
        finally:
            connection.close()

    def complete(self, ids: list[int], budget: int, temperature: float, seed: int | None, steps: bool) -> Completion:
        """The completion of a prompt given as token ids (no BOS added), sampled by temperature alone (llama.cpp's
        other samplers off); `steps`: read each speculative step's counts from the log (one request at a time)."""
        body = {
            "prompt": ids,
            "n_predict": budget,
            "temperature": temperature,
            "samplers": ["temperature"],
            "return_tokens": True,
            "cache_prompt": False,  # every prompt processed in full, as our loop does
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        offset = self.log.stat().st_size if steps else 0
        start = time.perf_counter()
        try:
            status, reply = self._request("POST", "/completion", body)
        except OSError as err:
            if self.process.poll() is not None:
                raise self._died() from None
            raise SpecbenchError(f"llama-server for {self.name} did not answer ({err}); its log: {self.log}") from None
        latency = time.perf_counter() - start
        if status != 200:
            message = reply.get("error", {}).get("message", reply) if isinstance(reply, dict) else reply
            raise SpecbenchError(f"llama-server for {self.name} refused a request ({status}): {message}")
        timings = reply.get("timings", {})
        done = Completion(
            tokens=list(reply.get("tokens", [])),
            seconds=(timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000,
            prompt_seconds=timings.get("prompt_ms", 0.0) / 1000,
            drafted=int(timings.get("draft_n", 0)),
            accepted=int(timings.get("draft_n_accepted", 0)),
            latency=latency,
        )
        if steps and done.drafted:
            done.steps = self._steps(offset, done)
        return done

    def _steps(self, offset: int, done: Completion, wait: float = 5.0) -> list[tuple[int, int]]:
        """The request's per-step counts from the log past `offset`; the server writes its log from a thread of its
        own, so this waits until the counts add up to the response's totals."""
        deadline = time.monotonic() + wait
        while True:
            with self.log.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            steps = [(int(a), int(d)) for a, d in STEP.findall(text)]
            if sum(d for _, d in steps) == done.drafted and sum(a for a, _ in steps) == done.accepted:
                return steps
            if time.monotonic() > deadline:
                raise SpecbenchError(
                    f"llama-server for {self.name}: its log's steps ({len(steps)}) do not add up to the response's "
                    f"draft counts ({done.accepted}/{done.drafted}); its log: {self.log}"
                )
            time.sleep(0.02)

    def close(self) -> None:
        """Stop the server's whole process group: politely, then by force."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
