"""Where the YAML presets live: `methods/` and `tasks/` in a checkout, `specbench/_presets/` in a wheel, plus
folders added at run time (`registry.add_methods`)."""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import SpecbenchError

_HERE = Path(__file__).resolve().parent
_EXTRA: dict[str, list[Path]] = {}


def preset_dir(kind: str) -> Path:
    for candidate in (_HERE / "_presets" / kind, _HERE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise SpecbenchError(f"the {kind} presets are missing from this installation (reinstall specbench)")


def add_dir(kind: str, folder: Path) -> None:
    """Presets in `folder` join the built-in ones (a name defined twice is an error)."""
    if folder not in _EXTRA.setdefault(kind, []):
        clash = sorted({p.stem for p in folder.glob("*.yaml")} & set(names(kind)))
        if clash:
            raise SpecbenchError(f"{folder}: {kind[:-1]} preset '{clash[0]}' already exists; rename it")
        _EXTRA[kind].append(folder)


def _paths(kind: str) -> dict[str, Path]:
    found = {}
    for folder in (preset_dir(kind), *_EXTRA.get(kind, [])):
        found.update({p.stem: p for p in folder.glob("*.yaml")})
    return found


def names(kind: str) -> list[str]:
    return sorted(_paths(kind))


def path(kind: str, name: str) -> Path:
    found = _paths(kind)
    if name not in found:
        raise SpecbenchError(f"unknown {kind[:-1]} '{name}': choose from {', '.join(sorted(found))}")
    return found[name]


def load(kind: str, name: str) -> dict:
    with path(kind, name).open() as f:
        return yaml.safe_load(f) or {}
