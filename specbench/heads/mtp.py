"""Native multi-token-prediction (MTP) modules: the extra decoder layer a DeepSeek-V3-family or Qwen3-Next
model ships to predict the token after next from its own last hidden state h_i and the next token's embedding:

    y_i = block(fc([enorm(embed(t_{i+1})), hnorm(h_i)]))    fc: 2H -> H, no bias; block: one decoder layer of
    logits about t_{i+2} = head(norm(y_i))                   the target's own architecture (attention + MLP/MoE)

Drafting applies module 0 recursively, its output standing in for the next hidden state, as vLLM and SGLang
do. Two published layouts, read from the model's own checkpoint (only the MTP keys are read, from the shards
that hold them):

- DeepSeek-V3 (GLM-4.7-Flash's too): config `num_nextn_predict_layers`; module k at
  `model.layers.{num_hidden_layers + k}.` with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
  `shared_head.head` and optionally `embed_tokens` (else the target's), beside the decoder layer's own keys
  (routed experts one by one: `mlp.experts.{e}.{gate,up,down}_proj`). The embedding at position 0 is zeroed
  and y itself is fed back (vLLM's deepseek_mtp).
- Qwen3-Next: config `mtp_num_hidden_layers`; `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
  `mtp.fc`, `mtp.layers.{k}.`, `mtp.norm`; the embedding and lm_head are the target's; norm(y) is fed back
  (vLLM's qwen3_next_mtp).

`specbench train mtp` writes the DeepSeek-V3 layout: config.json (the target's, plus num_nextn_predict_layers)
and model.safetensors with the `model.layers.{num_hidden_layers}.` keys.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Cache

from ..core.cached_lm import cache_argument
from ..errors import SpecbenchError
from ..models.decoder import FAMILY as OWNED_FAMILY
from ..models.decoder import Layer, RMSNorm
from ..registry import HeadFamily, head_family
from .checkpoint import check, read_prefixed, save_safetensors
from .folder import HEAD_LAYOUTS, config_shape, read_config


@dataclass(frozen=True)
class MtpLayout:
    name: str
    count_key: str  # config.json key: how many MTP modules the checkpoint has
    prefix_format: str  # where module 0's keys are, formatted with config.json's keys
    renames: tuple[tuple[str, str], ...]  # (checkpoint name after the prefix, ours): first match wins
    others: str  # where a module's other keys come from: a checkpoint prefix of module 0 ("" = everything left)
    normed_output: bool  # the output fed back is norm(y) (Qwen3-Next), not y (DeepSeek-V3)
    zero_first: bool  # the embedding at position 0 is zeroed (DeepSeek-V3 in vLLM)

    def prefix(self, raw: dict) -> str:
        return self.prefix_format.format(**raw)

    def ours(self, key: str) -> str | None:
        """Our name of a checkpoint key (after the prefix); None for another module's key."""
        for theirs, mine in self.renames:
            if key.startswith(theirs):
                return mine + key[len(theirs) :]
        if key.startswith(self.others):
            return "block." + key[len(self.others) :]
        return None if re.match(r"layers\.\d+\.", key) else key  # unknown keys stay, for check() to name

    def theirs(self, key: str) -> str:
        """The checkpoint name (after the prefix) of one of our keys."""
        for theirs, mine in self.renames:
            if key.startswith(mine):
                return theirs + key[len(mine) :]
        return self.others + key.removeprefix("block.")


DEEPSEEK = MtpLayout(
    "DeepSeek-V3",
    "num_nextn_predict_layers",
    "model.layers.{num_hidden_layers}.",
    (
        ("eh_proj.", "fc."),
        ("shared_head.norm.", "norm."),
        ("shared_head.head.", "head."),
        ("enorm.", "enorm."),
        ("hnorm.", "hnorm."),
        ("embed_tokens.", "embed_tokens."),
    ),
    "",
    normed_output=False,
    zero_first=True,
)
QWEN3_NEXT = MtpLayout(
    "Qwen3-Next",
    "mtp_num_hidden_layers",
    "mtp.",
    (("pre_fc_norm_embedding.", "enorm."), ("pre_fc_norm_hidden.", "hnorm."), ("fc.", "fc."), ("norm.", "norm.")),
    "layers.0.",
    normed_output=True,
    zero_first=False,
)
LAYOUTS = (DEEPSEEK, QWEN3_NEXT)


