"""What a method may need besides its hyper-parameters: the loaded target, and the draft and head checkpoints a
run fetched before loading anything heavy."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..core.cached_lm import CachedLM
from ..core.lanes import Lanes
from ..core.one_slot import OneSlot, Target
from ..core.static_lm import BatchedLM
from ..errors import SpecbenchError
from ..heads.checkpoint import trained_for_other_target
from ..models.few_rows import use_few_row_layout
from ..models.loading import DTYPES, compile_forward, load_causal_lm, owned_decoder
from ..registry import HEADS, Need, train_hint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")


@dataclass
class Resources:
    model_name: str
    target_model: PreTrainedModel
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    draft_path: Path | None = None  # local folder of the draft model
    head_paths: dict[str, Path] = field(default_factory=dict)  # head key ("eagle3", "eagle3:redhat") -> local folder
    trust_remote_code: bool = False
    compile: bool = False  # --compile: drafts and heads through torch.compile (models.compile_forward)
    graphs: bool = False  # --graphs: the draft model on a static cache, its forwards captured on a GPU
    owned: dict[int, torch.nn.Module | None] = field(default_factory=dict)  # id of a model -> its owned decoder
    step_costs: Callable[[int], dict[int, float]] | None = None  # batch size -> the target's T(rows) there (a run's)
    _draft: torch.nn.Module | None = None
    _chosen: dict[str, str] = field(default_factory=dict)  # family -> the head key the method being built asked for
    _readouts: dict[tuple, torch.nn.Module] = field(default_factory=dict)  # (dtype, rows) -> lm_head copy

    def draft_model(self) -> torch.nn.Module:
        """The draft model, loaded once and shared by the methods that draft with it."""
        if self.draft_path is None:
            raise SpecbenchError(f"model '{self.model_name}' has no draft model: pass one with --draft PATH_OR_HUB_ID")
        if self._draft is None:
            self._draft = load_causal_lm(
                self.draft_path, self.device, self.dtype, "draft model", self.trust_remote_code
            )
            owned = self.owned_decoder(self._draft, "draft model")
            if self.compile:
                compile_forward(owned or self._draft, graphs=owned is not None)
        return self._draft

    def owned_decoder(self, model: torch.nn.Module, what: str, batch: bool = False) -> torch.nn.Module | None:
        """Under --graphs (or for a batch's shared draft: `batch`), the owned decoder on `model`'s weights, built
        once per model (None: eager, or a model outside the Llama family)."""
        if not (self.graphs or batch):
            return None
        if id(model) not in self.owned:
            self.owned[id(model)] = owned_decoder(model, what)
        return self.owned[id(model)]

    @contextlib.contextmanager
    def choosing(self, needs: list[Need]) -> Iterator[None]:
        """While a method is built: the heads it asked for (`eagle3[head=redhat]`) are those `head` loads."""
        self._chosen = {n.family: n.key for n in needs if n.kind == "head" and n.family}
        try:
            yield
        finally:
            self._chosen = {}

    def head_path(self, family: str) -> Path:
        """The folder of the head of `family` the method being built asked for; one line when it has none."""
        key = self._chosen.get(family, family)
        path = self.head_paths.get(key)
        if path is None:
            which = f"head '{key.partition(':')[2]}'" if ":" in key else "head"
            raise SpecbenchError(
                f"model '{self.model_name}' has no {HEADS[family].title} {which}: pass one with "
                f"--head {key}=PATH_OR_HUB_ID, or {train_hint(family, self.model_name, 'PATH')}"
            )
        return path

    def single(self, model: torch.nn.Module, what: str = "draft model") -> Target:
        """`model` with a KV cache of its own (one sequence's), behind the batch interface: on the owned decoder and
        a static cache with --graphs."""
        owned = self.owned_decoder(model, what)
        return BatchedLM(owned) if owned is not None else OneSlot(CachedLM(model))

    def costs(self, batch: int) -> dict[int, float]:
        """The target's profiled seconds per forward by rows a slot, at `batch` slots (a schedule's cost model)."""
        if self.step_costs is None:
            raise SpecbenchError("this method needs the target's profiled step costs: run it through specbench run")
        return self.step_costs(batch)

    def lanes(self, model: torch.nn.Module, what: str, slots: int) -> Lanes:
        """`model`'s caches for a batch of `slots`: one static cache on the owned decoder under --graphs or for a
        batch, so every slot drafts in one forward (a Llama-family model; else a cache per slot), a CachedLM
        per slot otherwise (the eager regime's batch of one)."""
        owned = self.owned_decoder(model, what, batch=slots > 1)
        if owned is None:
            return Lanes(model)
        return Lanes(BatchedLM(owned, slots, capture=None if self.graphs else False))

    def draft_lm(self) -> Target:
        """The draft model with a KV cache of its own (each method drafting with it gets one)."""
        return self.single(self.draft_model())

    def draft_lanes(self, slots: int) -> Lanes:
        """The draft model's caches for a batch of `slots` (`lanes`)."""
        return self.lanes(self.draft_model(), "draft model", slots)

    def draft_dtype(self, name: str | None) -> torch.dtype:
        """The dtype a method's draft computes in: the run's (None) or the one named. A draft may compute more
        coarsely than its target (its guesses are verified by the target, so outputs do not change); on a CPU with
        bfloat16 instructions its products over ten rows run 2-3x as fast as float32's (over one or two, no faster)."""
        if name is None:
            return self.dtype
        if name not in DTYPES:
            raise ValueError(f"draft_dtype '{name}' is not one of {', '.join(DTYPES)} (or null: the run's dtype)")
        return DTYPES[name]

    def readout(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.nn.Module:
        """The target's lm_head in `dtype`, over the token ids `rows` only (ascending; None: all). The whole one
        in the run's dtype is the target's own; any other is a copy, made once per dtype and rows."""
        lm_head = self.target_model.get_output_embeddings()
        if dtype == self.dtype and rows is None:
            return lm_head
        key = (dtype, None if rows is None else tuple(rows.tolist()))
        if key not in self._readouts:
            weight, bias = lm_head.weight, lm_head.bias
            if rows is not None:
                weight, bias = weight[rows], None if bias is None else bias[rows]
            copy = torch.nn.Linear(weight.shape[1], weight.shape[0], bias is not None, self.device, dtype)
            copy.load_state_dict({"weight": weight, **({} if bias is None else {"bias": bias})})
            self._readouts[key] = use_few_row_layout(copy)  # (the few-row layout is float32's only)
        return self._readouts[key]

    def head(self, family: str, dtype: torch.dtype | None = None) -> Any:
        """The head of `family` (the one the method being built asked for: `choosing`) loaded for this target, on the
        run's device, in the run's dtype or `dtype`. Its type is the family's (`HeadFamily.load`'s)."""
        path = self.head_path(family)
        if not path.is_dir():
            raise SpecbenchError(f"the {family} head is missing at {path}: {train_hint(family, self.model_name, path)}")
        if trained_for_other_target(str(path), self.target_model):
            print(
                f"warning: the {family} head at {path} was trained for a different version of target "
                f"'{self.model_name}' (its accuracy.json signature differs), so its acceptance will be poor: "
                f"re{train_hint(family, self.model_name, path)}",
                file=sys.stderr,
            )
        head = HEADS[family].load(path, self.target_model).to(self.device, dtype or self.dtype)
        # a head drafts on the owned decoder's modules (built on them); a whole causal LM (PARD's) under --graphs or
        # for a batch on the owned decoder (`owned_decoder`, then `single` or `lanes`)
        use_few_row_layout(head)
        owned = self.owned_decoder(head, f"{family} head") if hasattr(head, "get_decoder") else None
        if self.compile:
            compile_forward(owned or head, graphs=owned is not None)
        return head
