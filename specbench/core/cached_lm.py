"""A Hugging Face causal LM with a KV cache that speculative decoding can verify trees against and trim."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from ..errors import SpecbenchError
from .transfer import upload
from .tree import Tree, attention_mask, position_ids


@dataclass(frozen=True)
class SideBranch:
    """Extra tokens run in the same forward as a proposal's tree whose logits only the proposer reads (e.g. a
    Jacobi window).

    Their cache rows are always dropped by the commit that follows."""

    tokens: list[int]
    positions: list[int]  # offsets from the root's position
    allowed: torch.Tensor  # bool [m, 1 + n + m]: the new rows ([root] + tree + side) each side token attends to


@functools.cache
def cache_argument(module_class: type[torch.nn.Module]) -> str:
    """The keyword a module's forward takes its KV cache by: `cache` from transformers 5.24 on (there
    `past_key_values` only warns, and it goes in 5.40), `past_key_values` before and in older remote code."""
    return "cache" if "cache" in inspect.signature(module_class.forward).parameters else "past_key_values"


def hidden_features(out, layers: tuple[int, ...]) -> torch.Tensor:
    """The requested hidden states of a decoder's output [B, n, H] concatenated on the last dim [B, n, F]:
    index i = the output of layer i (0 = the embeddings), -1 = the final normalised state the LM head reads."""
    return torch.cat([out.last_hidden_state if i == -1 else out.hidden_states[i] for i in layers], dim=-1)


@dataclass(frozen=True)
class Forward:
    logits: torch.Tensor  # [rows, V]
    features: torch.Tensor | None = None  # [rows, F]: the requested hidden states, concatenated on the last dim
    picks: tuple[torch.Tensor, torch.Tensor | None] | None = None  # a captured forward asked for them (`greedy`):
    # each row's argmax [rows] and `margins` [rows] (None where only the argmax was asked for: a draft's), computed
    # inside its graph; its next replay writes over them


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Each row's top-1 minus top-2 logit [rows] in float32 (how near a tie its argmax was: the losslessness
    check's). The top two are taken in the logits' own dtype, whose values float32 holds exactly."""
    return top_two(logits)[1]


CHUNK = 64  # logits a first pass reduces at a time (`top_two`)
CHUNKED = 1 << 17  # logits at least, for the chunks to pay for their extra ops (measured on a CPU: docs/cpu-notes.md)


def top_two(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (the first of equal maxima, as `argmax`) and `margins`. One pass over the logits takes
    every chunk's maximum (a plain maximum: a CPU's max-with-index runs several times slower); the argmax is then
    the first maximum of the first chunk holding the row's maximum (`top1`), and the runner-up the larger of the
    other chunks' maxima and that chunk's second. A vocabulary that is no multiple of CHUNK takes the plain
    max-with-index and a masked max, as do fewer than CHUNKED logits and a GPU's."""
    if not _chunks_pay(logits):
        best, first = logits.max(dim=-1)
        second = logits.scatter(-1, first[..., None], float("-inf")).amax(dim=-1)
        return first, best.float() - second.float()
    peaks, best, chunk, inside, within = _chunked(logits)
    others = peaks.scatter(-1, chunk[..., None], float("-inf")).amax(dim=-1)
    runner = inside.scatter(-1, within[..., None], float("-inf")).amax(dim=-1)
    return chunk * CHUNK + within, best.float() - torch.maximum(others, runner).float()


