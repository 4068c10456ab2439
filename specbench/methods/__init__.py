"""Methods: YAML presets (`methods/*.yaml`) naming an implementation registered by a module of this package.

Every module here is imported on first use, so a new method is one module calling `registry.implementation`
plus one preset; nothing else changes.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import yaml

from .. import presets, registry
from ..core import acceptance
from ..core.proposer import Proposal, Proposer
from ..errors import SpecbenchError
from ..registry import Need, parse_needs
from .resources import Resources

for _module in pkgutil.iter_modules(__path__):  # each registers its implementations (and head families)
    importlib.import_module(f"{__name__}.{_module.name}")


def available() -> list[str]:
    return presets.names("methods")


_VARIANT = re.compile(r"^([\w.-]+)\[(.*)\]$")


def preset(name: str) -> presets.MethodPreset:
    """A method's YAML preset; for a variant `base[key=value,...]`, base's preset with those params changed."""
    base, overrides = variant(name)
    spec = presets.load("methods", base)
    if spec.implementation not in registry.IMPLEMENTATIONS:
        raise SpecbenchError(f"method preset '{base}' names an unknown implementation {spec.implementation}")
    return spec.model_copy(update={"params": {**spec.params, **overrides}}) if overrides else spec


def needs(name: str) -> list[Need]:
    """What the method cannot run without, from its preset's `needs:` key."""
    return parse_needs(name, preset(name).needs)


def variant(name: str) -> tuple[str, dict]:
    """'eagle2[top_k=6,depth=4]' -> ('eagle2', {'top_k': 6, 'depth': 4}); values are read as YAML scalars."""
    match = _VARIANT.match(name)
    if match is None:
        if "[" in name or "]" in name:
            raise SpecbenchError(f"method '{name}': write a variant as base[key=value,...], e.g. eagle2[top_k=6]")
        return name, {}
    params = {}
    for item in match.group(2).split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key.isidentifier() or not value:
            raise SpecbenchError(f"method '{name}': write parameters as key=value, e.g. eagle2[top_k=6,depth=4]")
        params[key] = yaml.safe_load(value)
    return match.group(1), params


def build(name: str, res: Resources, overrides: dict | None = None) -> Proposer:
    spec = preset(name)
    params = {**spec.params, **(overrides or {})}
    try:
        return registry.IMPLEMENTATIONS[spec.implementation].build(params, res)
    except (TypeError, ValueError) as err:
        raise SpecbenchError(f"bad parameters for method '{name}': {err}") from err


def rule(name: str) -> acceptance.Rule:
    """The method's acceptance rule from its preset (`acceptance:`, default exact), which must match its label."""
    spec = preset(name)
    try:
        found = acceptance.rule(spec.acceptance)
    except SpecbenchError as err:
        raise SpecbenchError(f"method preset '{name}': {err}") from err
    if found.lossless != spec.lossless:  # results are labelled from the preset
        raise SpecbenchError(f"method preset '{name}' must say lossless: {str(found.lossless).lower()} for its rule")
    return found


__all__ = ["Proposal", "Proposer", "Resources", "available", "build", "needs", "preset", "rule", "variant"]
