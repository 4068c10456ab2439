"""Writing a model folder that loads offline with the Auto classes: float16 weights, float32 config."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WEIGHTS = "model.safetensors"


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    """Save `model` (float32 in memory) with float16 weight storage and its tokenizer into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.float().save_pretrained(path)  # the config records dtype float32: from_pretrained upcasts on load
    weights = load_file(path / WEIGHTS)
    half = {name: tensor.half().contiguous() for name, tensor in weights.items()}
    save_file(half, path / WEIGHTS, metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    return path
