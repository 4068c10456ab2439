"""PARD-2 drafters (AMD, arXiv 2605.08632; AMD-AGI/PARD `pard/pard2_infer.py`, `pard/pard2_train.py`): a PARD drafter
(`heads.pard`: k - 1 mask tokens after the committed ones, one forward guesses k tokens) whose input embeddings add
the target's hidden states, projected: row p reads embed(x_p) + scale * target_proj(h_{p-1}), h the target's states
at `pard2_target_layers` side by side (h_{-1} = 0), and a mask row the last real row's. Training zeroes a sequence's
projected states at random (`target_feat_mask`), so one checkpoint drafts with or without them.

Checkpoint (`pard2_train.py`'s `_convert_checkpoint_for_infer_impl` and `prepare_pard2_infer_config`): a causal LM
folder whose config.json has `pard2: true` (or `spd_type: "pard2"`), `pard2_scale`, `pard2_proj_bias`,
`pard2_target_dim`, `pard2_target_layers` (indices into transformers' hidden_states: 0 the embeddings, -1 the final
normalised state) and `pard_token`, beside `warp_model.bin` holding `target_proj.weight` (and `target_proj.bias`).
A compact checkpoint (the bundled tiny one) leaves out the embedding, which is then the target's.

The drafter runs on the owned decoder in both regimes (`Pard2Draft`, as BatchedLM calls a Decoder): the projected
states of each slot's rows wait in `table`, by position, and each forward adds its rows' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import SpecbenchError
from ..registry import HeadFamily, head_family
from .checkpoint import read_prefixed, read_weights, save_safetensors
from .folder import HEAD_LAYOUTS, read_config
from .pard import pard_token

if TYPE_CHECKING:
    from ..models.decoder import Decoder

TITLE = "PARD-2 drafter"
WARP = ("warp_model.bin",)  # target_proj's tensors (pard2_infer.py's `_resolve_warp_bin`)
SCALE = 0.02  # the projected states' factor when config.json names none (pard2_infer.py's default)
MULTI_LAYERS = (-1, -8, -16, -24)  # the official trainer's target layers (example_pard2_qwen3.yaml); [-1] alone
# for a target of fewer than 24 layers


def is_pard2(raw: dict) -> bool:
    return raw.get("pard2") is True or raw.get("spd_type") == "pard2"


def official_layers(num_layers: int) -> list[int]:
    """The target layers a new drafter reads: the official multi-layer set, or the final state alone for a target
    too shallow for it."""
    return list(MULTI_LAYERS) if num_layers >= 24 else [-1]


def our_layers(layers: list[int], num_layers: int, what: str) -> tuple[int, ...]:
    """transformers' hidden_states indices (num_layers + 1 of them, -1 the final normalised state) as CachedLM.run's
    `layers` (i the output of layer i, -1 the final normalised state)."""
    out = []
    for i in layers:
        if not isinstance(i, int) or isinstance(i, bool) or not -(num_layers + 1) <= i <= num_layers:
            raise SpecbenchError(
                f"{what} reads target layer {i!r}, the target's hidden states are 0..{num_layers} (or -1 back): "
                "use a drafter trained for this target"
            )
        out.append(-1 if i in (-1, num_layers) else i % (num_layers + 1))
    return tuple(out)


class Pard2Draft(nn.Module):
    """A PARD-2 drafter on the owned decoder (`models.decoder.Decoder`), called as BatchedLM calls one. `table` [B,
    rows, H], once `reserve`d: scale * target_proj(h_{p-1}) for each slot's row p, added to the rows a forward
    reads at their positions (None: drafting without the target's states)."""

    def __init__(
        self, decoder: Decoder, target_proj: nn.Linear, scale: float, raw: dict, feature_layers: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.decoder: Decoder = decoder
        self.target_proj = target_proj
        self.scale = scale
        self.raw = raw  # config.json
        self.feature_layers = feature_layers
        self.pard_token: int = pard_token(raw)  # type: ignore[assignment]  # (checked at load)
        self.table: torch.Tensor | None = None

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def config(self) -> Any:
        return self.decoder.config

    def get_input_embeddings(self) -> nn.Module:
        return self.decoder.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.decoder.readout

    def reserve(self, batch: int, rows: int) -> None:
        """Room for the projected states of `batch` slots' first `rows` positions (zero until written)."""
        weight = self.target_proj.weight
        self.table = weight.new_zeros(batch, rows, weight.shape[0])

    def projected(self, features: torch.Tensor) -> torch.Tensor:
        """scale * target_proj(features) [..., H] of target states [..., F]."""
        return self.scale * self.target_proj(features.to(self.target_proj.weight.dtype))

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Any,
        features: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over `ids` [B, n] with each row's projected states added: the forward's batch rows are the
        slots, or those the cache writes (`StaticRows.slot`: one, or several [B])."""
        added, table = None, self.table
        if table is not None:  # [B, n, H]
            slot = getattr(cache, "slot", None)
            if slot is None:  # every slot's rows
                added = table.gather(1, positions[..., None].expand(-1, -1, table.shape[-1]))
            elif isinstance(slot, int):
                added = table[slot][positions]
            else:
                added = table[slot[:, None], positions]
        return self.decoder(ids, positions, mask, cache, features, added)


def settings(raw: dict, target_model: Any, what: str) -> tuple[float, bool, list[int], tuple[int, ...]]:
    """(scale, proj_bias, the official target layers, ours) of a PARD-2 config.json, checked against the target
    (the keys and fallbacks of pard2_train.py's `prepare_pard2_infer_config`)."""
    if not is_pard2(raw):
        raise SpecbenchError(
            f"{what}: config.json has neither pard2: true nor spd_type: pard2 (a PARD drafter loads as `pard`)"
        )
    if pard_token(raw) is None:
        raise SpecbenchError(f"{what}: config.json has no pard_token (the mask token id)")
    layers = raw.get("pard2_target_layers", raw.get("target_layers"))
    if not isinstance(layers, list) or not layers:
        raise SpecbenchError(f"{what}: config.json has no pard2_target_layers (the target states it reads)")
    text = target_model.config.get_text_config()
    ours = our_layers(layers, text.num_hidden_layers, what)
    dim = raw.get("pard2_target_dim", raw.get("pard_target_dim", 4096))
    if dim != text.hidden_size * len(layers):
        raise SpecbenchError(
            f"{what} reads {dim} target features, the target gives {text.hidden_size} a layer x {len(layers)} layers: "
            "use a drafter trained for this target"
        )
    scale = raw.get("pard2_scale", raw.get("feat_scale", raw.get("pard_scale", SCALE)))
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise SpecbenchError(f"{what}: config.json's pard2_scale is not a number: {scale!r}")
    return float(scale), bool(raw.get("pard2_proj_bias", raw.get("proj_bias", False))), layers, ours


def load(source: str | Path, target_model: Any) -> Pard2Draft:
    """The official layout (or a compact one without the embedding), checked against the target, on the owned
    decoder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.decoder import Decoder, unsupported

    what = f"{TITLE} '{source}'"
    raw = read_config(source, TITLE)
    scale, bias, layers, ours = settings(raw, target_model, what)
    config = AutoConfig.from_pretrained(str(source))
    model = AutoModelForCausalLM.from_config(config)
    why = unsupported(model)
    if why is not None:
        raise SpecbenchError(f"{what} cannot run on the owned decoder: {why}")
    state = read_prefixed(source, "", what)
    embedding = target_model.get_input_embeddings().weight
    if "model.embed_tokens.weight" not in state:  # compact: the target's
        state["model.embed_tokens.weight"] = embedding.detach().cpu()
    vocab = state["model.embed_tokens.weight"].shape[0]
    if vocab > embedding.shape[0] or pard_token(raw) >= vocab:  # type: ignore[operator]
        raise SpecbenchError(
            f"{what} reads out {vocab} tokens (mask {pard_token(raw)}), the target {embedding.shape[0]}: use a "
            "drafter with the target's tokenizer"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.get_text_config().tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SpecbenchError(f"{what}: its weights do not fit its config.json ({[*missing, *unexpected][:3]} ...)")
    warp = read_weights(source, WARP, what)
    proj = nn.Linear(len(layers) * target_model.config.get_text_config().hidden_size, config.hidden_size, bias=bias)
    wanted = {"target_proj.weight": proj.weight.shape} | ({"target_proj.bias": proj.bias.shape} if bias else {})
    if {k: tuple(v.shape) for k, v in warp.items() if k in wanted} != {k: tuple(s) for k, s in wanted.items()}:
        raise SpecbenchError(f"{what}: warp_model.bin holds no target_proj of shape {tuple(proj.weight.shape)}")
    proj.load_state_dict({k.removeprefix("target_proj."): warp[k] for k in wanted})
    return Pard2Draft(Decoder.adopt(model), proj, scale, raw, ours).eval()


def config_of(base: dict, mask_id: int, scale: float, bias: bool, layers: list[int], target_hidden: int) -> dict:
    """The config.json of a drafter made from the causal LM config `base` (the official converter's keys)."""
    return {
        **base,
        "pard_token": mask_id,
        "pard2": True,
        "spd_type": "pard2",
        "pard2_scale": scale,
        "pard2_proj_bias": bias,
        "pard2_target_dim": target_hidden * len(layers),
        "pard2_target_layers": layers,
    }


def save(model: Any, proj: nn.Linear, raw: dict, out: Path, compact: bool = False) -> None:
    """The official layout: the causal LM `model` (transformers') with config.json `raw`, and warp_model.bin;
    `compact`: float16, without the embedding (the target's)."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not (compact and k == "model.embed_tokens.weight")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_safetensors(state, out / "model.safetensors", half=compact)
    warp = {f"target_proj.{k}": v.detach().cpu().contiguous() for k, v in proj.state_dict().items()}
    torch.save({k: v.half() if compact else v for k, v in warp.items()}, out / WARP[0])
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def fits(folder: Path) -> tuple[int | None, int | None]:
    """The target's width follows from pard2_target_dim and its layers; checked when it loads."""
    return None, None


FAMILY = head_family(HeadFamily("pard2", TITLE, HEAD_LAYOUTS["pard2"], load, fits, static=True))