class MtpHead(nn.Module):
    """MTP module 0 around a decoder layer of the target's class; the same calls as the EAGLE heads."""

    def __init__(self, target_model: Any, layout: MtpLayout) -> None:
        super().__init__()
        decoder = target_model.get_decoder()
        config = block_config(target_model.config.get_text_config())
        self.config = config
        self.layout = layout
        vocab, hidden = target_model.get_output_embeddings().weight.shape
        # a Llama-family block and its norms are the owned decoder's (checkpoint names); other blocks (DeepSeek-V3's
        # attention and experts, Qwen3-Next's) and norms (Qwen3-Next's scales by 1 + weight) are the target's classes
        owned = getattr(config, "model_type", None) in OWNED_FAMILY
        norm = RMSNorm.build if owned else type(decoder.norm)
        self.feature_size = hidden  # the target's final normalised state
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.enorm = norm(hidden, config.rms_norm_eps)
        self.hnorm = norm(hidden, config.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = Layer.build(config, 0) if owned else type(decoder.layers[0])(config, 0)
        # looked up once: torch.compile warns at a cached call
        self.cache_keyword = cache_argument(type(self.block))  # type: ignore[arg-type]  # a class is hashable
        self.norm = norm(hidden, config.rms_norm_eps)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.rotary = type(decoder.rotary_emb)(config=config)

    def forward(
        self,
        features: torch.Tensor,  # [B, n, H]: the target's final states, or the module's own outputs
        tokens: torch.Tensor,  # [B, n]: the token after each feature's position
        positions: torch.Tensor,  # [B, n]
        mask: torch.Tensor | None = None,  # additive [B, 1, n, past + n]; None = causal without a cache
        cache: Cache | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin at `positions`, when the caller has them
    ) -> torch.Tensor:
        """The module's outputs [B, n, H], fed back as the next step's features and read by `logits`."""
        embedded = self.embed_tokens(tokens)
        if self.layout.zero_first:
            embedded = embedded.masked_fill((positions == 0)[..., None], 0)
        x = self.fc(torch.cat([self.enorm(embedded), self.hnorm(features.to(self.fc.weight.dtype))], dim=-1))
        rope = self.rotary(x, positions) if rope is None else rope
        if isinstance(self.block, Layer):
            x = self.block(x, rope, mask, cache)
        else:
            x = self.block(
                hidden_states=x,
                attention_mask=mask,
                position_ids=positions,
                use_cache=cache is not None,
                **{self.cache_keyword: cache},
                position_embeddings=rope,
            )
        return self.norm(x) if self.layout.normed_output else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] about the token after the next."""
        return self.head(hidden if self.layout.normed_output else self.norm(hidden))


def block_config(text_config):
    """The target's config for a lone MTP layer: one full-attention layer with the MLP of the target's deepest
    layer, a MoE wherever those are (DeepSeek-V3's first_k_dense_replace counts from the bottom; GLM-4.7-Flash's
    mlp_layer_types lists "dense" or "sparse" per layer)."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"]
    if getattr(config, "first_k_dense_replace", None) is not None:
        config.first_k_dense_replace = 0
    if getattr(config, "mlp_layer_types", None) is not None:
        config.mlp_layer_types = config.mlp_layer_types[-1:]
    config._attn_implementation = "sdpa"
    return config


def layout_of(raw: dict, what: str) -> MtpLayout:
    for layout in LAYOUTS:
        count = raw.get(layout.count_key)
        if count is not None:
            if not isinstance(count, int) or count < 1:
                raise SpecbenchError(f"{what}: config.json says {layout.count_key} = {count}: no MTP module")
            return layout
    keys = " or ".join(f"{layout.count_key} ({layout.name})" for layout in LAYOUTS)
    raise SpecbenchError(f"{what}: config.json has no {keys}: not a model with MTP modules")


def fuse_experts(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Routed experts stored one by one (`mlp.experts.{e}.gate_proj.weight`, ...) stacked into the fused
    tensors transformers' MoE blocks hold: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I]."""
    stored = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, value in state.items():
        match = stored.match(key)
        if match and f"{match[1]}.gate_up_proj" in expected:
            groups.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = value
        else:
            out[key] = value
    for base, parts in groups.items():
        count = len(parts.get("down", {}))
        if any(sorted(parts.get(p, {})) != list(range(count)) for p in ("gate", "up", "down")):
            raise SpecbenchError(f"the routed experts under '{base}' are incomplete in the checkpoint")
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(count)])
        out[f"{base}.down_proj"] = torch.stack([parts["down"][e] for e in range(count)])
    return out


def load(source: str | Path, target_model: Any) -> MtpHead:
    """MTP module 0 of a checkpoint in either layout; a missing embedding or readout is the target's."""
    what = f"MTP module of '{source}'"
    raw = read_config(source, "MTP checkpoint")
    layout = layout_of(raw, what)
    vocab, hidden = target_model.get_output_embeddings().weight.shape
    if (raw.get("hidden_size"), raw.get("vocab_size")) != (hidden, vocab):
        raise SpecbenchError(
            f"{what} is for hidden size {raw.get('hidden_size')} and vocabulary {raw.get('vocab_size')}, the target "
            f"has {hidden} and {vocab}: use the target's own checkpoint or an MTP module trained for it"
        )
    stored = read_prefixed(source, layout.prefix(raw), what)
    if any(k.endswith("weight_scale_inv") for k in stored):
        raise SpecbenchError(f"{what} is FP8 block-quantised (weight_scale_inv): use a bfloat16 copy of the checkpoint")
    head = MtpHead(target_model, layout)
    expected = {k: v.shape for k, v in head.state_dict().items()}
    state = {}
    for key, value in stored.items():
        name = layout.ours(key)
        if name is not None:
            state[name] = value
    state = fuse_experts(state, set(expected))
    state.setdefault("embed_tokens.weight", target_model.get_input_embeddings().weight.detach().cpu())
    state.setdefault("head.weight", target_model.get_output_embeddings().weight.detach().cpu())
    check(expected, state, what)
    head.load_state_dict(state)
    return head


def save(head: MtpHead, target_config, out: Path, half: bool = False, with_shared: bool = True) -> None:
    """The DeepSeek-V3 layout: the target's config.json plus num_nextn_predict_layers = 1, and module 0's keys
    under model.layers.{num_hidden_layers}. `with_shared` False leaves out the embedding and readout (the
    loader takes the target's)."""
    raw = {**target_config.to_dict(), DEEPSEEK.count_key: 1}
    prefix = DEEPSEEK.prefix(raw)
    state = {
        prefix + DEEPSEEK.theirs(k): v
        for k, v in head.state_dict().items()
        if with_shared or k not in ("embed_tokens.weight", "head.weight")
    }
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, out / "model.safetensors", half)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def fits(folder: Path) -> tuple[int, int | None]:
    """The hidden size and vocabulary of the model whose MTP module this is."""
    return config_shape(folder, "MTP checkpoint", ("hidden_size",))


FAMILY = head_family(HeadFamily("mtp", "MTP", HEAD_LAYOUTS["mtp"], load, fits))
