"""The EAGLE-3 draft head: three of the target's unnormalised hidden states fused by fc (3H -> H), one decoder
layer whose attention reads [norm(embedding), norm(hidden)] (2H wide, residual = the hidden), its own final
norm and an lm_head over a reduced draft vocabulary; draft id i is target id i + d2t[i]. A speculators head may
stack more Llama layers after that one (config `draft_layers` here; their tensors `layers.{i}.`, i >= 1). DeepSpec's
heads fuse five states and add per-head q/k norms (`heads.deepspec`).

Checkpoint (official layout): config.json (Llama keys plus draft_vocab_size and an optional
target_hidden_size; without rope_theta the layer uses RoPE base 10000) and `pytorch_model.bin` or
`model.safetensors` with exactly fc.weight, midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight,
d2t [draft vocab] and t2d [vocab] (both dropped when the draft vocabulary is the whole vocabulary) and
embed_tokens.weight optionally (the official heads have none: the target's is copied).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..errors import SpecbenchError
from ..models.decoder import MLP, Attention, KeysAndValues, Layer, RMSNorm
from ..registry import HeadFamily, head_family
from . import deepspec, eagle, speculators
from .checkpoint import check, read_weights


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target states EAGLE-3 fuses, low -> mid -> high (numbered as in CachedLM.run: i = layer i's output)."""
    if num_layers < 5:
        raise SpecbenchError(
            f"EAGLE-3 reads the target's hidden states 2, L//2 and L-3, so it needs >= 5 layers; the target has "
            f"{num_layers}"
        )
    return 2, num_layers // 2, num_layers - 3


