"""`specbench run --workers N`: the run's units answered by N Ray actors of one device each (a `Worker` each, which
loads the target and every method once). Units go out one at a time, so a fast worker takes more; a unit whose
worker raises or dies is handed to another, at most `RETRIES` more times, and nothing of it reaches the run folder
until it comes back whole. A dead worker is replaced, and the replacement takes units once it has started; one the
cluster has no room for fails the run after `placement_timeout`. The runner stays the only writer."""

from __future__ import annotations

import logging
import os
import platform
import time
from collections import deque
from collections.abc import Iterator

from ..config import RunConfig, Unit
from ..errors import SpecbenchError
from ..progress import Progress
from ..results import Answer
from . import plan as planning
from .worker import Worker

RETRIES = 2  # further attempts at a unit after its first failure, and at starting a worker's replacement
PLACEMENT_TIMEOUT = 300.0  # seconds a replacement may wait for room, beyond the time the first workers took to start


def placement_timeout() -> float:
    """$SPECBENCH_PLACEMENT_TIMEOUT, else `PLACEMENT_TIMEOUT`."""
    value = os.environ.get("SPECBENCH_PLACEMENT_TIMEOUT", "")
    try:
        return float(value) if value else PLACEMENT_TIMEOUT
    except ValueError:
        raise SpecbenchError(f"SPECBENCH_PLACEMENT_TIMEOUT={value}: give seconds, e.g. 300") from None


class NodeWorker(Worker):
    """A Worker in a Ray actor, numbered as the driver numbers its workers. Its answers name it and the node it runs
    on, so the run records which node answered what; a retried question names the node that finished it."""

    def __init__(self, number: int, cfg: RunConfig, plan: planning.Plan, workdir: str) -> None:
        super().__init__(cfg, plan, None, workdir)
        import ray  # imported already: this process is a Ray worker

        self.node = {
            "worker": number,
            "id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": platform.node(),
        }

    def info(self) -> dict:
        return {**super().info(), "node": self.node}

    def answered(self, unit: Unit) -> list[Answer]:
        """The unit's answers, every method's, in one list (what a Ray call returns whole)."""
        answers = [a for part in self.answer(unit) for a in part]
        for a in answers:
            a.node = self.node
        return answers


def _ray():
    try:
        import ray
    except ImportError:
        raise SpecbenchError('--workers needs Ray, which is not installed: pip install "specbench[ray]"') from None
    return ray


