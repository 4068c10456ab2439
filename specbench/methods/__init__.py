"""The method registry: YAML preset name -> proposer built with its hyper-parameters and checkpoints."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from .. import choices, presets
from ..errors import SpecbenchError
from ..heads import eagle as eagle_heads
from ..heads import eagle3 as eagle3_heads
from ..heads import medusa as medusa_heads
from ..heads.checkpoint import trained_for_other_target
from ..models import ModelSpec, load_causal_lm, load_tokenizer, same_tokenizer
from .base import Proposal, Proposer
from .eagle import DynamicTree, Eagle, StaticTree
from .lookahead import Lookahead
from .medusa import Medusa
from .ouroboros import Ouroboros
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
    heads: dict[str, str] = field(default_factory=dict)  # overrides spec.heads[family]; "*" for every family

    def load_draft(self) -> torch.nn.Module:
        path = self.draft or self.spec.draft
        if path is None:
            raise SpecbenchError(f"model '{self.spec.name}' has no draft model: pass one with --draft PATH_OR_HUB_ID")
        if not same_tokenizer(load_tokenizer(path), self.tokenizer):
            raise SpecbenchError(
                f"draft '{path}' uses a different tokenizer from target '{self.spec.path}': a draft must share it"
            )
        return load_causal_lm(path, self.device, self.dtype, what="draft model")

    def head_source(self, family: str) -> str:
        """The folder or hub id of the model's head checkpoint for a method family."""
        source = self.heads.get(family) or self.heads.get("*") or self.spec.heads.get(family)
        if source is None:
            raise SpecbenchError(
                f"model '{self.spec.name}' has no {family} head: pass one with --head {family}=PATH_OR_HUB_ID, or "
                f"train one with `specbench train {family} --target {self.spec.name} --out PATH`"
            )
        if source.startswith("/") and not Path(source).is_dir():
            raise SpecbenchError(
                f"the {family} head of '{self.spec.name}' is missing at {source}: train it with "
                f"`specbench train {family} --target {self.spec.name} --out {source}`"
            )
        if trained_for_other_target(source, self.target_model):
            print(
                f"warning: the {family} head at {source} was trained for a different version of target "
                f"'{self.spec.name}' (its accuracy.json signature differs), so its acceptance will be poor: "
                f"retrain it with `specbench train {family} --target {self.spec.name} --out {source}`",
                file=sys.stderr,
            )
        return source


def _vanilla(params: dict, res: Resources) -> Proposer:
    return Vanilla(**params)


def _sps(params: dict, res: Resources) -> Proposer:
    return DraftModel(res.load_draft(), **params)


def _pld(params: dict, res: Resources) -> Proposer:
    return PromptLookup(**params)


def _lookahead(params: dict, res: Resources) -> Proposer:
    return Lookahead(**params)


def _ouroboros(params: dict, res: Resources) -> Proposer:
    return Ouroboros(res.load_draft(), **params)


def _medusa(params: dict, res: Resources) -> Proposer:
    heads = medusa_heads.load(res.head_source("medusa")).to(res.device, res.dtype)
    tree = choices.resolve(params.pop("tree", "medusa_mc_sim_7b_63"))
    return Medusa(heads, res.target_model.get_output_embeddings(), tree, **params)


def _eagle_head(res: Resources) -> eagle_heads.EagleHead:
    return eagle_heads.load(res.head_source("eagle"), res.target_model).to(res.device, res.dtype)


def _eagle(params: dict, res: Resources) -> Proposer:
    tree = StaticTree(choices.resolve(params.pop("tree", "eagle_mc_sim_7b_63")), **params)
    return Eagle(_eagle_head(res), res.target_model.get_output_embeddings(), tree)


def _eagle2(params: dict, res: Resources) -> Proposer:
    return Eagle(_eagle_head(res), res.target_model.get_output_embeddings(), DynamicTree(**params))


def _eagle3(params: dict, res: Resources) -> Proposer:
    head = eagle3_heads.load(res.head_source("eagle3"), res.target_model).to(res.device, res.dtype)
    layers = eagle3_heads.feature_layers(res.target_model.config.get_text_config().num_hidden_layers)
    return Eagle(head, head.logits, DynamicTree(**params), feature_layers=layers, target_ids=head.target_ids)


IMPLEMENTATIONS: dict[str, Callable[[dict, Resources], Proposer]] = {
    "vanilla": _vanilla,
    "sps": _sps,
    "pld": _pld,
    "medusa": _medusa,
    "eagle": _eagle,
    "eagle2": _eagle2,
    "eagle3": _eagle3,
    "lookahead": _lookahead,
    "ouroboros": _ouroboros,
}


def available() -> list[str]:
    return presets.names("methods")


_VARIANT = re.compile(r"^([\w.-]+)\[(.*)\]$")


def preset(name: str) -> dict:
    """A method's YAML preset; for a variant `base[key=value,...]`, base's preset with those params changed."""
    base, overrides = variant(name)
    spec = presets.load("methods", base)
    if spec.get("implementation") not in IMPLEMENTATIONS:
        raise SpecbenchError(f"method preset '{base}' names an unknown implementation {spec.get('implementation')}")
    if overrides:
        spec = {**spec, "params": {**(spec.get("params") or {}), **overrides}}
    return spec


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
    params = {**(spec.get("params") or {}), **(overrides or {})}
    try:
        proposer = IMPLEMENTATIONS[spec["implementation"]](params, res)
    except (TypeError, ValueError) as err:
        raise SpecbenchError(f"bad parameters for method '{name}': {err}") from err
    if proposer.lossless != bool(spec.get("lossless", True)):  # results are labelled from the preset
        raise SpecbenchError(f"method preset '{name}' must say lossless: {str(proposer.lossless).lower()} for its rule")
    proposer.name = name
    return proposer


__all__ = ["Proposal", "Proposer", "Resources", "available", "build", "preset", "variant"]
