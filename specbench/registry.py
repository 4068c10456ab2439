"""The one registry: method implementations and head families, each registered by the module that defines it.

The CLI's choices, `--methods all`, `list methods` and the presets' `needs:` checks derive from it. A method is
a module that calls `implementation(...)` plus a YAML preset naming it; a folder of such modules and presets
outside the package joins with `add_methods(folder)`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core.proposer import Nested
from .errors import SpecbenchError
from .models.hub import Layout


@dataclass(frozen=True)
class Implementation:
    name: str
    build: Callable[..., Any]  # (preset params, Resources) -> Proposer; `batched`: (..., slots) -> Drafter
    nested: Nested | None = None
    graphed: Callable[[dict], bool] | None = None  # (preset params) -> its head drafting is captured under --graphs
    batched: bool = False  # `build` makes one Drafter for a batch's slots (else a Proposer per slot, `PerSlot`)


@dataclass(frozen=True)
class HeadFamily:
    """Draft heads that read the target's states, loaded from their official layout."""

    name: str  # as in `--head NAME=PATH` and `needs: NAME head`
    title: str  # for people: "EAGLE-1/2"
    layout: Layout  # the files a load reads
    load: Callable[[Path, Any], Any]  # (local folder, target model) -> head module
    fits: Callable[[Path], tuple[int | None, int | None]]  # folder -> (target hidden size, vocabulary); None: any
    static: bool = False  # a causal LM its method runs on a static cache under --graphs (else it drafts eagerly)


def unless_sampled(params: dict) -> bool:
    """`graphed` for a method whose top-k drafting is captured under --graphs and whose sampled drafting
    (`sampled: true`, at T > 0) is not."""
    return not params.get("sampled")


IMPLEMENTATIONS: dict[str, Implementation] = {}
HEADS: dict[str, HeadFamily] = {}


def implementation(
    name: str, nested: Nested | None = None, graphed: Callable[[dict], bool] | None = None, batched: bool = False
) -> Callable:
    """Decorator registering a method's builder under `name` (a preset's `implementation:`): `build(params,
    resources) -> Proposer`, one sequence's (a batch's slots get one each), or with `batched`, `build(params,
    resources, slots) -> Drafter`, one for all the slots of a batch."""

    def register(build: Callable) -> Callable:
        IMPLEMENTATIONS[name] = Implementation(name, build, nested, graphed, batched)
        return build

    return register


def head_family(family: HeadFamily) -> HeadFamily:
    HEADS[family.name] = family
    return family


def train_hint(family: str, model: str, out: str | Path) -> str:
    return f"train one with `specbench train {family} --target {model} --out {out}`"


def add_methods(folder: str | Path) -> None:
    """Register a folder of method modules (`*.py`, each calling `implementation`) and presets (`*.yaml`)."""
    from . import presets

    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise SpecbenchError(f"method folder '{folder}' does not exist")
    for path in sorted(folder.glob("*.py")):
        name = f"specbench_user_methods.{path.stem}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None  # a .py file's
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    presets.add_dir("methods", folder)


@dataclass(frozen=True)
class Need:
    """A resource a method cannot run without: the model's draft, or a head of one family (its default one, or
    one the alias names: `eagle3[head=redhat]`)."""

    kind: str  # "draft" or "head"
    family: str | None = None
    name: str | None = None  # a named head of the family (ModelSpec.heads' "family:name"); None: the default

    @property
    def key(self) -> str:
        """How the head is keyed in an alias's heads, `--head` and the run's roles: "eagle3" or "eagle3:redhat"."""
        return f"{self.family}:{self.name}" if self.name else str(self.family)


def parse_needs(method: str, value: str | list | None, head: str | None = None) -> list[Need]:
    """A preset's `needs:` ("draft", "eagle head", or a list of them) as Need values; `head`: the name of the head
    it asks for (a method that needs none cannot name one)."""
    items = [value] if isinstance(value, str) else list(value or [])
    needs = []
    for item in items:
        words = str(item).split()
        if words == ["draft"]:
            needs.append(Need("draft"))
        elif len(words) == 2 and words[1] == "head" and words[0] in HEADS:
            needs.append(Need("head", words[0], head))
        else:
            families = ", ".join(f"'{f} head'" for f in HEADS)
            raise SpecbenchError(f"method preset '{method}': needs '{item}' is not 'draft' or one of {families}")
    if head is not None and not any(n.kind == "head" for n in needs):
        raise SpecbenchError(f"method '{method}' drafts with no head: drop head={head}")
    return needs
