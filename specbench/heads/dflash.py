"""DFlash drafters (Chen, Liang, Liu 2026; z-lab/dflash): a few decoder layers that fill a whole block in one
forward. The block is the last committed token followed by block_size - 1 mask tokens, embedded by the target;
every layer's attention reads the block's own rows (bidirectionally) and a context: the target's hidden states
after the layers `target_layer_ids` for every committed token before the block, fused by fc (kH -> H) and
hidden_norm, the same for every layer. Row i of the output, read out by the target's lm_head, guesses the
token i places past the block's first: a chain of block_size - 1 drafts.

The context rows are committed tokens, so their keys and values are kept (`Context`); the block's are not.

Checkpoint (official layout, architecture `DFlashDraftModel`): config.json is a Qwen3 config plus
`block_size` (top level, or in `dflash_config` as later releases write it), `dflash_config.mask_token_id`,
`dflash_config.target_layer_ids` and `num_target_layers` (or vLLM's speculators format: `heads.speculators`);
model.safetensors holds exactly fc.weight, hidden_norm.weight, norm.weight and per layer i
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight` and `layers.{i}.{input,post_attention}_layernorm.weight`. No
embedding and no readout: the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ..errors import SpecbenchError
from ..models.decoder import MLP, RMSNorm, rotate
from ..registry import HeadFamily, head_family
from . import speculators
from .checkpoint import check, read_weights, save_safetensors
from .folder import DFLASH_FILES as FILES
from .folder import HEAD_LAYOUTS

Context = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [B, kv heads, committed, d]


@dataclass
class Slots:
    """One layer's preallocated keys and values [B, kv heads, capacity, d] (--graphs, a batch's slots side by side):
    a forward writes its context and block rows at the rows `at` holds ([n], or [B, n]: each slot's) and attends
    over the first `span` rows, under its mask. `lanes` [m]: the forward runs over those slots alone (written in
    place, read as a copy)."""

    keys: torch.Tensor
    values: torch.Tensor
    at: torch.Tensor | None = None
    span: int = 0
    lanes: torch.Tensor | None = None

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The forward's keys and values [B or m, kv heads, n, d] into the rows `at`, in place."""
        assert self.at is not None
        for states, stored in ((keys, self.keys), (values, self.values)):
            if len(stored) == 1:  # one sequence: the one copy along the rows
                stored.index_copy_(2, self.at.view(-1), states)
            else:  # [B, n, kv heads, d] into [slot, :, row]
                lanes = torch.arange(len(stored), device=stored.device) if self.lanes is None else self.lanes
                stored[lanes[:, None], :, self.at] = states.transpose(1, 2)

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a forward attends over: its slots' first `span` rows."""
        if self.lanes is None:
            return self.keys[:, :, : self.span], self.values[:, :, : self.span]
        return self.keys[self.lanes, :, : self.span], self.values[self.lanes, :, : self.span]

    def slot(self, i: int) -> Slots:
        """Slot i's rows alone (views: the writes land in the whole)."""
        return Slots(self.keys[i : i + 1], self.values[i : i + 1])

    def over(self, lanes: torch.Tensor) -> Slots:
        """The slots `lanes` [m] alone (their rows written in place, read as a copy)."""
        return Slots(self.keys, self.values, lanes=lanes)


def slots(draft: DFlashDraft, capacity: int, batch: int = 1) -> list[Slots]:
    """Every layer's `Slots` for `batch` sequences, on the drafter's device and in its dtype."""
    config, weight = draft.config, draft.fc.weight
    assert config.num_key_value_heads is not None  # Qwen3Config sets it
    shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
    return [Slots(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in draft.layers]


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The official default: the middle layer for a one-layer draft, else evenly from layer 1 to L - 3 (a target
    of under five layers: as far as it goes)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context rows and the block (Qwen3's per-head norms)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        d, bias = config.head_dim, config.attention_bias
        assert config.num_key_value_heads is not None  # Qwen3Config sets it
        self.head_dim = d
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm.build(d, config.rms_norm_eps)
        self.k_norm = RMSNorm.build(d, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, n, H]: the block's rows
        context: torch.Tensor,  # [B, c, H]: new context rows
        rope: tuple[torch.Tensor, torch.Tensor],  # [B, c + n, d] each: the context's positions, then the block's
        mask: torch.Tensor | None,  # bool [B, 1, n or 1, keys], True = attend; None: everything
        past: tuple[torch.Tensor, torch.Tensor] | Slots | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | Slots]:
        """The attention output [B, n, H] and the context's keys and values, past ones included (or the slots they
        were written to)."""
        batch, n, _ = x.shape
        both = torch.cat([context, x], dim=1)  # [B, c + n, H]
        q = self.q_norm(self.q_proj(x).view(batch, n, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(batch, both.shape[1], -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(batch, both.shape[1], -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = rotate(q, cos[:, -n:], sin[:, -n:]), rotate(k, cos, sin)
        kept: tuple[torch.Tensor, torch.Tensor] | Slots
        if isinstance(past, Slots):  # written in place; the block's rows are overwritten by the next context
            past.write(k, v)
            (k, v), kept = past.attended(), past
        else:
            if past is not None:
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            kept = (k[:, :, :-n], v[:, :, :-n])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, h, n, d]
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1)), kept


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm.build(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm.build(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP.build(config.hidden_size, config.intermediate_size)

    def forward(self, x, context, rope, mask, past):
        attended, kept = self.self_attn(self.input_layernorm(x), context, rope, mask, past)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), kept


class DFlashDraft(nn.Module):
    def __init__(
        self, config: Qwen3Config, layer_ids: list[int], block_size: int, mask_token_id: int, target_hidden: int
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_ids = list(layer_ids)
        self.feature_layers = tuple(i + 1 for i in layer_ids)  # CachedLM.run numbers layer i's output i + 1
        self.feature_size = len(layer_ids) * target_hidden
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.layers = nn.ModuleList(self.layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm.build(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(self.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm.build(config.hidden_size, config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)

    def layer(self, config: Qwen3Config) -> nn.Module:
        """One of its decoder layers (DFlash2's adds convolutions)."""
        return DFlashLayer(config)

    def forward(
        self,
        block: torch.Tensor,  # [B, n, H]: the block's embeddings
        features: torch.Tensor,  # [B, c, F]: the target's states of the new context rows
        positions: torch.Tensor,  # [B, c + n]
        mask: torch.Tensor | None = None,  # bool [B, 1, n or 1, keys]; None: everything visible
        past: Context | list[Slots] | None = None,
    ) -> tuple[torch.Tensor, Context | list[Slots]]:
        """The block's final states [B, n, H] (normed, for the target's lm_head) and the context's keys and values
        (or the slots they were written to)."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        x = block.to(self.fc.weight.dtype)
        rope = self.rotary(x, positions)
        kept = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, context, rope, mask, None if past is None else past[i])
            kept.append(kv)
        return self.norm(x), kept

    def embed(self, ids: torch.Tensor, embedding: nn.Module) -> torch.Tensor:
        """A block's input [B, n, H]: the target's embedding, times the input scale of later releases."""
        return embedding(ids) * float(_setting(self.config, "input_embedding_scale", 1.0))

    def logits(self, hidden: torch.Tensor, readout: nn.Module) -> torch.Tensor:
        """Logits through the target's lm_head, with the optional output multiplier and softcap of later releases."""
        logits = readout(hidden) * float(_setting(self.config, "output_multiplier", 1.0))
        cap = _setting(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / float(cap)) * float(cap) if cap else logits


def _setting(config, name: str, default):
    """A DFlash setting: in dflash_config (newer releases), else at the top level."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def build(raw: dict, target_hidden: int | None = None, what: str = "DFlash drafter") -> DFlashDraft:
    """The drafter a config.json describes (random weights)."""
    config, layer_ids, block, mask = settings_of(raw, what)
    return DFlashDraft(config, layer_ids, block, mask, target_hidden or config.hidden_size)


def settings_of(
    raw: dict, what: str, architecture: str = "DFlashDraftModel"
) -> tuple[Qwen3Config, list[int], int, int]:
    """A drafter config.json's Qwen3 config, target layers, block size and mask token, checked (a DFlash2DraftModel
    only as `architecture`, and only that one then)."""
    dflash2 = "DFlash2DraftModel" in (raw.get("architectures") or [])
    if dflash2 and architecture != "DFlash2DraftModel":
        raise SpecbenchError(
            f"{what} is a DFlash2DraftModel (causal convolutions and a candidate selector): run it as dflash2 "
            "(--head dflash2=...)"
        )
    if architecture == "DFlash2DraftModel" and not dflash2:
        raise SpecbenchError(f"{what}: config.json's architectures do not name DFlash2DraftModel: run it as dflash")
    settings = raw.get("dflash_config") or {}
    layer_ids = settings.get("target_layer_ids", raw.get("target_layer_ids"))
    mask = settings.get("mask_token_id", raw.get("mask_token_id"))
    block = settings.get("block_size", raw.get("block_size", 16))
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) and i >= 0 for i in layer_ids):
        raise SpecbenchError(f"{what}: config.json needs dflash_config.target_layer_ids, a list of layer numbers")
    if not isinstance(mask, int) or not 0 <= mask < raw.get("vocab_size", 0):
        raise SpecbenchError(f"{what}: config.json needs dflash_config.mask_token_id, a token id below vocab_size")
    if not isinstance(block, int) or block < 2:
        raise SpecbenchError(f"{what}: block_size must be an integer >= 2, not {block!r}")
    keys = {
        k: v
        for k, v in raw.items()
        if k not in ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version")
    }
    try:
        config = Qwen3Config(**keys)
    except (TypeError, ValueError, KeyError) as err:
        raise SpecbenchError(f"{what}: config.json is not a Qwen3 config ({err})") from err
    layer_types = config.layer_types or []
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if sliding:
        raise SpecbenchError(
            f"{what}: layer {sliding[0]} is {layer_types[sliding[0]]}; only full-attention DFlash layers are supported"
        )
    config._attn_implementation = "sdpa"
    return config, layer_ids, block, mask


def load(source: str | Path, target_model: Any) -> DFlashDraft:
    """An official-layout (or speculators) drafter, checked against the target: its width, vocabulary and layers."""
    what = f"DFlash drafter '{source}'"
    raw, shipped_as_speculators = speculators.official(source, "dflash", "DFlash drafter")
    hidden = target_model.get_output_embeddings().weight.shape[1]
    draft = build(raw, hidden, what)
    check_target(draft, raw, target_model, what)
    state = read_weights(source, FILES, "DFlash drafter")
    if shipped_as_speculators:
        state = speculators.dflash_official_state(state)
    state.pop("rotary_emb.inv_freq", None)  # a buffer some exports keep
    check({k: v.shape for k, v in saved_state(draft).items()}, state, what)
    draft.load_state_dict(state, strict=False)
    return draft


def check_target(draft: DFlashDraft, raw: dict, target_model: Any, what: str) -> None:
    """The drafter's width, vocabulary and the target layers it reads are the target's."""
    vocab, hidden = target_model.get_output_embeddings().weight.shape
    text = target_model.config.get_text_config()
    if (draft.config.hidden_size, draft.config.vocab_size) != (hidden, vocab):
        raise SpecbenchError(
            f"{what} is for hidden size {draft.config.hidden_size} and vocabulary {draft.config.vocab_size}, the "
            f"target has {hidden} and {vocab}: use a drafter trained for this target"
        )
    layers = raw.get("num_target_layers")
    if (layers is not None and layers != text.num_hidden_layers) or max(draft.layer_ids) >= text.num_hidden_layers:
        raise SpecbenchError(
            f"{what} reads target layers {draft.layer_ids} of {layers or '?'}, the target has "
            f"{text.num_hidden_layers}: use a drafter trained for this target"
        )


def config_for(target_config, layers: int, block_size: int, mask_token_id: int) -> dict:
    """The config.json `specbench train dflash` writes: the target's width, heads and RoPE, `layers` layers."""
    text = target_config.get_text_config()
    rope = dict(getattr(text, "rope_parameters", None) or {"rope_theta": 10000.0, "rope_type": "default"})
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "hidden_act": text.hidden_act,
        "rms_norm_eps": text.rms_norm_eps,
        "attention_bias": False,
        "max_position_embeddings": text.max_position_embeddings,
        "rope_parameters": rope,
        "vocab_size": text.vocab_size,
        "num_hidden_layers": layers,
        "num_target_layers": text.num_hidden_layers,
        "block_size": block_size,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": target_layer_ids(text.num_hidden_layers, layers),
        },
    }


def saved_state(draft: DFlashDraft) -> dict[str, torch.Tensor]:
    """The tensors a drafter is stored with (its rotary tables are not)."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary.")}


def save(draft: DFlashDraft, raw: dict, out: Path, half: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(saved_state(draft), out / "model.safetensors", half)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def fits(folder: Path) -> tuple[int, int | None]:
    """The target hidden size and vocabulary: the drafter's own (it embeds and reads out through the target)."""
    config = speculators.official(folder, "dflash", "DFlash drafter")[0]
    if not isinstance(config.get("hidden_size"), int):
        raise SpecbenchError(f"DFlash drafter '{folder}': config.json has no hidden_size")
    return config["hidden_size"], config.get("vocab_size")


FAMILY = head_family(HeadFamily("dflash", "DFlash", HEAD_LAYOUTS["dflash"], load, fits))
