"""PARD drafters (AMD, arXiv 2504.18583; AMD-AGI/PARD): a small causal LM adapted to guess k tokens in one forward.
After the committed tokens come k - 1 copies of a mask token (`pard_token` in config.json, an id the text never
holds); under plain causal attention at consecutive positions, the rows of the last real token and of the masks
guess the next k tokens. Target-independent: one drafter serves every target with its vocabulary.

Checkpoint: any `*ForCausalLM` folder whose config.json has `pard_token` (TensorRT-LLM's `mask_token_id` is read
too), as amd/PARD-Llama-3.2-1B and amd/PARD-Qwen2.5-0.5B ship; `specbench train pard` also writes
`spd_type: "pard"`, as the official trainer does.

Training (`specbench train pard`, the paper's recipe with its conditional drop-token): a window x_0..x_{L-1} is
followed by k - 1 blocks of mask tokens at the same positions 0..L-1. The row (b, p) of mask block b sees the real
tokens x_0..x_{p-b} and the masks (1, p-b+1), ..., (b, p): what a mask b places past the last real token sees at
inference. Every row learns the text's next token x_{p+1} (hard labels, cross-entropy). Block b keeps only
L * max(r^b, r_min) of its rows, each chosen among the rows whose predecessor (b-1, p-1) was kept.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.tree import additive_mask
from ..errors import SpecbenchError
from ..registry import HeadFamily, head_family
from .folder import HEAD_LAYOUTS, read_config


def pard_token(config: dict) -> int | None:
    """The mask token id a PARD config names: `pard_token`, else `mask_token_id`."""
    found = config.get("pard_token", config.get("mask_token_id"))
    return found if isinstance(found, int) and not isinstance(found, bool) and found >= 0 else None


def load(source: str | Path, target_model: Any) -> nn.Module:
    """A PARD drafter (any causal LM with a mask token), checked against the target's vocabulary."""
    from ..models.loading import load_causal_lm

    what = f"PARD drafter '{source}'"
    raw = read_config(source, "PARD drafter")
    if pard_token(raw) is None:
        raise SpecbenchError(
            f"{what}: config.json has no pard_token (the mask token id): not a PARD drafter; "
            f"make one with `specbench train pard`"
        )
    model = load_causal_lm(source, torch.device("cpu"), target_model.dtype, "PARD drafter")
    vocab = model.get_output_embeddings().weight.shape[0]
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    if vocab > target_vocab or pard_token(raw) >= vocab:
        raise SpecbenchError(
            f"{what} reads out {vocab} tokens (mask {pard_token(raw)}), the target {target_vocab}: "
            f"use a drafter with the target's tokenizer"
        )
    model.pard_token = pard_token(raw)
    return model


def fits(folder: Path) -> tuple[int | None, int | None]:
    """Any target hidden size (the drafter reads only tokens); its vocabulary is checked when it loads."""
    return None, None


FAMILY = head_family(HeadFamily("pard", "PARD drafter", HEAD_LAYOUTS["pard"], load, fits, static=True))


def drop_rows(length: int, blocks: int, ratio: float, floor: float, generator: torch.Generator) -> list[list[int]]:
    """The positions each block keeps [blocks][...], ascending: block 0 all of them; block b a random
    int(length * max(ratio ** b, floor)) of the rows p >= b whose predecessor (b - 1, p - 1) it keeps."""
    kept = [list(range(length))]
    for b in range(1, blocks):
        candidates = [p + 1 for p in kept[-1] if b <= p + 1 < length]
        size = min(len(candidates), int(length * max(ratio**b, floor)))
        pick = torch.randperm(len(candidates), generator=generator)[:size].sort().values.tolist()
        kept.append([candidates[i] for i in pick])
    return kept


def chain_rows(kept: list[list[int]]) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The rows (block b, position p) of the blocks `kept`, flattened block after block, and who sees whom
    (bool [Q, Q]): block 0's rows up to p - b (the real tokens before the chain) and the chain's own rows
    (j, p - b + j), j = 1..b (itself included). P-EAGLE's parallel rows train on the same pattern."""
    rows = [(b, p) for b, positions in enumerate(kept) for p in positions]
    index = {row: i for i, row in enumerate(rows)}
    allowed = torch.zeros(len(rows), len(rows), dtype=torch.bool)
    for i, (b, p) in enumerate(rows):
        allowed[i, : p - b + 1] = True  # the real tokens x_0..x_{p-b} (block 0 is stored first, in order)
        for j in range(1, b + 1):  # the masks of its chain, itself included
            allowed[i, index[(j, p - b + j)]] = True
    return rows, allowed


def pard_example(ids: list[int], kept: list[list[int]], mask_id: int) -> tuple[torch.Tensor, ...]:
    """The flattened training rows of one window: token ids [Q], positions [Q], who sees whom (bool [Q, Q]) and
    labels [Q] (-100: no next token in the window)."""
    rows, allowed = chain_rows(kept)
    tokens = [ids[p] if b == 0 else mask_id for b, p in rows]
    labels = [ids[p + 1] if p + 1 < len(ids) else -100 for _, p in rows]
    return torch.tensor(tokens), torch.tensor([p for _, p in rows]), allowed, torch.tensor(labels)


def depth_rows(kept: list[list[int]]) -> list[int]:
    """Each row's depth: how many tokens past the last real token it sees its label lies (block b: b + 1)."""
    return [b + 1 for b, positions in enumerate(kept) for _ in positions]


def forward_rows(model: Any, example: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The drafter's logits [Q, V] over one window's rows."""
    tokens, positions, allowed, _ = example
    device = model.get_output_embeddings().weight.device
    mask = additive_mask(allowed, next(model.parameters()).dtype, device)
    return model(
        input_ids=tokens[None].to(device), position_ids=positions[None].to(device), attention_mask=mask, use_cache=False
    ).logits[0]


def save(draft: Any, source: Path, out: Path, mask_id: int, half: bool = False) -> None:
    """A full checkpoint (config.json with pard_token and spd_type, weights, and the source's tokenizer files)."""
    out.mkdir(parents=True, exist_ok=True)
    draft.config.pard_token = mask_id
    draft.config.spd_type = "pard"
    (draft.half() if half else draft).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
