"""DFlash2 drafters (z-lab; vLLM `model_executor/models/qwen3_dflash2.py`, `v1/worker/gpu/spec_decode/dflash2/`):
DFlash's block drafter (`heads.dflash`) with two additions.

- Around each layer's attention and MLP, a grouped causal convolution along the block's rows (`GroupedConv`): row
  i's input becomes sum over taps t of (base_kernel[side, t] + delta_t(row i)) * x[i - t], the rows before the
  block's first counting as zero, where delta (one value a channel group and tap) is projected from the normed
  input by `kernel_projection`. `prepare` convolves the sublayer's input (side 0) and keeps side 1's coefficients,
  `finish` convolves its output with them. With base_kernel[:, 0] = 1, the rest 0 and no projection, it is the
  identity.
- A candidate selector: each row's `selector_top_k` most likely tokens under the target's readout (the unary
  scores), and an edge score from the token before, low-rank: unary[c] + <pred[p] * proj(h), succ[c]>, p the
  previous row's chosen candidate (the anchor token for row 0). The chain walks the rows left to right: the best
  candidate given the one before, or at T > 0 a draw from softmax(score / T) over the row's candidates (the
  proposal's law: zero outside them).

Checkpoint: DFlash's layout (or vLLM's speculators `dflash2` type, `heads.speculators`), architecture
`DFlash2DraftModel`, `dflash_config` adding `conv_kernel_size`,
`conv_group_size`, `selector_rank` and `selector_top_k`; tensors per layer `layers.{i}.{attention,mlp}_conv.base_kernel`
[2, taps, H] and `.kernel_projection.weight` [2 * taps * H / group, H], and `candidate_selector.{predecessor,
successor}_codebook` [V, rank] and `candidate_selector.hidden_projection.weight` [rank, H].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from ..errors import SpecbenchError
from ..registry import HeadFamily, head_family
from . import dflash, speculators
from .checkpoint import check, read_weights
from .folder import HEAD_LAYOUTS

TITLE = "DFlash2 drafter"
ARCHITECTURE = "DFlash2DraftModel"
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class GroupedConv(nn.Module):
    """A causal convolution of `taps` taps along the rows of each block of `block` rows, per channel: a learned base
    kernel [2, taps, H] (side 0 before the sublayer, side 1 after) plus coefficients projected from each row's
    normed input, one a group of `group` channels."""

    def __init__(self, hidden: int, taps: int, group: int, block: int) -> None:
        super().__init__()
        if hidden % group:
            raise SpecbenchError(f"{TITLE}: conv_group_size {group} does not divide hidden_size {hidden}")
        self.taps, self.group, self.groups, self.block = taps, group, hidden // group, block
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0  # the identity, as training starts
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [B, n, H] (consecutive blocks) convolved with side `side`'s kernel plus `delta` [B, n, taps, G]."""
        batch, n, _ = x.shape
        parts = x.view(batch, n, self.groups, self.group)
        weights = self.base_kernel[side].view(self.taps, self.groups, self.group) + delta[..., None]  # [B, n, t, G, g]
        place = torch.arange(n, device=x.device) % self.block  # [n]: each row's place in its block
        out = weights[:, :, 0] * parts
        for tap in range(1, self.taps):
            earlier = F.pad(parts[:, :-tap], (0, 0, 0, 0, tap, 0))  # row i: row i - tap
            out = out + weights[:, :, tap] * earlier * (place >= tap).view(1, n, 1, 1).to(x.dtype)
        return out.view(batch, n, -1)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input convolved (side 0), and side 1's coefficients [B, n, taps, G]."""
        coefficients = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.groups)
        return self.convolve(x, coefficients[:, :, 0], 0), coefficients[:, :, 1]

    def finish(self, y: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, coefficients, 1)


class DFlash2Layer(dflash.DFlashLayer):
    def __init__(self, config: Qwen3Config, taps: int, group: int, block: int) -> None:
        super().__init__(config)
        self.attention_conv = GroupedConv(config.hidden_size, taps, group, block)
        self.mlp_conv = GroupedConv(config.hidden_size, taps, group, block)

    def forward(self, x, context, rope, mask, past):
        normed, after = self.attention_conv.prepare(self.input_layernorm(x))
        attended, kept = self.self_attn(normed, context, rope, mask, past)
        x = x + self.attention_conv.finish(attended, after)
        normed, after = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(normed), after), kept