def vocabulary_maps(used: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the ascending target ids `used` [V_draft]: d2t[i] = used[i] - i, t2d[j] = j in used."""
    t2d = torch.zeros(vocab, dtype=torch.bool, device=used.device)
    t2d[used] = True
    return used - torch.arange(len(used), device=used.device), t2d


class Eagle3Layer(nn.Module):
    """The draft's one decoder layer, on the owned decoder's modules (`models.decoder`; the checkpoint's names, its
    layout: `Joined`); its attention sees the token and the hidden state side by side. `index`: its place in a stack
    of them (DeepSpec's heads of several layers: each one reads the token again)."""

    def __init__(self, config: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        # the attention's residual: the hidden state as it came (EAGLE-3's), or normalised (a speculators option)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.hidden_norm = RMSNorm.build(hidden, eps)
        self.input_layernorm = RMSNorm.build(hidden, eps)
        self.self_attn = Attention.build(config, index, width=2 * hidden)  # 2H in: [norm(embedding), norm(hidden)]
        self.post_attention_layernorm = RMSNorm.build(hidden, eps)
        self.mlp = MLP.build(hidden, config.intermediate_size)

    def forward(
        self,
        embedded: torch.Tensor,  # [B, n, H]
        hidden: torch.Tensor,  # [B, n, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KeysAndValues | None,
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embedded), normed], dim=-1)  # [B, n, 2H]
        hidden = normed if self.norm_before_residual else hidden
        hidden = hidden + self.self_attn(x, rope, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        hidden, vocab, draft_vocab = config.hidden_size, config.vocab_size, config.draft_vocab_size
        aux = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
        self.layer_ids = None if aux is None else tuple(aux)  # the target states fused; None: `feature_layers`'s
        self.fused = 3 if aux is None else len(aux)  # (three but in DeepSpec's heads: five)
        self.feature_size = self.fused * (getattr(config, "target_hidden_size", None) or hidden)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        # EAGLE 3.1's options (speculators' `eagle3/core.py`): one norm over the fused target states before fc
        # (`norm_before_fc`), or one per target state (`fc_norm`); `norm_output` feeds back the normed output
        part, eps = self.feature_size // self.fused, config.rms_norm_eps
        self.input_norm = RMSNorm.build(self.feature_size, eps) if getattr(config, "norm_before_fc", False) else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm.build(part, eps) for _ in range(self.fused))
            if getattr(config, "fc_norm", False)
            else None
        )
        self.norm_output = bool(getattr(config, "norm_output", False))
        self.fc = nn.Linear(self.feature_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        # the layers after it, by their checkpoint index (`layers.1.` ...): none in EAGLE-3's own heads; Llama layers
        # (a speculators head's), or EAGLE-3 layers that read the token again (`stacked`: a DeepSpec head's)
        self.stacked = bool(getattr(config, "stacked_eagle3_layers", False))
        later = range(1, config.num_hidden_layers)
        self.layers = nn.ModuleDict(
            {str(i): Eagle3Layer(config, i) if self.stacked else Layer.build(config, i) for i in later}
        )
        self.norm = RMSNorm.build(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        d2t, t2d = vocabulary_maps(torch.arange(draft_vocab), vocab) if draft_vocab != vocab else (None, None)
        self.register_buffer("d2t", d2t)  # [V_draft] long
        self.register_buffer("t2d", t2d)  # [V] bool
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(
        self,
        features: torch.Tensor,  # [B, n, 3H_target]: fused target states, or [B, n, H]: the draft's own outputs
        tokens: torch.Tensor,  # [B, n]: the token after each feature's position
        positions: torch.Tensor,  # [B, n]
        mask: torch.Tensor | None = None,  # additive [B, 1, n, past + n]; None = causal without a cache
        cache: KeysAndValues | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin at `positions`, when the caller has them
    ) -> torch.Tensor:
        """Hidden states [B, n, H] (after the final norm with `norm_output`, else before it): fed back as the next
        step's hidden, read by `logits`."""
        hidden = features.to(self.fc.weight.dtype)
        if hidden.shape[-1] != self.config.hidden_size:  # fc fuses target features only, as in EAGLE-3
            if self.input_norm is not None:
                hidden = self.input_norm(hidden)
            if self.fc_norm is not None:
                parts = hidden.chunk(self.fused, -1)
                hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts, strict=True)], -1)
            hidden = self.fc(hidden)
        rope = self.rotary(hidden, positions) if rope is None else rope
        embedded = self.embed_tokens(tokens)
        out = self.midlayer(embedded, hidden, rope, mask, cache)
        for layer in self.layers.values():
            out = layer(embedded, out, rope, mask, cache) if self.stacked else layer(out, rope, mask, cache)
        return self.norm(out) if self.norm_output else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [..., V_draft] over the draft vocabulary."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def restrict(self, keep: torch.Tensor) -> None:
        """Read out only the draft ids `keep` (ascending) from now on, renumbered 0.. in that order (FR-Spec's
        shortlist of the draft vocabulary, for inference): the lm_head keeps their rows, d2t and t2d follow."""
        used = self.target_ids(keep)
        self.lm_head.weight = nn.Parameter(self.lm_head.weight[keep], requires_grad=False)
        self.lm_head.out_features = len(keep)
        self.d2t, self.t2d = vocabulary_maps(used, self.config.vocab_size)


H = TypeVar("H", bound=Eagle3Head)


def config_of(raw: dict, title: str) -> LlamaConfig:
    """The head's Llama config: one midlayer, as the reference builds (a copied num_hidden_layers is not read), or
    `draft_layers` of them (a speculators head's layer count)."""
    if "draft_vocab_size" not in raw:
        raise SpecbenchError(f"{title} config.json has no draft_vocab_size: an EAGLE-1/2 head? use eagle or eagle2")
    if not 0 < raw["draft_vocab_size"] <= raw.get("vocab_size", 0):
        raise SpecbenchError(f"{title} config.json: draft_vocab_size must be between 1 and vocab_size")
    layers = raw.get("draft_layers", 1)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise SpecbenchError(f"{title} config.json: draft_layers must be a whole number of layers, 1 or more")
    return eagle.llama_config({**raw, "num_hidden_layers": layers}, title)


def build(raw: dict) -> Eagle3Head:
    """The head a config.json describes (random weights)."""
    return Eagle3Head(config_of(raw, "EAGLE-3 head"))


