"""vLLM's `speculators` format for EAGLE-3 heads, read and written, so that a head trained here is served by vLLM
and one published that way (RedHatAI's) runs in our loop.

A speculators checkpoint is config.json with `speculators_model_type`, the decoder layer's own config under
`transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` (the target states fused, numbered as hidden_states: 0 the embedding) and a
`speculators_config` (algorithm, proposal methods, verifier), beside model.safetensors whose layer is
`layers.0.*` where the official EAGLE-3 layout has `midlayer.*`; d2t, t2d, fc, norm, lm_head and an optional
embed_tokens keep their names. Tensors pass through unchanged both ways, so a round trip is byte-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpecbenchError
from ..models import aliases, hub
from .checkpoint import save_safetensors

FORMAT_VERSION = "0.9.0"  # the speculators release whose config classes the written files were checked against
LAYER, MIDLAYER = "layers.0.", "midlayer."
# the official head config's keys that are the decoder layer's (the rest describe the head around it)
HEAD_KEYS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids")
DROPPED = ("architectures", "torch_dtype", "dtype", "transformers_version", "speculators_version")
# the flags of EAGLE-3 variants our head does not implement (each a norm the official layout lacks)
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def is_speculators(raw: dict) -> bool:
    return "speculators_model_type" in raw


def official_config(raw: dict, what: str) -> dict:
    """The official EAGLE-3 config.json a speculators eagle3 config describes (the decoder layer's keys plus the
    head's); a variant our head does not implement is one error line."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise SpecbenchError(
            f"{what} is a speculators '{kind}' checkpoint: only eagle3 ones load as EAGLE-3 heads "
            "(a 'dflash' one: convert it to z-lab's layout with speculators' converter)"
        )
    flags = [f for f in UNSUPPORTED_FLAGS if raw.get(f)]
    if flags:
        raise SpecbenchError(f"{what} sets {flags[0]}: an EAGLE-3 variant this suite does not implement")
    layer = dict(raw.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama" or layer.get("num_hidden_layers", 1) != 1:
        raise SpecbenchError(
            f"{what}: its transformer_layer_config is {layer.get('num_hidden_layers', 1)} "
            f"{layer.get('model_type')} layer(s); an EAGLE-3 head here is one Llama decoder layer"
        )
    if "draft_vocab_size" not in raw:
        raise SpecbenchError(f"{what}: config.json has no draft_vocab_size")
    config = {k: v for k, v in layer.items() if k not in DROPPED}
    config.update({k: raw[k] for k in HEAD_KEYS if raw.get(k) is not None})
    config["norm_before_residual"] = bool(raw.get("norm_before_residual", False))  # speculators' default
    return {"architectures": ["LlamaForCausalLMEagle3"], **config}


def speculators_config(raw: dict, verifier: dict | None, layers: list[int] | None, speculative_tokens: int) -> dict:
    """The speculators eagle3 config.json of an official EAGLE-3 config; `verifier`: the target's
    {"name_or_path", "architectures", ...} and `layers` the target states fused (None: unknown, vLLM then fuses its
    default ones)."""
    layer = {k: v for k, v in raw.items() if k not in (*HEAD_KEYS, *DROPPED, "qkv_bias", "bias")}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    layer.setdefault("attention_bias", bool(raw.get("qkv_bias", False)))
    layers = raw.get("eagle_aux_hidden_state_layer_ids", layers)
    target = {"name_or_path": None, "architectures": []} if verifier is None else verifier
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": raw["draft_vocab_size"],
        "norm_before_residual": bool(raw.get("norm_before_residual", False)),  # explicit: vLLM's default may differ
        "target_hidden_size": raw.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": layers,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target["name_or_path"], "architectures": list(target["architectures"])},
        },
    }


def renamed(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """The same tensors with the prefix `old` of their keys replaced by `new`."""
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}


def official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A speculators head's tensors under the official names (its verifier copies, if any were saved, dropped)."""
    return renamed({k: v for k, v in state.items() if not k.startswith("verifier_")}, LAYER, MIDLAYER)


def verifier_of(target: str | None) -> dict | None:
    """What the speculators config records of a target (an alias, folder or hub id), read from its config.json."""
    if target is None:
        return None
    spec = aliases.resolve(target)
    config = json.loads(hub.fetch_file(aliases.target_checkpoint(spec), "config.json").read_text())  # (no weights)
    text = config.get("text_config", config)
    return {
        "name_or_path": spec.target.id,
        "architectures": config.get("architectures") or [],
        "num_hidden_layers": text["num_hidden_layers"],
    }


def save(
    state: dict[str, torch.Tensor],
    raw: dict,
    out: Path,
    verifier: dict | None,
    layers: list[int] | None,
    half: bool = False,
) -> None:
    """An official EAGLE-3 head's tensors and config.json written in the speculators format."""
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(renamed(state, MIDLAYER, LAYER), out / "model.safetensors", half)
    config = speculators_config(raw, verifier, layers, speculative_tokens=8)  # (the eagle3 preset's chain in vLLM)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
