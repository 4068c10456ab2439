"""The method registry: YAML preset name -> proposer built with its hyper-parameters and checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import presets
from ..errors import SpecbenchError
from ..models import ModelSpec, load_causal_lm, load_tokenizer, same_tokenizer
from .base import Proposal, Proposer
from .pld import PromptLookup
from .sps import DraftModel
from .vanilla import Vanilla


@dataclass
class Resources:
    """What a method may need besides its hyper-parameters."""

    spec: ModelSpec
    target_model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    draft: str | None = None  # overrides spec.draft

    def load_draft(self) -> torch.nn.Module:
        path = self.draft or self.spec.draft
        if path is None:
            raise SpecbenchError(f"model '{self.spec.name}' has no draft model: pass one with --draft PATH_OR_HUB_ID")
        if not same_tokenizer(load_tokenizer(path), self.tokenizer):
            raise SpecbenchError(
                f"draft '{path}' uses a different tokenizer from target '{self.spec.path}': sps needs the same one"
            )
        return load_causal_lm(path, self.device, self.dtype, what="draft model")


def _vanilla(params: dict, res: Resources) -> Proposer:
    return Vanilla(**params)


def _sps(params: dict, res: Resources) -> Proposer:
    return DraftModel(res.load_draft(), **params)


def _pld(params: dict, res: Resources) -> Proposer:
    return PromptLookup(**params)


IMPLEMENTATIONS: dict[str, Callable[[dict, Resources], Proposer]] = {
    "vanilla": _vanilla,
    "sps": _sps,
    "pld": _pld,
}


def available() -> list[str]:
    return presets.names("methods")


def preset(name: str) -> dict:
    spec = presets.load("methods", name)
    if spec.get("implementation") not in IMPLEMENTATIONS:
        raise SpecbenchError(f"method preset '{name}' names an unknown implementation {spec.get('implementation')}")
    return spec


def build(name: str, res: Resources, overrides: dict | None = None) -> Proposer:
    spec = preset(name)
    params = {**(spec.get("params") or {}), **(overrides or {})}
    try:
        proposer = IMPLEMENTATIONS[spec["implementation"]](params, res)
    except (TypeError, ValueError) as err:
        raise SpecbenchError(f"bad parameters for method '{name}': {err}") from err
    proposer.name = name
    return proposer


__all__ = ["Proposal", "Proposer", "Resources", "available", "build", "preset"]
