"""vLLM's `speculators` format, read and written for EAGLE-3 and P-EAGLE heads and DFlash, DFlash2 and DSpark drafters,
so that a head trained here is served by vLLM and one published that way (RedHatAI's) runs in our loop. Pure
translations of config.json and tensor names: the tensors themselves pass through unchanged both ways, so a round
trip is byte-identical.

A speculators checkpoint is config.json with `speculators_model_type`, the decoder layers' own config under
`transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`, the target states read (numbered as
hidden_states, 0 the embedding) and a `speculators_config` (algorithm, proposal methods, verifier), beside
model.safetensors.
- eagle3: `norm_before_residual`, `eagle_aux_hidden_state_layer_ids` and EAGLE 3.1's `norm_before_fc`, `fc_norm`,
  `norm_output` (kept in the official config.json we read them into); the first layer under `layers.0.` where the
  official layout has `midlayer.`, the others (`draft_layers` in all) `layers.{i}.` in both; d2t, t2d, fc, norm,
  lm_head, input_norm, fc_norm.{i} and an optional embed_tokens keep their names.
- peagle (P-EAGLE, `models/peagle/{config,core}.py`): eagle3's, plus `mask_token_id` and the tensor `mask_hidden`
  (both kept as they are); its drafts per forward are the proposal method's `speculative_tokens`.
- dflash: `block_size`, `mask_token_id`, `aux_hidden_state_layer_ids` (z-lab's `target_layer_ids` + 1),
  `sample_from_anchor`; the tensors are z-lab's, by the same names (a full-vocabulary drafter stores no readout).
- dflash2 (`models/dflash2/{config,core,model_definitions}.py`): dflash's, with `conv_kernel_size`,
  `conv_group_size`, `selector_rank` and `selector_top_k` at the top level (z-lab's put them in `dflash_config`);
  the tensors (`layers.{i}.{attention,mlp}_conv.*`, `candidate_selector.*`) keep their names.
- dspark (`models/dspark/{config,core}.py`): dflash's, with `sample_from_anchor` true (every row drafts), and
  `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov` as DeepSpec's
  `Qwen3DSparkModel` config names them (its `target_layer_ids` are also the aux ids - 1); the Markov and
  confidence heads' tensors keep DeepSpec's names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SpecbenchError
from ..models import aliases, hub
from .folder import read_config

if TYPE_CHECKING:  # the translations are torch-free: `convert` judges a head with them before torch loads
    import torch

FORMAT_VERSION = "0.9.0"  # the speculators release whose config classes the written files were checked against
LAYER, MIDLAYER = "layers.0.", "midlayer."
# the official head config's keys that are the decoder layer's (the rest describe the head around it)
HEAD_KEYS = (
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
    "mask_token_id",
)
# EAGLE 3.1's options (speculators' eagle3/config.py): a norm before fc over the fused target states, or one per
# target state (their input_norm.weight, fc_norm.{i}.weight), and the normed output fed back; written when set
FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
DROPPED = ("architectures", "torch_dtype", "dtype", "transformers_version", "speculators_version")


def is_speculators(raw: dict) -> bool:
    return "speculators_model_type" in raw


def official(source: str | Path, kind: str, what: str) -> tuple[dict, bool]:
    """A head's config.json in its official layout's keys (a speculators checkpoint's translated: `kind` "eagle3",
    "peagle", "dflash", "dflash2" or "dspark"), and whether it was a speculators one."""
    raw = read_config(str(source), what)
    if not is_speculators(raw):
        return raw, False
    if kind == "dflash":
        return dflash_official(raw, f"{what} '{source}'"), True
    if kind == "dspark":
        return dspark_official(raw, f"{what} '{source}'"), True
    if kind == "dflash2":
        return dflash2_official(raw, f"{what} '{source}'"), True
    return eagle3_official(raw, f"{what} '{source}'", kind), True


def _kind(raw: dict, kind: str, what: str, family: str) -> None:
    found = raw.get("speculators_model_type")
    if found != kind:
        raise SpecbenchError(f"{what} is a speculators '{found}' checkpoint: only {kind} ones load as {family}")


def eagle3_official(raw: dict, what: str, kind: str = "eagle3") -> dict:
    """The official EAGLE-3 config.json a speculators eagle3 (or peagle) config describes (the decoder layers' keys
    plus the head's, EAGLE 3.1's options among them); what our head cannot run is one error line."""
    _kind(raw, kind, what, "P-EAGLE heads" if kind == "peagle" else "EAGLE-3 heads")
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise SpecbenchError(f"{what} sets both norm_before_fc and fc_norm: speculators allows one of them")
    layer = dict(raw.get("transformer_layer_config") or {})
    layers = layer.get("num_hidden_layers", 1)
    layer["num_hidden_layers"] = 1  # (the official layout's, in its place; `draft_layers` says how many)
    if layer.get("model_type", "llama") != "llama":
        raise SpecbenchError(
            f"{what}: its transformer_layer_config is a {layer.get('model_type')} layer; an EAGLE-3 head here has "
            "Llama decoder layers"
        )
    if "draft_vocab_size" not in raw:
        raise SpecbenchError(f"{what}: config.json has no draft_vocab_size")
    if kind == "peagle" and not isinstance(raw.get("mask_token_id"), int):
        raise SpecbenchError(f"{what}: config.json has no mask_token_id (the token P-EAGLE's parallel rows carry)")
    config = {k: v for k, v in layer.items() if k not in DROPPED}
    if layers != 1:
        config["draft_layers"] = layers
    config.update({k: raw[k] for k in HEAD_KEYS if raw.get(k) is not None})
    config.update({k: True for k in FLAGS if raw.get(k)})
    config["norm_before_residual"] = bool(raw.get("norm_before_residual", False))  # speculators' default
    return {"architectures": ["LlamaForCausalLMEagle3"], **config}


def _algorithm(kind: str, speculative_tokens: int, verifier: dict | None) -> dict:
    """The `speculators_config` block: one greedy proposal method, and the verifier (None: not recorded)."""
    target = {"name_or_path": None, "architectures": []} if verifier is None else verifier
    return {
        "algorithm": kind,
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
    }


def eagle3_speculators(
    raw: dict, verifier: dict | None, layers: list[int] | None, kind: str = "eagle3", drafts: int = 8
) -> dict:
    """The speculators eagle3 (or peagle, `kind`) config.json of an official EAGLE-3 config; `verifier`: the
    target's {"name_or_path", "architectures", ...}, `layers` the target states fused (None: unknown, vLLM then
    fuses its default ones) and `drafts` the chain vLLM drafts (the eagle3 preset's 8; P-EAGLE's trained depths)."""
    exclude = (*HEAD_KEYS, *FLAGS, *DROPPED, "qkv_bias", "bias", "draft_layers")
    layer = {k: v for k, v in raw.items() if k not in exclude}
    layer.update(model_type="llama", num_hidden_layers=raw.get("draft_layers", 1), tie_word_embeddings=False)
    layer.setdefault("attention_bias", bool(raw.get("qkv_bias", False)))
    layers = raw.get("eagle_aux_hidden_state_layer_ids", layers)
    peagle = {"mask_token_id": raw["mask_token_id"]} if kind == "peagle" else {}
    return {
        "architectures": ["PEagleSpeculator" if kind == "peagle" else "Eagle3Speculator"],
        "speculators_model_type": kind,
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": raw["draft_vocab_size"],
        "norm_before_residual": bool(raw.get("norm_before_residual", False)),  # explicit: vLLM's default may differ
        "target_hidden_size": raw.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": layers,
        **{k: True for k in FLAGS if raw.get(k)},
        **peagle,
        "speculators_config": _algorithm(kind, drafts, verifier),
    }


def renamed(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """The same tensors with the prefix `old` of their keys replaced by `new`."""
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}


def eagle3_official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A speculators head's tensors under the official names (its verifier copies, if any were saved, dropped)."""
    return renamed({k: v for k, v in state.items() if not k.startswith("verifier_")}, LAYER, MIDLAYER)