class CandidateSelector(nn.Module):
    """Edge scores between consecutive rows' candidates: low-rank codebooks of the token before and after, gated by
    the row's state."""

    def __init__(self, hidden: int, vocab: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def forward(
        self, candidates: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor, before: torch.Tensor
    ) -> torch.Tensor:
        """Scores [B, k, K, K] of candidate c at row l after candidate p of row l - 1 (row 0: after the anchor):
        `candidates` ids [B, k, K], `unary` [B, k, K], `hidden` the rows' states [B, k, H], `before` the anchor
        tokens [B]."""
        top = candidates.shape[-1]
        previous = torch.cat([before[:, None, None].expand(-1, 1, top), candidates[:, :-1]], dim=1)  # [B, k, K]
        gated = self.predecessor_codebook[previous] * self.hidden_projection(hidden)[:, :, None]  # [B, k, K, r]
        edges = torch.einsum("blpr,blcr->blpc", gated, self.successor_codebook[candidates])
        return unary[:, :, None].float() + edges.float()


class DFlash2Draft(dflash.DFlashDraft):
    def __init__(self, config: Qwen3Config, layer_ids: list[int], block: int, mask: int, target_hidden: int) -> None:
        super().__init__(config, layer_ids, block, mask, target_hidden)
        settings = config.dflash_config  # type: ignore[attr-defined]  # (Qwen3Config keeps the extra key)
        self.top_k = int(settings["selector_top_k"])
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, int(settings["selector_rank"])
        )

    def layer(self, config: Qwen3Config) -> nn.Module:
        settings = config.dflash_config  # type: ignore[attr-defined]
        return DFlash2Layer(
            config, int(settings["conv_kernel_size"]), int(settings["conv_group_size"]), self.block_size
        )

    def candidates(self, hidden: torch.Tensor, readout: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `top_k` most likely token ids [..., K] under the (scaled, capped) readout and their logits."""
        values, ids = self.logits(hidden, readout).float().topk(self.top_k, dim=-1)
        return ids, values


def build(raw: dict, target_hidden: int | None = None, what: str = TITLE) -> DFlash2Draft:
    """The drafter a config.json describes (random weights; its convolutions the identity)."""
    config, layer_ids, block, mask = dflash.settings_of(raw, what, ARCHITECTURE)
    settings = config.dflash_config or {}
    for key in KEYS:
        value = settings.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecbenchError(f"{what}: config.json needs dflash_config.{key}, a whole number >= 1, not {value!r}")
    if settings["selector_top_k"] > config.vocab_size:
        raise SpecbenchError(f"{what}: selector_top_k {settings['selector_top_k']} exceeds the vocabulary")
    return DFlash2Draft(config, layer_ids, block, mask, target_hidden or config.hidden_size)


def load(source: str | Path, target_model: Any) -> DFlash2Draft:
    """The official layout or speculators' dflash2 type, checked against the target as DFlash's is."""
    what = f"{TITLE} '{source}'"
    raw, shipped_as_speculators = speculators.official(source, "dflash2", TITLE)
    hidden = target_model.get_output_embeddings().weight.shape[1]
    draft = build(raw, hidden, what)
    dflash.check_target(draft, raw, target_model, what)
    state = read_weights(source, dflash.FILES, TITLE)
    if shipped_as_speculators:
        state = speculators.dflash_official_state(state)
    state.pop("rotary_emb.inv_freq", None)
    check({k: v.shape for k, v in dflash.saved_state(draft).items()}, state, what)
    draft.load_state_dict(state, strict=False)
    return draft


def config_for(target_config, layers: int, block: int, mask: int, taps: int, group: int, rank: int, top: int) -> dict:
    """The config.json `specbench train dflash2` writes: DFlash's, with the convolution's and selector's keys."""
    raw = dflash.config_for(target_config, layers, block, mask)
    raw["architectures"] = [ARCHITECTURE]
    raw["dflash_config"].update(conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=top)
    return raw


def fits(folder: Path) -> tuple[int, int | None]:
    config = speculators.official(folder, "dflash2", TITLE)[0]
    if not isinstance(config.get("hidden_size"), int):
        raise SpecbenchError(f"{TITLE} '{folder}': config.json has no hidden_size")
    return config["hidden_size"], config.get("vocab_size")


FAMILY = head_family(HeadFamily("dflash2", "DFlash2", HEAD_LAYOUTS["dflash2"], load, fits))
