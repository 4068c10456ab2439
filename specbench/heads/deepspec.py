"""DeepSpec's EAGLE-3 heads (deepseek-ai/DeepSpec `deepspec/modeling/eagle3/qwen3/{config,modeling}.py`, the matched
EAGLE-3 baselines of its DSpark drafters, `deepseek-ai/eagle3_qwen3_*_ttt7`) in the official EAGLE-3 layout.

`Qwen3Eagle3Model`: config.json is the target's Qwen3 config with `architectures` ["Qwen3Eagle3Model"],
`num_hidden_layers` the draft's layers (`draft_num_hidden_layers`), `num_target_layers`, `target_layer_ids` (five,
DeepSpec's numbering: layer i's output is transformers' hidden_states[i + 1], `common.py`
extract_eagle3_context_feature), `ttt_length`, `step_loss_decay`. Tensors: `embed_tokens`, `fc` (5H -> H, no bias),
`layers.{i}.` Qwen3-style EAGLE-3 layers (`hidden_norm`, `input_layernorm`, `post_attention_layernorm`, `self_attn`
reading [norm(embedding), norm(hidden)] with per-head `q_norm`/`k_norm`, `mlp`), `norm`, and `lm_head` over the whole
vocabulary. Layer 0 is EAGLE-3's own `midlayer`; in a head of several (`Qwen3Eagle3Model.forward`), each later layer
reads the token's embedding again beside the layer before's output (`Eagle3Head`'s `stacked` layers).
"""

from __future__ import annotations

import torch

from ..errors import SpecbenchError

ARCHITECTURE = "Qwen3Eagle3Model"
TRAINING_KEYS = (  # DeepSpec's own, and the target's that describe its layers rather than the head's
    "architectures",
    "target_layer_ids",
    "num_target_layers",
    "ttt_length",
    "step_loss_decay",
    "draft_num_hidden_layers",
    "target_model_name_or_path",
    "layer_types",
    "max_window_layers",
    "use_sliding_window",
    "sliding_window",
    "model_type",
    "_attn_implementation",
)


def is_eagle3(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or [])


def eagle3_official(raw: dict, what: str) -> dict:
    """The official EAGLE-3 config.json of a DeepSpec head: its fused states as `eagle_aux_hidden_state_layer_ids`
    (hidden_states numbering), the whole vocabulary drafted, per-head norms (`qk_norm`)."""
    layers, ids = raw.get("num_hidden_layers"), raw.get("target_layer_ids")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise SpecbenchError(f"{what}: config.json needs num_hidden_layers, the head's layers (1 or more)")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise SpecbenchError(f"{what}: config.json needs target_layer_ids, the target layers it fuses")
    official = {k: v for k, v in raw.items() if k not in TRAINING_KEYS}
    official.update(
        draft_vocab_size=raw.get("vocab_size"),
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids],
        qk_norm=True,
        draft_layers=layers,
        stacked_eagle3_layers=True,  # every layer an EAGLE-3 layer reading the token again (Qwen3Eagle3Model)
    )
    return official


def eagle3_official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSpec's tensor names as the official layout's: its first layer `layers.0.` is `midlayer.` (later ones keep
    their `layers.{i}.`)."""
    return {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in state.items()}
