"""What `specbench tune` is asked (TuneConfig) and the settings it tries: the preset's `tune:` values, `--grid`
replacing some, split into plain knobs (one calibration run per setting) and nested knobs (`core.proposer.Nested`:
every smaller value scored from the run of the largest)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import methods, presets
from ..config import RunConfig
from ..errors import SpecbenchError


@dataclass
class TuneConfig:
    method: str
    run: RunConfig  # model, device, dtype, calibration tasks, limit, max_new_tokens, seed, ...
    eval_task: str = "quick"
    budget_minutes: float = 10.0
    grid: dict[str, list] = field(default_factory=dict)  # replaces the preset's `tune:` values for these keys
    verify: bool = True
    tuned_file: Path | None = None  # None: tuned.default_path()
    out: Path | None = None


def space(method: str, grid: dict[str, list]) -> tuple[list[dict], list[dict]]:
    """(the plain-knob values of each calibration run, the nested-knob settings each run scores); the preset's
    `tune:` values with `grid` replacing some, the default's value always among them."""
    spec = methods.preset(method)
    defaults = spec.params
    values = {**spec.tune, **grid}
    if not values:
        raise SpecbenchError(
            f"method '{method}' has nothing to tune: its preset has no `tune:` values; "
            "pass --grid KEY=V1,V2 with a parameter of its preset"
        )
    for key, vals in values.items():
        for value in vals:
            presets.check_params(method, defaults, {key: value})
        if defaults[key] not in vals:
            values[key] = [*vals, defaults[key]]
    nested = methods.registered(method).nested
    nested_keys = [k for k in (nested.keys if nested else ()) if k in values]
    plain = [k for k in values if k not in nested_keys]
    runs = [dict(zip(plain, combo, strict=True)) for combo in itertools.product(*(values[k] for k in plain))]
    runs.sort(key=lambda r: any(r[k] != defaults[k] for k in plain))  # the default's run first
    settings = [dict(zip(nested_keys, c, strict=True)) for c in itertools.product(*(values[k] for k in nested_keys))]
    return runs, settings


def grid_values(pairs: list[str]) -> dict[str, list]:
    """--grid KEY=V1,V2 (repeatable) as {key: [values]}, values read as YAML scalars."""
    out = {}
    for pair in pairs:
        key, sep, values = pair.partition("=")
        if not sep or not key.isidentifier() or not values:
            raise SpecbenchError(f"--grid takes KEY=V1,V2,... (e.g. depth=3,4,5), got '{pair}'")
        out[key] = [yaml.safe_load(v) for v in values.split(",")]
    return out
