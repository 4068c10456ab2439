"""The EAGLE-1/2 draft head: fc over [embedding, target feature] (2H -> H), Llama decoder layer(s) whose
first has no input norm, and the target's lm_head on the output (the predicted next feature).

Checkpoint: config.json (Llama keys, optional "bias" for fc.bias, default true) plus `pytorch_model.bin` or
`model.safetensors` with exactly embed_tokens.weight (optional: copied from the target), fc.weight,
fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight and
layers.0.post_attention_layernorm.weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..errors import SpecbenchError
from ..models.decoder import KeysAndValues, Layer
from ..registry import HeadFamily, head_family
from .checkpoint import check, read_weights, save_safetensors
from .folder import EAGLE_FILES as FILES
from .folder import HEAD_LAYOUTS, config_shape, read_config

CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
)


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig, bias: bool = True) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.feature_size = hidden  # the target's final normalised state
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        # the owned decoder's layers (checkpoint names); the fused input is not normalised (EAGLE's layout)
        self.layers = nn.ModuleList(Layer.build(config, i, input_norm=i > 0) for i in range(config.num_hidden_layers))
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(
        self,
        features: torch.Tensor,  # [B, n, H]: the target's (or the draft's own predicted) features
        tokens: torch.Tensor,  # [B, n]: the token after each feature's position
        positions: torch.Tensor,  # [B, n]
        mask: torch.Tensor | None = None,  # additive [B, 1, n, past + n]; None = causal without a cache
        cache: KeysAndValues | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin at `positions`, when the caller has them
    ) -> torch.Tensor:
        """Predicted features [B, n, H] of the next positions (logits = the target's lm_head of them)."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), features.to(self.fc.weight.dtype)], dim=-1))
        rope = self.rotary(x, positions) if rope is None else rope
        for layer in self.layers:
            x = layer(x, rope, mask, cache)
        return x


def config_from_target(target_config) -> dict:
    """A one-layer head config matching a Llama-like target (what `specbench train eagle` writes)."""
    text = target_config.get_text_config()
    config = {k: getattr(text, k) for k in CONFIG_KEYS if getattr(text, k, None) is not None}
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config["num_hidden_layers"] = 1  # no "bias" key: fc.bias present, as in the official Vicuna heads (vLLM reads
    # a "bias": true as attention biases the head lacks, and then accepts nothing)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config}


def load(source: str | Path, target_model: Any) -> EagleHead:
    """An official-layout head; a missing embed_tokens is copied from the target."""
    what = f"EAGLE head '{source}'"
    raw = read_config(source, "EAGLE head")
    head = build(raw)
    vocab, hidden = target_model.get_output_embeddings().weight.shape
    if (vocab, hidden) != (head.config.vocab_size, head.config.hidden_size):
        raise SpecbenchError(
            f"{what} is for hidden size {head.config.hidden_size} and vocabulary {head.config.vocab_size}, the "
            f"target has {hidden} and {vocab}: use a head trained for this target"
        )
    state = read_weights(source, FILES, "EAGLE head")
    if "fc.fc.weight" in state:
        raise SpecbenchError(
            f"{what} is a GRIFFIN head (key 'fc.fc.weight': a token-guided fusion block in place of EAGLE's fc, and a "
            f"layer 2H wide): GRIFFIN heads are not supported; HASS heads load as EAGLE-1/2 heads"
        )
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = target_model.get_input_embeddings().weight.detach().cpu()
    check({k: v.shape for k, v in head.state_dict().items()}, state, what)
    head.load_state_dict(state)
    return head


def llama_config(raw: dict, what: str) -> LlamaConfig:
    """The Llama config of an EAGLE head's config.json; "qkv_bias" is EAGLE's name for attention_bias."""
    keys = {k: v for k, v in raw.items() if k not in ("architectures", "bias", "torch_dtype", "transformers_version")}
    keys.setdefault("attention_bias", bool(raw.get("qkv_bias", False)))
    try:
        return LlamaConfig(**keys)
    except (TypeError, ValueError, KeyError) as err:
        raise SpecbenchError(f"{what} config.json is not a Llama config: {err}") from err


def build(raw: dict) -> EagleHead:
    """The head a config.json describes (random weights)."""
    if "draft_vocab_size" in raw:
        raise SpecbenchError("this is an EAGLE-3 head (its config has draft_vocab_size): use the eagle3 method")
    return EagleHead(llama_config(raw, "EAGLE head"), bias=bool(raw.get("bias", True)))


def save(state: dict[str, torch.Tensor], raw_config: dict, out: Path, half: bool = False) -> None:
    """The official layout: config.json + model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, out / "model.safetensors", half)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")


def fits(folder: Path) -> tuple[int, int | None]:
    """The target hidden size and vocabulary the head's config is for (it drafts the target's own features)."""
    return config_shape(folder, "EAGLE head", ("hidden_size",))


FAMILY = head_family(HeadFamily("eagle", "EAGLE-1/2", HEAD_LAYOUTS["eagle"], load, fits))