def top1(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of equal maxima, as `argmax` (by chunks as `top_two`: several times faster on
    a CPU)."""
    if not _chunks_pay(logits):
        return logits.max(dim=-1).indices
    _, _, chunk, _, within = _chunked(logits)
    return chunk * CHUNK + within


def _chunks_pay(logits: torch.Tensor) -> bool:
    """On a CPU, with enough logits (a GPU's max-with-index is fast: there they would be kernels for nothing)."""
    return logits.device.type == "cpu" and logits.numel() >= CHUNKED and logits.shape[-1] % CHUNK == 0


def _chunked(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every chunk's maximum [..., C], the row's maximum and first chunk holding it [...], that chunk's logits
    [..., CHUNK] and the first maximum's place in it [...]."""
    chunks = logits.unflatten(-1, (logits.shape[-1] // CHUNK, CHUNK))  # [..., C, CHUNK]
    peaks = chunks.amax(dim=-1)
    best, chunk = peaks.max(dim=-1)
    inside = chunks.gather(-2, chunk[..., None, None].expand(*chunk.shape, 1, CHUNK)).squeeze(-2)
    return peaks, best, chunk, inside, inside.max(dim=-1).indices


def call(
    model,
    cache,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor,
    layers: tuple[int, ...] | None,
    last_only: bool = False,
    greedy: bool = False,
) -> Forward:
    """One forward of a causal LM over `ids` [1, n] into `cache`: logits (the last row's only with `last_only`),
    when `layers` are asked for those hidden states as features of every row, and with `greedy` the picks."""
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    if layers is None:
        out = model(**inputs, **{cache_argument(type(model)): cache}, logits_to_keep=1 if last_only else 0)  # type: ignore[arg-type]
        logits, features = out.logits[0], None
    else:
        decoder = model.get_decoder()
        out = decoder(
            **inputs,
            **{cache_argument(type(decoder)): cache},  # type: ignore[arg-type]
            output_hidden_states=any(i != -1 for i in layers),
        )
        final = out.last_hidden_state[0]
        logits = model.get_output_embeddings()(final[-1:] if last_only else final)
        features = hidden_features(out, layers)[0]
    return Forward(logits, features, top_two(logits) if greedy else None)


def as_ids(tokens: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids [n] on `device`, from the host's list or already a tensor (no host wait)."""
    return tokens.to(device) if isinstance(tokens, torch.Tensor) else upload(tokens, device)


RECURRENT = ("linear", "mamba", "conv", "recurrent", "ssm")  # config layer types whose state is not a KV cache


class CachedLM:
    """Any `AutoModelForCausalLM` (a target or a draft) with its KV cache: tree forwards, commit and crop.
    The cache holds every committed token except the newest (the root)."""

    def __init__(self, model) -> None:
        types = set(getattr(model.config.get_text_config(), "layer_types", None) or [])
        recurrent = sorted(t for t in types if any(word in str(t) for word in RECURRENT))
        if recurrent:
            raise SpecbenchError(
                f"model '{model.config.name_or_path}' has {', '.join(recurrent)} layers, whose recurrent state can "
                "neither verify a token tree nor roll back a rejection: use a model with attention layers only"
            )
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.cache: DynamicCache | None = None
        self.prefilled: tuple[tuple, Forward | None] | None = None  # the last prefill: (prompt and layers, its output)

    @property
    def cached(self) -> int:
        """Number of tokens whose keys and values are in the cache."""
        return self.cache.get_seq_length() if self.cache is not None else 0

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.prefilled = None

    def prefill(self, prompt: list[int], layers: tuple[int, ...] | None = None, reuse: bool = False) -> Forward | None:
        """Empty the cache and fill it with all of `prompt` but its last token (the first root). `reuse`: when the
        last prefill was of the same prompt and layers and its rows are still cached, crop back to them instead (the
        sampling audit answers one prompt thousands of times; a timed answer never reuses)."""
        key = (tuple(prompt), layers)
        if reuse and self.prefilled is not None and self.prefilled[0] == key and self.cached >= len(prompt) - 1:
            self.crop(len(prompt) - 1)
            return self.prefilled[1]
        self.reset()
        out = self.run(prompt[:-1], last_only=True, layers=layers) if len(prompt) > 1 else None
        if reuse:  # copies: a captured graph's outputs are overwritten by its next replay; timed calls keep none
            if out is not None:
                out = Forward(out.logits.clone(), None if out.features is None else out.features.clone())
            self.prefilled = (key, out)
        return out

    def forward(
        self, tokens: list[int] | torch.Tensor, tree: Tree | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Append `tokens` to the cache (a chain, or [root] + tree when `tree` is given). Returns logits [n, V],
        or [1, V] for the last token only with `last_only` (a prefill: no vocabulary projection of the prompt)."""
        return self.run(tokens, tree, last_only=last_only).logits

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int] | torch.Tensor,
        tree: Tree | None = None,
        *,
        last_only: bool = False,
        layers: tuple[int, ...] | None = None,
        side: SideBranch | None = None,
        greedy: bool = False,
    ) -> Forward:
        """One forward appending `tokens` (with `tree`: [root] + tree tokens + side tokens; a list, or ids [n] on
        the device) to the cache.

        `layers` asks for hidden states as features: indices into the model's hidden-state list (0 = the
        embeddings, i = the output of layer i) and -1 for the final normalised state the LM head reads.
        `greedy`: the caller reads every row's argmax. A captured forward (`BatchedLM`) computes the picks inside
        its graph, where they cost no launch from the host; here, uncaptured, they are left to the caller, which
        needs the margins of a few rows only.
        """
        if self.cache is None:
            self.reset()
        past = self.cached
        ids = as_ids(tokens, self.device)[None]
        if tree is None or (tree.is_chain and side is None):
            positions = torch.arange(past, past + len(tokens), device=self.device)[None]
            mask = None  # plain causal attention: the model builds it (and sdpa takes its fast path)
        else:
            positions = position_ids(tree, past, self.device, side.positions if side else None)
            mask = attention_mask(tree, past, self.dtype, self.device, side.allowed if side else None)
        return call(self.model, self.cache, ids, mask, positions, layers, last_only)

    @torch.inference_mode()
    def commit(self, start: int, keep: list[int]) -> None:
        """Keep cache rows start + keep[i] (relative rows of the last forward) as rows start + i; drop the rest."""
        if keep != list(range(len(keep))):
            src = torch.tensor([start + k for k in keep], device=self.device)
            dst = slice(start, start + len(keep))
            assert isinstance(self.cache, DynamicCache)
            for layer in self.cache.layers:
                assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
                layer.keys[:, :, dst] = layer.keys.index_select(2, src)
                layer.values[:, :, dst] = layer.values.index_select(2, src)
        self.crop(start + len(keep))

    def follow(self, tokens: list[int]) -> None:
        """A draft after a verification: its cached rows stay valid up to the last accepted token; the newest
        token of `tokens` is the next root, so nothing from it on stays cached."""
        self.crop(len(tokens) - 1)

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Drop cache rows from `length` on."""
        if self.cache is not None and self.cached > length:
            self.cache.crop(length - self.cached)  # transformers 5 takes minus the number of rows to drop