def eagle3_speculators_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An official head's tensors under the speculators names."""
    return renamed(state, MIDLAYER, LAYER)


DFLASH_KEYS = ("auto_map", "block_size", "dflash_config", "num_target_layers", "target_layer_ids", "mask_token_id")


def dflash_official(raw: dict, what: str, kind: str = "dflash") -> dict:
    """z-lab's DFlashDraftModel config.json a speculators dflash config describes; what our drafter cannot run (its
    own reduced vocabulary, drafts from the anchor row) is one error line. `kind` "dspark": DSpark's, which drafts
    from the anchor row (`dspark_official` adds its own keys)."""
    _kind(raw, kind, what, {"dspark": "DSpark drafters", "dflash2": "DFlash2 drafters"}.get(kind, "DFlash drafters"))
    layer = {k: v for k, v in (raw.get("transformer_layer_config") or {}).items() if k not in DROPPED}
    if raw.get("draft_vocab_size", layer.get("vocab_size")) != layer.get("vocab_size"):
        raise SpecbenchError(
            f"{what} drafts over a vocabulary of its own ({raw['draft_vocab_size']} of {layer.get('vocab_size')} "
            "tokens): only full-vocabulary drafters run here"
        )
    if bool(raw.get("sample_from_anchor", kind == "dspark")) != (kind == "dspark"):
        raise SpecbenchError(
            f"{what} sets sample_from_anchor {raw.get('sample_from_anchor')}: a {kind} variant this suite does not "
            "implement (DSpark drafts from the anchor row, DFlash after it)"
        )
    aux = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise SpecbenchError(f"{what}: config.json needs aux_hidden_state_layer_ids, target layers from 1 up")
    settings = {"block_size": raw.get("block_size"), "mask_token_id": raw.get("mask_token_id")}
    settings["target_layer_ids"] = [i - 1 for i in aux]  # z-lab reads hidden_states[i + 1]
    return {
        "architectures": ["DFlashDraftModel"],
        **layer,
        "block_size": settings["block_size"],
        "dflash_config": settings,
    }


