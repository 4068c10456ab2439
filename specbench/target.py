"""A Hugging Face causal LM with a KV cache that speculative decoding can verify trees against and trim."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .tree import Tree, attention_mask, position_ids


class Target:
    """Wraps any `AutoModelForCausalLM`. The cache holds every committed token except the newest (the root)."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.cache: DynamicCache | None = None

    @property
    def cached(self) -> int:
        """Number of tokens whose keys and values are in the cache."""
        return self.cache.get_seq_length() if self.cache is not None else 0

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, tokens: list[int], tree: Tree | None = None, last_only: bool = False) -> torch.Tensor:
        """Append `tokens` to the cache (a chain, or [root] + tree when `tree` is given). Returns logits [n, V],
        or [1, V] for the last token only with `last_only` (a prefill: no vocabulary projection of the prompt)."""
        if self.cache is None:
            self.reset()
        past = self.cached
        ids = torch.tensor([tokens], device=self.device)
        if tree is None or tree.is_chain:
            positions = torch.arange(past, past + len(tokens), device=self.device)[None]
            mask = None
        else:
            positions = position_ids(tree, past, self.device)
            mask = attention_mask(tree, past, self.dtype, self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits[0]

    def verify(self, root: int, tree: Tree) -> torch.Tensor:
        """One forward over [root] + tree. Returns logits [len(tree) + 1, V]; the cache grows by that many rows."""
        return self.forward([root, *tree.tokens], tree)

    @torch.inference_mode()
    def commit(self, start: int, keep: list[int]) -> None:
        """Keep cache rows start + keep[i] (relative rows of the last forward) as rows start + i; drop the rest."""
        if keep != list(range(len(keep))):
            src = torch.tensor([start + k for k in keep], device=self.device)
            dst = slice(start, start + len(keep))
            for layer in self.cache.layers:
                layer.keys[:, :, dst] = layer.keys.index_select(2, src)
                layer.values[:, :, dst] = layer.values.index_select(2, src)
        self.crop(start + len(keep))

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Drop cache rows from `length` on."""
        if self.cache is not None and self.cached > length:
            self.cache.crop(length - self.cached)  # transformers 5 takes minus the number of rows to drop
