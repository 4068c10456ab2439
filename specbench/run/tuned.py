"""The tuned-presets file: what `specbench tune` chose for each device, model and dtype, and the variants
`specbench run --tuned` adds beside the defaults. A choice made on one device is never used on another."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..errors import SpecbenchError

if TYPE_CHECKING:  # the file is read without torch: `run.inputs` checks --tuned before the heavy imports
    import torch

DEFAULT_FILE = "tuned.yaml"  # under $SPECBENCH_HOME, else ~/.config/specbench


def default_path() -> Path:
    home = os.environ.get("SPECBENCH_HOME") or Path.home() / ".config" / "specbench"
    return Path(home) / DEFAULT_FILE


def device_key(device: torch.device, threads: int | None = None) -> str:
    """The device a choice holds for: the GPU's name, or the CPU's name and the torch threads it runs with."""
    import torch

    from ..machine import device_name

    name = device_name(device)
    return name if device.type == "cuda" else f"{name} ({threads or torch.get_num_threads()} threads)"


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SpecbenchError(f"tuned-presets file {path} is not valid YAML ({err}): fix or delete it") from err
    if not isinstance(data, dict):
        raise SpecbenchError(f"tuned-presets file {path} does not map devices to models: fix or delete it")
    return data


def save(path: Path, device: str, model: str, dtype: str, method: str, entry: dict) -> None:
    """Record `entry` (variant, params, predicted and measured speedups, ...) for the method; written whole
    through a temporary file so a killed write leaves the old file."""
    data = _read(path)
    data.setdefault(device, {}).setdefault(f"{model}/{dtype}", {})[method] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False, width=120))
    tmp.replace(path)


def presets(path: Path, model: str) -> dict:
    """What the tuned-presets file holds; a file missing, empty or not a mapping is one line saying what to do."""
    data = _read(path)
    if not data:
        raise SpecbenchError(f"no tuned presets in {path}: run `specbench tune --method NAME --model {model}` first")
    return data


def lookup(path: Path, device: str, model: str, dtype: str) -> dict[str, dict]:
    """method -> its tuned entry for this device, model and dtype; a one-line error when the file holds nothing
    tuned on this device."""
    data = presets(path, model)
    if device not in data:
        raise SpecbenchError(
            f"{path} was tuned on {', '.join(map(repr, data))}, not on this device ({device!r}): timings do not "
            f"carry across devices, so run `specbench tune` here"
        )
    return dict(data[device].get(f"{model}/{dtype}", {}))


def with_tuned(names: list[str], entries: dict[str, dict]) -> tuple[list[str], dict[str, str]]:
    """Each method that was tuned followed by its tuned variant (unless it is the default itself); returns the
    new list and method -> variant for the manifest."""
    out, used = [], {}
    for name in names:
        out.append(name)
        entry = entries.get(name)
        if entry is not None and entry["variant"] != name and entry["variant"] not in names:
            out.append(entry["variant"])
            used[name] = entry["variant"]
    return out, used
