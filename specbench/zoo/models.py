"""Building the target and draft Llama models of the family."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specbench.zoo.plan import Shape

MAX_POSITIONS = 4096


def llama_config(shape: Shape, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """A tied-embedding Llama config for `shape` over `tokenizer`'s vocabulary."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
    )


def new_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised float32 model, seeded."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def draft_from_target(target: LlamaForCausalLM, layers: int, seed: int) -> LlamaForCausalLM:
    """A shallower model of the target's width starting from its embeddings, first layers and final norm."""
    config = LlamaConfig.from_dict({**target.config.to_dict(), "num_hidden_layers": layers})
    draft = new_model(config, seed)
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for mine, theirs in zip(draft.model.layers, target.model.layers[:layers], strict=True):
        mine.load_state_dict(theirs.state_dict())
    return draft


def parameter_count(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
