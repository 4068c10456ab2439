"""Methods: YAML presets (`methods/*.yaml`) naming an implementation registered by a module of this package.

Every module here is imported on first use, so a new method is one module calling `implementation` plus one preset;
nothing else changes. A method folder outside the package imports what it needs from here: the proposer types
(`Drafter` for a whole batch, `Proposer` for one sequence, `PerSlot`, `Proposal`, `Feedback`, `Turn`,
`NO_PROPOSAL`), `Resources`, `implementation` and the nested-knob helpers (`Nested`, `chain_prefix`,
`tree_prefix`); token trees come from `specbench.tree`.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil

from .. import presets, registry
from ..core import acceptance
from ..core.proposer import (
    NO_PROPOSAL,
    Drafter,
    Feedback,
    Nested,
    PerSlot,
    Proposal,
    Proposer,
    Turn,
    chain_prefix,
    tree_prefix,
)
from ..errors import SpecbenchError
from ..presets import variant, variant_name
from ..registry import Need, implementation, parse_needs
from .resources import Resources

for _module in pkgutil.iter_modules(__path__):  # each registers its implementations (and head families)
    importlib.import_module(f"{__name__}.{_module.name}")


def available() -> list[str]:
    return presets.names("methods")


def preset(name: str) -> presets.MethodPreset:
    """A method's YAML preset; for a variant `base[key=value,...]`, base's preset with those params changed
    (`presets.method`), naming a registered implementation."""
    spec = presets.method(name)
    if spec.implementation is not None and spec.implementation not in registry.IMPLEMENTATIONS:
        base = variant(name)[0]
        raise SpecbenchError(f"method preset '{base}' names an unknown implementation {spec.implementation}")
    return spec


def registered(name: str) -> registry.Implementation:
    """The implementation our loop runs the method with; a method only an engine runs is one line."""
    spec = preset(name)
    if spec.implementation is None:
        raise SpecbenchError(f"{name} runs only in an engine, not in our loop: add {spec.engine_flags()}")
    return registry.IMPLEMENTATIONS[spec.implementation]


def needs(name: str) -> list[Need]:
    """What the method cannot run without, from its preset's `needs:` key."""
    spec = preset(name)
    return parse_needs(name, spec.needs, spec.head)


def eager_drafting(name: str) -> bool:
    """Whether the method drafts with a head outside static caches and CUDA graphs under --graphs."""
    spec = preset(name)
    if spec.implementation is None:
        return False  # drafts in its engine
    graphed = registry.IMPLEMENTATIONS[spec.implementation].graphed
    if graphed is not None and graphed(spec.params):
        return False
    return any(need.kind == "head" and need.family and not registry.HEADS[need.family].static for need in needs(name))


def _built(name: str, res: Resources | None, overrides: dict | None, *slots: int):
    """What the method's registered builder makes of its preset's params (with `overrides`)."""
    spec = preset(name)
    params = {**spec.params, **(overrides or {})}
    heads = [n for n in needs(name) if n.kind == "head"]
    try:
        with res.choosing(heads) if heads and res is not None else contextlib.nullcontext():
            return registered(name).build(params, res, *slots)
    except (TypeError, ValueError) as err:
        raise SpecbenchError(f"bad parameters for method '{name}': {err}") from err


def build(name: str, res: Resources | None, overrides: dict | None = None) -> Proposer | Drafter:
    """What the method drafts one sequence with: its proposer, or a batched implementation's Drafter for a batch of
    one."""
    if registered(name).batched:
        return _built(name, res, overrides, 1)
    return _built(name, res, overrides)


def build_batch(name: str, res: Resources | None, batch: int = 1, overrides: dict | None = None) -> Drafter:
    """The method's drafting for a batch of `batch` slots (B = 1 a batch of one), its preset's params changed by
    `overrides`: a batched implementation's own Drafter, else one proposer per slot adapted (`PerSlot`)."""
    if registered(name).batched:
        return _built(name, res, overrides, batch)
    return PerSlot([_built(name, res, overrides) for _ in range(batch)])


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
    "NO_PROPOSAL",
    "Drafter",
    "PerSlot",
    "Feedback",
    "Nested",
    "Proposal",
    "Proposer",
    "Resources",
    "Turn",
    "chain_prefix",
    "implementation",
    "tree_prefix",
    "available",
    "build",
    "build_batch",
    "needs",
    "preset",
    "rule",
    "variant",
    "variant_name",
]
