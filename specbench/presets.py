"""Where the YAML presets live: `methods/` and `tasks/` in a checkout, `specbench/_presets/` in a wheel."""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import SpecbenchError

_HERE = Path(__file__).resolve().parent


def preset_dir(kind: str) -> Path:
    for candidate in (_HERE / "_presets" / kind, _HERE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise SpecbenchError(f"the {kind} presets are missing from this installation (reinstall specbench)")


def names(kind: str) -> list[str]:
    return sorted(p.stem for p in preset_dir(kind).glob("*.yaml"))


def load(kind: str, name: str) -> dict:
    path = preset_dir(kind) / f"{name}.yaml"
    if not path.is_file():
        raise SpecbenchError(f"unknown {kind[:-1]} '{name}': choose from {', '.join(names(kind))}")
    with path.open() as f:
        return yaml.safe_load(f) or {}
