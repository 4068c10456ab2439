"""Synthetic acceptance (`run --acceptance synthetic:PROFILE`): per-position acceptance rates that force the verdict
of a real verification, so a run measures what a method costs at a given acceptance (a GPU check on random weights,
where nothing would be accepted). The profile is read here without torch, so a bad one is refused at once."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecbenchError

PREFIX = "synthetic:"
EXAMPLE = "synthetic:0.8,0.6,0.5 or synthetic:speculation_profile.json"


@dataclass(frozen=True)
class Profile:
    """Conditional acceptance rates by draft depth: `rates[d]` is the chance that the drafted token at depth d + 1
    is accepted given that every shallower one was. Depths past the list take its last rate, so one rate is a
    constant (`synthetic:0.7`); end the list with 0 to accept no deeper."""

    rates: tuple[float, ...]

    def rate(self, depth: int) -> float:
        """The rate at draft depth `depth` (1 = the first drafted token)."""
        return self.rates[min(depth, len(self.rates)) - 1]

    @property
    def label(self) -> str:
        """The rates as answers, manifests and reports name them (`0.8,0.6,0.5`)."""
        return ",".join(f"{r:g}" for r in self.rates)


def parse(spec: str) -> Profile:
    """`--acceptance`'s value: `synthetic:` then comma-separated rates in [0, 1], or a JSON file holding a list of
    them or a speculation profile the report writes (its `conditional_accept_rates`)."""
    if not spec.startswith(PREFIX):
        raise SpecbenchError(f"--acceptance '{spec}': the one mode is synthetic, e.g. {EXAMPLE}")
    body = spec[len(PREFIX) :].strip()
    try:
        rates = [float(x) for x in body.split(",")]
    except ValueError:
        rates = _read(body)
    if not rates or any(not (0.0 <= r <= 1.0) or math.isnan(r) for r in rates):
        raise SpecbenchError(f"--acceptance '{spec}': each rate must lie in [0, 1] (e.g. {EXAMPLE})")
    return Profile(tuple(rates))


def _read(path: str) -> list[float]:
    """The rates in a JSON file: a list of numbers, or an object with `conditional_accept_rates`."""
    file = Path(path)
    if not file.is_file():
        raise SpecbenchError(f"--acceptance synthetic:{path}: neither rates nor a file; write e.g. {EXAMPLE}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SpecbenchError(f"--acceptance synthetic:{path}: not readable JSON ({err})") from None
    rates = data.get("conditional_accept_rates") if isinstance(data, dict) else data
    if not isinstance(rates, list) or not all(isinstance(r, (int, float)) for r in rates):
        raise SpecbenchError(
            f"--acceptance synthetic:{path}: hold a list of rates or a speculation_profile.json (its "
            "conditional_accept_rates)"
        )
    return [float(r) for r in rates]
