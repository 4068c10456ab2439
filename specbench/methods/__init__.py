"""Methods: YAML presets (`methods/*.yaml`) naming an implementation registered by a module of this package.

Every module here is imported on first use, so a new method is one module calling `implementation` plus one preset;
nothing else changes. A method folder outside the package imports what it needs from here: the proposer types
(`Proposer`, `Proposal`, `Feedback`, `Turn`, `NO_PROPOSAL`), `Resources`, `implementation` and the nested-knob
helpers (`Nested`, `chain_prefix`, `tree_prefix`); token trees come from `specbench.tree`.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re

import yaml

from .. import presets, registry
from ..core import acceptance
from ..core.proposer import NO_PROPOSAL, Feedback, Nested, Proposal, Proposer, Turn, chain_prefix, tree_prefix
from ..errors import SpecbenchError
from ..registry import Need, implementation, parse_needs
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


def eager_drafting(name: str) -> bool:
    """Whether the method drafts with a head outside static caches and CUDA graphs under --graphs."""
    spec = preset(name)
    graphed = registry.IMPLEMENTATIONS[spec.implementation].graphed
    if graphed is not None and graphed(spec.params):
        return False
    return any(need.kind == "head" and not registry.HEADS[need.family].static for need in needs(name))


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


def variant_name(base: str, params: dict, defaults: dict) -> str:
    """What `variant` reads back: 'eagle2[top_k=6,depth=4]', the params that differ from `defaults` in their order;
    a string bare where it reads back as itself ('draft_dtype=bfloat16')."""
    changed = [f"{k}={_scalar(v)}" for k, v in params.items() if defaults.get(k) != v]
    return f"{base}[{','.join(changed)}]" if changed else base


def _scalar(value) -> str:
    return value if isinstance(value, str) and yaml.safe_load(value) == value else json.dumps(value)


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


__all__ = [  # the plug-in API first, then the library's use of presets
    "NO_PROPOSAL", "Feedback", "Nested", "Proposal", "Proposer", "Resources", "Turn", "chain_prefix", "implementation",
    "tree_prefix",
    "available", "build", "needs", "preset", "rule", "variant", "variant_name",
]  # fmt: skip
