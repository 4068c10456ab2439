"""The decoder `--graphs` runs: one compact Llama-family model of our own (Llama 2 and 3.x with their rope scaling,
Vicuna, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its per-head q/k norms, SmolLM2), read in one sitting.
Queries, keys and values are one product and the MLP's gate and up another, by construction; attention reads and
writes a cache through `cache.update(keys, values, layer)` (the static rows of `core.static_cache`), under the
additive mask and per-row positions its caller builds (a token tree's included).

`Decoder.adopt` builds it from a transformers model loaded the usual way (hub folder, local folder, GGUF) without a
second copy of the weights: the fused products are new tensors and the transformers model's projections become views
of them, so both models run on the same memory (the eager regime and the heads keep reading the transformers one).
A model outside the family is refused by `unsupported`, with the reason, and `--graphs` runs it on transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..core.static_lm import BUCKETS, MAX_CACHE

FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # config model_type
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rope types whose frequencies do not depend on the length


class KeysAndValues(Protocol):
    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a forward's keys and values [B, kv heads, n, d] of `layer`; all the keys and values it attends."""
        ...


def unsupported(model: Any) -> str | None:
    """Why the transformers model `model` cannot run on the owned decoder (None: it can), in a few words."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", None)
    if kind not in FAMILY:
        return f"its architecture '{kind}' is outside the Llama family ({', '.join(FAMILY)})"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"its rope type '{rope}' changes with the sequence's length"
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or []) or (
        kind == "mistral" and window is not None
    )
    if sliding and window is not None and window < MAX_CACHE + BUCKETS[-1]:
        return f"its attention slides over {window} tokens"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its MLP's activation is '{config.hidden_act}', not SiLU"
    inner = model.get_decoder()
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"its decoder {type(inner).__name__} is not laid out as Llama's"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (normalised in float32, rounded once to the input's dtype, then scaled by `weight` in it) as
    torch's rms_norm kernel and the weight's product: two kernels where transformers' chain runs eight, with its
    numbers (bit for bit on a CPU; on a GPU the mean's summation order may differ in float32's last bit)."""
    return F.rms_norm(x, weight.shape, None, eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    @staticmethod
    def build(size: int, eps: float) -> RMSNorm:
        """A fresh one (weight 1), as a checkpoint's is before loading."""
        return RMSNorm(nn.Parameter(torch.ones(size)), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def adopt_norm(norm: Any) -> RMSNorm:
    """Ours, on the weight of a transformers Llama-family RMSNorm."""
    return RMSNorm(norm.weight, norm.variance_epsilon)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of `x` [B, heads, n, d] at angles cos, sin [B, n, d] (halves rotated, not pairs)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class Rotary(nn.Module):
    """cos and sin [B, n, d] at positions [B, n]: frequencies and scale are the transformers model's own (rope scaling
    included), so the angles are its angles."""

    inv_freq: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scale = scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def fused(parts: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing `parts` side by side; each part's parameters become views of the joint ones, so
    the parts keep working and no weight is held twice."""
    weight = torch.cat([p.weight.detach() for p in parts])
    joint = nn.Linear(weight.shape[1], weight.shape[0], parts[0].bias is not None, weight.device, weight.dtype)
    joint.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        joint.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    start = 0
    for part in parts:
        rows = slice(start, start + part.out_features)
        part.weight = nn.Parameter(joint.weight[rows], requires_grad=False)
        if part.bias is not None:
            part.bias = nn.Parameter(joint.bias[rows], requires_grad=False)
        start = rows.stop
    return joint


class Joined(nn.Module):
    """A module whose products join several of a checkpoint's linear layers side by side (`joined`: its product's
    name -> the checkpoint's names of its parts and their output rows). Its state dict uses the checkpoint's names,
    the parts views of the joint product, and loading one joins them again: a head built on our modules reads and
    writes the official layout."""

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(_as_parts)
        self.register_load_state_dict_pre_hook(_joined_parts)

    def joined(self) -> dict[str, dict[str, int]]:
        raise NotImplementedError


def _as_parts(module: Joined, state: dict, prefix: str, metadata: Any) -> None:
    """`Joined`'s state dict: each joint product's tensors as its parts, under the checkpoint's names (views)."""
    for own, parts in module.joined().items():
        for kind in ("weight", "bias"):
            joint = state.pop(f"{prefix}{own}.{kind}", None)
            if joint is not None:
                state.update(
                    (f"{prefix}{name}.{kind}", part)
                    for name, part in zip(parts, joint.split(list(parts.values())), strict=True)
                )


def _joined_parts(module: Joined, state: dict, prefix: str, *_: Any) -> None:
    """Before `Joined` loads a state dict: the checkpoint's parts of each joint product joined."""
    for own, parts in module.joined().items():
        for kind in ("weight", "bias"):
            names = [f"{prefix}{name}.{kind}" for name in parts]
            if all(name in state for name in names):
                state[f"{prefix}{own}.{kind}"] = torch.cat([state.pop(name) for name in names])


@dataclass(frozen=True)
class Heads:
    queries: int
    keys: int  # key/value heads (fewer than queries: grouped-query attention)
    size: int  # each head's width
    scale: float  # of the query-key products


class Attention(Joined):
    """Self-attention over the cache: one product for queries, keys and values, optional per-head norms (Qwen3)."""

    def __init__(
        self,
        qkv: nn.Linear,
        out: nn.Linear,
        heads: Heads,
        layer: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__()
        self.qkv, self.out, self.heads, self.layer = qkv, out, heads, layer
        self.q_norm, self.k_norm = q_norm, k_norm
        self.grouped = heads.keys != heads.queries  # (a bool: torch.compile makes a module's ints symbols)

    def joined(self) -> dict[str, dict[str, int]]:
        h = self.heads
        kv = h.keys * h.size
        return {
            "qkv": {"q_proj": h.queries * h.size, "k_proj": kv, "v_proj": kv},
            "out": {"o_proj": self.out.out_features},
        }

    @staticmethod
    def build(config: Any, index: int, width: int | None = None) -> Attention:
        """A fresh one for a Llama-family `config` as its family lays it out (Qwen2: biased q/k/v; Qwen3 or
        `qk_norm`: per-head norms; else biases where `attention_bias`), its input `width` wide (default: the hidden
        size; EAGLE-3's reads 2H), writing cache layer `index`."""
        hidden, queries, kind = config.hidden_size, config.num_attention_heads, getattr(config, "model_type", None)
        keys = getattr(config, "num_key_value_heads", None) or queries
        size = getattr(config, "head_dim", None) or hidden // queries
        bias = bool(getattr(config, "attention_bias", False))
        qkv = nn.Linear(width or hidden, (queries + 2 * keys) * size, bias=bias or kind == "qwen2")
        out = nn.Linear(queries * size, hidden, bias=bias and kind != "qwen2")
        qk_norm = kind == "qwen3" or bool(getattr(config, "qk_norm", False))  # (DeepSpec's EAGLE-3 heads: too)
        norms = [RMSNorm.build(size, config.rms_norm_eps) for _ in range(2)] if qk_norm else []
        return Attention(qkv, out, Heads(queries, keys, size, size**-0.5), index, *norms)

    @staticmethod
    def adopt(attn: Any, index: int) -> Attention:
        """Ours, from a transformers Llama-family attention (q/k/v/o projections, per-head norms if any), writing
        its keys and values as cache layer `index`."""
        size = attn.head_dim
        heads = Heads(attn.q_proj.out_features // size, attn.k_proj.out_features // size, size, attn.scaling)
        norms = [adopt_norm(attn.q_norm), adopt_norm(attn.k_norm)] if hasattr(attn, "q_norm") else []
        return Attention(fused([attn.q_proj, attn.k_proj, attn.v_proj]), attn.o_proj, heads, index, *norms)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KeysAndValues | None,
    ) -> torch.Tensor:
        b, n, _ = x.shape  # [B, n, in]
        h = self.heads
        qkv = self.qkv(x).view(b, n, h.queries + 2 * h.keys, h.size)  # [B, n, heads, d]: queries, keys, values
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, :, : h.queries], qkv[:, :, h.queries : h.queries + h.keys]
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        else:
            qk = qkv[:, :, : h.queries + h.keys]
        qk = rotate(qk.transpose(1, 2), *rope)  # [B, heads, n, d]: queries and keys rotated as one tensor
        q, k = qk[:, : h.queries], qk[:, h.queries :]
        v = qkv[:, :, h.queries + h.keys :].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)  # [B, kv heads, keys, d]
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and n > 1, scale=h.scale, enable_gqa=self.grouped
        )
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class MLP(Joined):
    """down(silu(gate(x)) * up(x)), gate and up one product."""

    def __init__(self, gate_up: nn.Linear, down: nn.Linear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def joined(self) -> dict[str, dict[str, int]]:
        inner = self.down.in_features
        return {"gate_up": {"gate_proj": inner, "up_proj": inner}, "down": {"down_proj": self.down.out_features}}

    @staticmethod
    def build(hidden: int, inner: int) -> MLP:
        """A fresh one (no biases, as Llama's and Qwen3's)."""
        return MLP(nn.Linear(hidden, 2 * inner, bias=False), nn.Linear(inner, hidden, bias=False))

    @staticmethod
    def adopt(mlp: Any) -> MLP:
        """Ours, from a transformers gated MLP (gate_proj, up_proj, down_proj; SiLU)."""
        return MLP(fused([mlp.gate_proj, mlp.up_proj]), mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Layer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream (named as in the checkpoints)."""

    def __init__(self, attention: Attention, mlp: MLP, attention_norm: nn.Module, mlp_norm: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        self.input_layernorm, self.post_attention_layernorm = attention_norm, mlp_norm

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KeysAndValues | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    @staticmethod
    def build(config: Any, index: int, input_norm: bool = True) -> Layer:
        """A fresh Llama layer for `config`; without `input_norm`, its attention's input is not normalised
        (nn.Identity: EAGLE's first layer)."""
        hidden, eps = config.hidden_size, config.rms_norm_eps
        first = RMSNorm.build(hidden, eps) if input_norm else nn.Identity()
        mlp = MLP.build(hidden, config.intermediate_size)
        return Layer(Attention.build(config, index), mlp, first, RMSNorm.build(hidden, eps))

    @staticmethod
    def adopt(layer: Any, index: int) -> Layer:
        """Ours, from a transformers Llama-family decoder layer (its weights shared: `fused`); an input norm that is
        nn.Identity stays one (EAGLE's first layer)."""
        first = layer.input_layernorm
        attention_norm = first if isinstance(first, nn.Identity) else adopt_norm(first)
        return Layer(
            Attention.adopt(layer.self_attn, index),
            MLP.adopt(layer.mlp),
            attention_norm,
            adopt_norm(layer.post_attention_layernorm),
        )


class Decoder(nn.Module):
    """Embedding, layers, final norm and readout. `config` is the transformers model's (what a cached LM reads)."""

    def __init__(
        self, embed: nn.Embedding, layers: list[Layer], norm: RMSNorm, readout: nn.Linear, rotary: Rotary, config: Any
    ) -> None:
        super().__init__()
        self.embed, self.layers, self.norm, self.readout = embed, nn.ModuleList(layers), norm, readout
        self.rotary = rotary
        self.config = config

    @staticmethod
    def adopt(model: Any) -> Decoder:
        """Ours, on the weights of the transformers model `model` (checked with `unsupported` first)."""
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"{type(model).__name__} cannot run on the owned decoder: {why}")
        inner = model.get_decoder()
        layers = [Layer.adopt(layer, i) for i, layer in enumerate(inner.layers)]
        rotary = Rotary(inner.rotary_emb.inv_freq, float(inner.rotary_emb.attention_scaling))
        return Decoder(
            inner.embed_tokens, layers, adopt_norm(inner.norm), model.get_output_embeddings(), rotary, model.config
        )

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.readout

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KeysAndValues | None,
        features: tuple[int, ...] = (),
        added: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final normalised states [B, n, H] of `ids` [B, n] at `positions` [B, n] under the additive `mask`
        [B, 1, n, keys] (None: causal), and the hidden states `features` asks for side by side [B, n, F] (0 = the
        embeddings, i = layer i's output, -1 = the final normalised state). `added` [B, n, H]: summed into the
        embeddings (a drafter reading the target's states through them: PARD-2)."""
        x = self.embed(ids) if added is None else self.embed(ids) + added
        rope = self.rotary(positions, x.dtype)
        kept = {0: x} if 0 in features else {}
        for i, layer in enumerate(self.layers, 1):
            x = layer(x, rope, mask, cache)
            if i in features:
                kept[i] = x
        final = self.norm(x)
        kept[-1] = kept[len(self.layers)] = final  # (transformers' last hidden state is the normalised one too)
        return final, torch.cat([kept[i] for i in features], dim=-1) if features else None