def dflash_official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A speculators drafter's tensors as z-lab's: its verifier copies and identity vocabulary maps dropped."""
    return {k: v for k, v in state.items() if not k.startswith("verifier_") and k not in ("d2t", "t2d")}


def dflash_speculators(raw: dict, verifier: dict | None) -> dict:
    """The speculators dflash config.json of z-lab's DFlashDraftModel config (ours: `dflash.config_for`)."""
    settings = raw.get("dflash_config") or {}
    block = settings.get("block_size", raw.get("block_size", 16))
    layer_ids = settings.get("target_layer_ids", raw.get("target_layer_ids"))
    assert layer_ids is not None  # a DFlash config names them
    layer = {k: v for k, v in raw.items() if k not in (*DROPPED, *DFLASH_KEYS)}
    layer.setdefault("model_type", "qwen3")
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": layer["vocab_size"],
        "block_size": block,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],
        "mask_token_id": settings.get("mask_token_id", raw.get("mask_token_id")),
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": _algorithm("dflash", block - 1, verifier),
    }


DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # (top level there)


def dflash2_official(raw: dict, what: str) -> dict:
    """z-lab's DFlash2DraftModel config.json a speculators dflash2 config describes: dflash's, its convolution's and
    selector's keys moved into `dflash_config`."""
    official = dflash_official(raw, what, "dflash2")
    official["architectures"] = ["DFlash2DraftModel"]
    official["dflash_config"].update({k: raw[k] for k in DFLASH2_KEYS if k in raw})
    return official


def dflash2_speculators(raw: dict, verifier: dict | None) -> dict:
    """The speculators dflash2 config.json of z-lab's DFlash2DraftModel config (ours: `dflash2.config_for`)."""
    settings = dict(raw.get("dflash_config") or {})
    extra = {k: settings.pop(k) for k in DFLASH2_KEYS if k in settings}
    out = dflash_speculators({**raw, "dflash_config": settings}, verifier)
    return {
        **out,
        "architectures": ["DFlash2DraftModel"],
        "speculators_model_type": "dflash2",
        **extra,
        "speculators_config": _algorithm("dflash2", out["block_size"] - 1, verifier),
    }


DSPARK_KEYS = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "confidence_temperatures",  # (ours: `specbench calibrate`, kept both ways)
    "confidence_calibration",
)


def dspark_official(raw: dict, what: str) -> dict:
    """DeepSpec's Qwen3DSparkModel config.json a speculators dspark config describes."""
    settings = dflash_official(raw, what, "dspark")
    flat = settings.pop("dflash_config")
    return {
        **settings,
        "architectures": ["Qwen3DSparkModel"],
        "mask_token_id": flat["mask_token_id"],
        "target_layer_ids": flat["target_layer_ids"],
        **{k: raw[k] for k in DSPARK_KEYS if k in raw},
    }


def dspark_speculators(raw: dict, verifier: dict | None) -> dict:
    """The speculators dspark config.json of DeepSpec's Qwen3DSparkModel config (ours: `train.dspark_config`)."""
    settings = {k: raw[k] for k in ("block_size", "mask_token_id", "target_layer_ids") if k in raw}
    official = {k: v for k, v in raw.items() if k not in (*DSPARK_KEYS, "architectures")}
    out = dflash_speculators({**official, "dflash_config": settings}, verifier)
    block = out["block_size"]
    return {
        **out,
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "sample_from_anchor": True,
        **{k: raw[k] for k in DSPARK_KEYS if k in raw},
        "speculators_config": _algorithm("dspark", block, verifier),
    }


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


def write(config: dict, state: dict[str, torch.Tensor], out: Path, half: bool = False) -> None:
    """A checkpoint folder: config.json and model.safetensors."""
    from .checkpoint import save_safetensors  # imports torch: only to write

    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, out / "model.safetensors", half)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_eagle3(
    state: dict[str, torch.Tensor],
    raw: dict,
    out: Path,
    verifier: dict | None,
    layers: list[int] | None,
    half: bool = False,
    kind: str = "eagle3",
    drafts: int = 8,
) -> None:
    """An official EAGLE-3 (or P-EAGLE) head's tensors and config.json written in the speculators format."""
    write(eagle3_speculators(raw, verifier, layers, kind, drafts), eagle3_speculators_state(state), out, half)
