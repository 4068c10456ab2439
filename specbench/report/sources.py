"""Run folders and answer files read as sources: one run's answers, its manifest and forward profile."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..core.synthetic import Profile
from ..engines import concurrency
from ..errors import SpecbenchError
from ..results import Answer, read_answers, read_file


@dataclass
class Source:
    """One run (a run folder, or a folder of answer files): its answers never mix with another's."""

    path: Path
    name: str
    answers: list[Answer]
    manifest: dict | None = None
    profile: dict[int, float] | None = None  # new tokens -> seconds of one target forward
    concurrency: pd.DataFrame | None = None  # engine mode's sweep rows (concurrency.jsonl), when it ran any

    @property
    def device(self) -> str | None:
        return ((self.manifest or {}).get("machine") or {}).get("device_name")

    @property
    def engine(self) -> str:
        """ "specbench" (our loop) or the engine it ran in, with its version ("vllm 0.32.0"; "llamacpp 11434.0.0 Q4_1"
        names the GGUF's quantization too)."""
        engine = (self.manifest or {}).get("engine")
        if not engine:
            return "specbench"
        quantized = f" {engine['quantization']}" if engine.get("quantization") else ""  # llama.cpp's GGUF
        return f"{engine['name']} {engine['version']}{quantized}"

    @property
    def regime(self) -> str:
        """How its timings were taken: "eager" (our loop, the default), "graphs" (`run --graphs`), either with
        "+compile" (`--compile`), or the engine."""
        if self.engine != "specbench":
            return self.engine
        config = (self.manifest or {}).get("config") or {}
        return ("graphs" if config.get("graphs") else "eager") + ("+compile" if config.get("compile") else "")

    def where(self, folder: Path) -> str:
        """Its path relative to `folder` (a report's), as the report names it: an absolute path would carry the
        machine that wrote the report into it. Its name where no relative path exists (another drive). A report
        inside the run (`run`'s own `<run>/report/`) reaches it through its parent, `../../<run>`: a bare `..`
        names no folder for a reader of the report to find."""
        try:
            path = Path(os.path.relpath(self.path, Path(folder).resolve()))
        except ValueError:
            return self.name
        if self.path.name and path.name != self.path.name:  # `..` or `.`: the run holds the report
            path = path / ".." / self.path.name
        return path.as_posix()

    @property
    def synthetic(self) -> set[str | None]:
        """The synthetic profiles (`Profile.label`) that forced its answers' verdicts, None for real acceptance."""
        return {None if a.synthetic is None else Profile(tuple(a.synthetic)).label for a in self.answers}

    @property
    def acceptance(self) -> str:
        """How its verdicts were reached: "real acceptance", or "cost-only, synthetic acceptance 0.8,0.6"."""
        kinds = sorted(
            "real acceptance" if x is None else f"cost-only, synthetic acceptance {x}" for x in self.synthetic
        )
        return " and ".join(kinds) or "real acceptance"

    @property
    def label(self) -> str:
        engine = None if self.engine == "specbench" else self.engine
        cost_only = self.acceptance if self.synthetic - {None} else None
        where = ", ".join(x for x in (self.device, engine, cost_only) if x)
        return f"{self.name} ({where})" if where else self.name


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _check_devices(source: Source, flag: str) -> None:
    """A run answered by Ray workers on different devices pools their timings: refused unless asked for."""
    devices = sorted({w.get("device_name") for w in (source.manifest or {}).get("workers", [])} - {None})
    if len(devices) > 1:
        raise SpecbenchError(
            f"{source.path} was answered on different devices ({', '.join(devices)}), so its speedups pool "
            f"machines: pass {flag} to pool them anyway"
        )


def load_sources(paths: list[Path], mixed_devices: bool = False, flag: str = "--mixed-devices") -> list[Source]:
    """One source per folder given; answer files given one by one join the source of their folder. A run whose
    workers had different devices is refused (naming the command's `flag` that allows it) unless `mixed_devices`."""
    groups: dict[Path, list[Path]] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise SpecbenchError(f"{p}: no such run folder or answer file")
        groups.setdefault((p if p.is_dir() else p.parent).resolve(), []).append(p)
    sources = []
    taken: set[str] = set()
    for root, members in groups.items():
        whole = any(m.is_dir() for m in members)
        answers = read_answers(root) if whole else [a for m in members for a in read_file(m)]
        name = root.name
        if name in taken:
            name = f"{root.parent.name}/{root.name}"
        while name in taken:
            name += "'"
        taken.add(name)
        profile = _read_json(root / "forward_profile.json")
        sweeps = concurrency.read(root / concurrency.FILE)
        sources.append(
            Source(
                root,
                name,
                answers,
                _read_json(root / "manifest.json"),
                {int(k): float(v) for k, v in profile.items()} if profile else None,
                None if sweeps.empty else sweeps,
            )
        )
    if not mixed_devices:
        for source in sources:
            _check_devices(source, flag)
    return _join_shards(sources)


def _join_shards(sources: list[Source]) -> list[Source]:
    """The shards of one `run --shard I/N` command given together become one source, as `specbench merge`
    would make them (and are refused as it refuses them)."""
    from ..run.merge import merged_manifest

    def shard(s: Source) -> list[int] | None:
        return ((s.manifest or {}).get("config") or {}).get("shard")

    splits: dict[int, list[Source]] = {}
    for s in sources:
        if split := shard(s):
            splits.setdefault(split[1], []).append(s)
    out = []
    for s in sources:
        group = splits.get(split[1], []) if (split := shard(s)) else []
        if len(group) < 2:
            out.append(s)
        elif s is group[0]:
            manifest = merged_manifest([g.path for g in group], [g.manifest or {} for g in group])
            name = re.sub(r"-shard\d+of\d+$", "", s.name)
            answers = [a for g in group for a in g.answers]
            out.append(Source(s.path, name, answers, manifest, s.profile))  # shards run no sweeps
    return out
