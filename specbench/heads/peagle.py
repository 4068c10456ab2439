"""P-EAGLE's draft head (Hui et al., arXiv 2602.01469; vLLM's speculators type `peagle`): an EAGLE-3 head (any
number of layers, EAGLE 3.1's options) that drafts K tokens in one causal forward. The rows after the last
committed pair carry the mask token (`mask_token_id`) and a learned `mask_hidden` [1, 1, 3H] in place of the fused
target states; it goes through input_norm/fc_norm and fc as those would (speculators'
`src/speculators/models/peagle/core.py`, `PEagleDraftModel.forward`), and row j's output guesses the token j + 1
places past the last committed pair's.

Checkpoint: EAGLE-3's official layout (`heads.eagle3`) plus the tensor `mask_hidden` and the config key
`mask_token_id`, or speculators' peagle checkpoint (`models/peagle/config.py`: eagle3's keys plus
`mask_token_id`), translated by `heads.speculators`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig

from ..errors import SpecbenchError
from ..registry import HeadFamily, head_family
from . import eagle, eagle3, speculators
from .folder import HEAD_LAYOUTS

TITLE = "P-EAGLE head"


class PEagleHead(eagle3.Eagle3Head):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.mask_token_id = int(config.mask_token_id)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, self.feature_size))  # (speculators: randn at init)

    def masks(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The features [batch, n, 3H] and tokens [batch, n] of n parallel rows."""
        tokens = torch.full((batch, n), self.mask_token_id, device=self.mask_hidden.device)
        return self.mask_hidden.expand(batch, n, -1), tokens


def build(raw: dict) -> PEagleHead:
    """The head a config.json in the official layout describes (random weights)."""
    mask = raw.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < raw.get("vocab_size", 0):
        raise SpecbenchError(
            f"{TITLE} config.json needs mask_token_id, a token id of its vocabulary (the id its parallel rows carry)"
        )
    return PEagleHead(eagle3.config_of(raw, TITLE))


def load(source: str | Path, target_model: Any) -> PEagleHead:
    """An official-layout or speculators head (`eagle3.filled`); its mask_hidden is required."""
    raw, shipped_as_speculators = speculators.official(source, "peagle", TITLE)
    renamed = speculators.eagle3_official_state if shipped_as_speculators else None
    return eagle3.filled(build(raw), source, target_model, TITLE, renamed)


def save(head: PEagleHead, raw_config: dict, out: Path, half: bool = False) -> None:
    """The official layout (`eagle3.saved_state`: mask_hidden is one of the tensors)."""
    eagle.save(eagle3.saved_state(head), raw_config, out, half)


def fits(folder: Path) -> tuple[int, int | None]:
    return eagle3.fits(folder, "peagle", TITLE)


FAMILY = head_family(HeadFamily("peagle", "P-EAGLE", HEAD_LAYOUTS["peagle"], load, fits))