class RayPool:
    """N actors on a local Ray instance (started here, shut down at the end) or on the cluster at --ray-address."""

    def __init__(self, cfg: RunConfig, plan: planning.Plan) -> None:
        ray = self.ray = _ray()
        if cfg.device not in ("auto", "cpu", "cuda"):
            raise SpecbenchError(f"--device {cfg.device} with --workers: use auto, cpu or cuda (a GPU per worker)")
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address=cfg.ray_address, include_dashboard=False, logging_level=logging.ERROR)
            except ConnectionError as err:
                raise SpecbenchError(f"cannot join the Ray cluster at {cfg.ray_address}: {err}") from None
        resources = ray.cluster_resources()
        n = cfg.workers or 1
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        gpu = cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0)
        if gpu and n > gpus:
            self.close()
            raise SpecbenchError(f"--workers {n} needs {n} GPUs, the Ray cluster has {gpus}: pass --workers {gpus}")
        threads = cfg.threads or (1 if gpu else max(1, cpus // n))
        if not gpu and n * threads > cpus:
            self.close()
            raise SpecbenchError(
                f"--workers {n} x --threads {threads} needs {n * threads} CPUs, the Ray cluster has {cpus}: "
                "lower --workers or --threads"
            )
        self.cfg = RunConfig(**{**vars(cfg), "device": "cuda" if gpu else "cpu", "threads": None if gpu else threads})
        self.plan = plan
        self.threads = 1 if gpu else threads  # CPUs a worker keeps busy
        quiet = {"env_vars": {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}}  # no loading bars from N workers in the log
        self.actor = ray.remote(NodeWorker).options(
            num_cpus=self.threads, num_gpus=1 if gpu else 0, max_restarts=0, runtime_env=quiet
        )
        self.timeout = placement_timeout()
        start = time.monotonic()
        self.actors = [self._spawn(i) for i in range(n)]
        self._infos = self._gather([a.info.remote() for a in self.actors], "a worker failed to start")
        self.startup = time.monotonic() - start  # what a replacement's start takes, once it has room
        self._tell_neighbours()

    def _why(self, error: Exception) -> str:
        """One line of what went wrong in a worker: our own error's text, else the exception's last line."""
        if isinstance(error, self.ray.exceptions.RayActorError):
            return "its worker process died"
        cause = getattr(error, "cause", None)
        if isinstance(cause, SpecbenchError):
            return str(cause)
        lines = [line.strip() for line in str(cause or error).splitlines() if line.strip()]
        return lines[-1] if lines else type(error).__name__

    def _spawn(self, i: int):
        return self.actor.remote(i + 1, self.cfg, self.plan, os.getcwd())

    def _gather(self, refs: list, what: str) -> list:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayError as err:
            raise SpecbenchError(f"{what}: {self._why(err)}") from None

    def _tell_neighbours(self) -> None:
        """Workers on one machine load each other's CPUs: each subtracts the others' share from what it
        reports as a foreign load."""
        for i, actor in enumerate(self.actors):
            actor.set_neighbours.remote(self._neighbours(i))

    def infos(self) -> list[dict]:
        return self._infos

    def profile(self) -> dict[int, float]:
        (profile,) = self._gather([self.actors[0].profile.remote()], "the forward profile failed")
        return profile

    def check(self, units: list[Unit]) -> None:
        self._gather([self.actors[0].check.remote(units)], "a question does not fit")

    def _replace(self, i: int, starts: int, pending: dict) -> None:
        """A fresh worker in dead worker i's place, waited for in `pending` (its start's ref -> (i, starts so far,
        the time by which it must have started))."""
        self.actors[i] = self._spawn(i)
        pending[self.actors[i].info.remote()] = (i, starts + 1, time.monotonic() + self.startup + self.timeout)

    def _unplaced(self, i: int) -> SpecbenchError:
        """The run's end when worker i's replacement found no room: the node it lost, and what to do."""
        node = self._infos[i]["node"]
        room = "a GPU" if self.cfg.device == "cuda" else f"{self.threads} CPU{'s' * (self.threads > 1)}"
        return SpecbenchError(
            f"worker {i + 1} died with node {node['ip']} ({node['id'][:8]}), and the Ray cluster had no room ({room}) "
            f"for its replacement within {self.startup + self.timeout:.0f} s: restart that node (`ray start "
            f"--address` there) or add one, or rerun the same command with --workers {len(self.actors) - 1} (it "
            "resumes from the answers written)"
        )

    def answers(self, units: list[Unit], bar: Progress) -> Iterator[tuple[int, list[Answer], list[dict]]]:
        """(worker index, a unit's answers, no sweep rows) as units finish, in whatever order they finish."""
        ray = self.ray
        bar.set_description(f"answering on {len(self.actors)} workers")
        queue = deque((unit, 0) for unit in units)  # (unit, failures so far)
        idle = list(range(len(self.actors)))
        running: dict = {}  # object ref -> (worker index, unit, failures)
        pending: dict = {}  # a replacement's start ref -> (worker index, starts, deadline): `_replace`
        while queue or running:
            while queue and idle:
                i, (unit, failures) = idle.pop(0), queue.popleft()
                running[self.actors[i].answered.remote(unit)] = (i, unit, failures)
            deadline = min((d for _, _, d in pending.values()), default=None)
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait([*running, *pending], num_returns=1, timeout=wait)
            if not ready:  # the earliest replacement's time is up
                raise self._unplaced(min(pending.values(), key=lambda p: p[2])[0])
            (ref,) = ready
            if ref in pending:
                i, starts, _ = pending.pop(ref)
                try:
                    self._infos[i] = ray.get(ref)
                except ray.exceptions.RayError as err:
                    if starts > RETRIES:
                        raise SpecbenchError(
                            f"worker {i + 1}'s replacement failed to start: {self._why(err)}"
                        ) from None
                    self._replace(i, starts, pending)
                    continue
                self.actors[i].set_neighbours.remote(self._neighbours(i))
                idle.append(i)
                continue
            i, unit, failures = running.pop(ref)
            try:
                answers = ray.get(ref)
            except ray.exceptions.RayError as err:
                dead = isinstance(err, ray.exceptions.RayActorError)
                if dead:  # the worker died: a fresh one takes its place once it has started
                    self._replace(i, 0, pending)
                if failures >= RETRIES:
                    raise SpecbenchError(
                        f"{unit.label()} ({unit.task}, T={unit.temperature:g}) failed {failures + 1} "
                        f"times; the last time: {self._why(err)}"
                    ) from None
                why = self._why(err)
                bar.write(f"specbench: worker {i + 1} failed on {unit.label()} ({why}); retrying")
                queue.appendleft((unit, failures + 1))
                if dead:
                    continue
            else:
                yield i, answers, []
            idle.append(i)

    def _neighbours(self, i: int) -> float:
        """CPUs the other workers on worker i's machine keep busy."""
        host = self._infos[i]["machine"]["host"]
        return (sum(info["machine"]["host"] == host for info in self._infos) - 1) * self.threads

    def close(self) -> None:
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
