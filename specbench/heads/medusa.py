"""Medusa heads: per head, residual SiLU blocks then a vocabulary projection (or the target's lm_head).

Layout of `medusa_lm_head.pt` / `.safetensors` (a ModuleList state dict): `{i}.{j}.linear.weight|bias` for
block j of head i, and `{i}.{layers}.weight` [V, H] for its own projection (absent: the target's lm_head is
reused, the "legacy v2" variant). The number of heads comes from the weights: the official Vicuna config
says 2 where the file holds 5.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import SpecbenchError
from ..registry import HeadFamily, head_family
from .checkpoint import check, read_weights, save_safetensors, weight_shapes
from .folder import HEAD_LAYOUTS
from .folder import MEDUSA_FILES as FILES


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity, as in Medusa's training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int | None) -> None:
        """vocab None: no projection of their own; the target's lm_head maps every head to logits."""
        super().__init__(
            nn.Sequential(
                *[ResBlock(hidden) for _ in range(num_layers)],
                *([nn.Linear(hidden, vocab, bias=False)] if vocab else []),
            )
            for _ in range(num_heads)
        )
        self.num_layers = num_layers
        self.shared_lm_head = vocab is None

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """hidden [..., H] -> logits [heads, ..., V]; head k predicts k + 2 tokens after the hidden's row."""
        out = [head(hidden) for head in self]
        return torch.stack([lm_head(h) for h in out] if self.shared_lm_head else out)


def from_state(state: dict[str, torch.Tensor], what: str) -> MedusaHeads:
    """Heads shaped after the checkpoint's own keys, with the weights loaded (exact key set)."""
    if "0.0.linear.weight" not in state:
        raise SpecbenchError(f"{what}: key '0.0.linear.weight' is missing: not a Medusa head checkpoint")
    blocks = [(int(m[1]), int(m[2])) for k in state if (m := re.match(r"(\d+)\.(\d+)\.linear\.weight$", k))]
    num_heads = 1 + max(i for i, _ in blocks)
    num_layers = 1 + max(j for _, j in blocks)
    hidden = state["0.0.linear.weight"].shape[1]
    projection = state.get(f"0.{num_layers}.weight")
    with torch.device("meta"):  # no random init of up to 5 x [V, H] weights that are replaced next
        heads = MedusaHeads(num_heads, num_layers, hidden, projection.shape[0] if projection is not None else None)
    check({k: v.shape for k, v in heads.state_dict().items()}, state, what)
    heads.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)  # cast to the run's dtype later
    return heads


def load(source: str | Path, target_model: Any | None = None) -> MedusaHeads:
    """Heads from the official layout; with `target_model`, checked to be for its hidden size and vocabulary."""
    heads = from_state(read_weights(source, FILES, "Medusa heads"), f"Medusa heads '{source}'")
    if target_model is not None:
        vocab, hidden = target_model.get_output_embeddings().weight.shape
        _check_fits(source, fits(Path(source)), hidden, vocab)
    return heads


def fits(folder: Path) -> tuple[int, int | None]:
    """The target hidden size and vocabulary (None: the heads read out through the target's lm_head)."""
    shapes = weight_shapes(folder, FILES, "Medusa heads")
    if "0.0.linear.weight" not in shapes:
        raise SpecbenchError(f"Medusa heads '{folder}': key '0.0.linear.weight' is missing: not a Medusa checkpoint")
    layers = 1 + max(int(m[1]) for k in shapes if (m := re.match(r"0\.(\d+)\.linear\.weight$", k)))
    projection = shapes.get(f"0.{layers}.weight")
    return shapes["0.0.linear.weight"][1], projection[0] if projection else None


def _check_fits(source, shape: tuple[int, int | None], hidden: int, vocab: int) -> None:
    if shape[0] != hidden or shape[1] not in (None, vocab):
        raise SpecbenchError(
            f"Medusa heads '{source}' are for hidden size {shape[0]} and vocabulary {shape[1]}, the target has "
            f"{hidden} and {vocab}: use heads trained for this target"
        )


def save(heads: MedusaHeads, out: Path, base_model: str, half: bool = False) -> None:
    """The official heads-only layout: medusa_lm_head.safetensors + config.json."""
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(heads.state_dict(), out / FILES[0], half)
    config = {
        "base_model_name_or_path": base_model,
        "medusa_num_heads": len(heads),
        "medusa_num_layers": heads.num_layers,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


FAMILY = head_family(HeadFamily("medusa", "Medusa", HEAD_LAYOUTS["medusa"], load, fits))