def load(source: str | Path, target_model: Any) -> Eagle3Head:
    """An official-layout, speculators or DeepSpec head (`filled`)."""
    raw, shipped_as_speculators = speculators.official(source, "eagle3", "EAGLE-3 head")
    if deepspec.is_eagle3(raw):
        raw = deepspec.eagle3_official(raw, f"EAGLE-3 head '{source}'")
        return filled(build(raw), source, target_model, "EAGLE-3 head", deepspec.eagle3_official_state)
    renamed = speculators.eagle3_official_state if shipped_as_speculators else None
    return filled(build(raw), source, target_model, "EAGLE-3 head", renamed)


def filled(
    head: H,
    source: str | Path,
    target_model: Any,
    title: str,
    renamed: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
) -> H:
    """`head` with the weights of `source` for `target_model` (their names first `renamed` to the official layout's
    when it was shipped in another); d2t/t2d are ignored for a full draft vocabulary, a missing embedding is the
    target's."""
    what = f"{title} '{source}'"
    vocab, target_hidden = target_model.get_output_embeddings().weight.shape
    if (vocab, head.fused * target_hidden) != (head.config.vocab_size, head.feature_size):
        raise SpecbenchError(
            f"{what} is for target hidden size {head.feature_size // head.fused} and vocabulary "
            f"{head.config.vocab_size}, the target has {target_hidden} and {vocab}: use a head trained for this target"
        )
    state = read_weights(source, eagle.FILES, title)
    if renamed is not None:
        state = renamed(state)
    layers = target_model.config.get_text_config().num_hidden_layers
    if head.layer_ids is not None and not all(0 <= i <= layers for i in head.layer_ids):
        raise SpecbenchError(
            f"{what} fuses target states {list(head.layer_ids)}, the target has {layers} layers: use a head trained "
            "for this target"
        )
    if head.d2t is None:  # identity maps (the Vicuna-13B head stores d2t = 0)
        state.pop("d2t", None)
        state.pop("t2d", None)
    if "embed_tokens.weight" not in state:
        embedding = target_model.get_input_embeddings().weight
        if embedding.shape[1] != head.config.hidden_size:
            raise SpecbenchError(
                f"{what} has no embed_tokens and hidden size {head.config.hidden_size}, but the target's embedding is "
                f"{embedding.shape[1]} wide: the head must ship its own embedding"
            )
        state["embed_tokens.weight"] = embedding.detach().cpu()
    if head.input_norm is not None and "input_norm.weight" not in state:  # (speculators may leave it out: its init)
        state["input_norm.weight"] = torch.ones(head.feature_size)
    check({k: v.shape for k, v in head.state_dict().items()}, state, what)
    if head.d2t is not None:
        mapped = torch.arange(len(state["d2t"])) + state["d2t"]
        if mapped.min() < 0 or mapped.max() >= vocab:
            raise SpecbenchError(f"{what}: d2t maps draft ids outside the target vocabulary of {vocab}")
    head.load_state_dict(state)
    return head


def saved_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The tensors a head is stored with: no embed_tokens (the target's), d2t/t2d when the draft vocabulary is
    reduced."""
    return {k: v for k, v in head.state_dict().items() if k != "embed_tokens.weight"}


def save(head: Eagle3Head, raw_config: dict, out: Path, half: bool = False) -> None:
    """The official layout (`saved_state`)."""
    eagle.save(saved_state(head), raw_config, out, half)


def fits(folder: Path, kind: str = "eagle3", title: str = "EAGLE-3 head") -> tuple[int, int | None]:
    """The target hidden size (`target_hidden_size`, else the head's own) and vocabulary the head is for."""
    config = speculators.official(folder, kind, title)[0]
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if not isinstance(hidden, int):
        raise SpecbenchError(f"{title} '{folder}': config.json has no target_hidden_size or hidden_size")
    return hidden, config.get("vocab_size")


FAMILY = head_family(HeadFamily("eagle3", "EAGLE-3", eagle.FAMILY.layout, load, fits))
