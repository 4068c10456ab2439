"""Self-distillation of Medusa heads, EAGLE heads, MTP modules and DFlash drafters from a frozen target over text:
the labels are the target's own next-token distributions on that text (no generation), the inputs its hidden
states (the final ones; three inner ones for EAGLE-3; the drafter's own choice for DFlash). A PARD drafter is the
exception: a small model adapted on the text's own tokens, as its paper trains it; the target only scores it. A
PARD-2 drafter learns from both: the text's tokens and the target's distributions, its inputs the target's states.

Per-depth top-1 accuracy on held-out text is the share of positions where the head's first guess at depth
d equals the target's greedy token there (tokens in between taken from the text; DFlash and PARD see none).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from ..core.cached_lm import hidden_features
from ..core.tree import additive_mask
from ..errors import SpecbenchError
from ..progress import Progress
from . import dflash, dflash2, dspark, eagle3, frequencies, mtp, pard, pard2, peagle, speculators
from .checkpoint import target_signature
from .eagle import EagleHead, build, config_from_target
from .medusa import MedusaHeads
from .train_config import TrainConfig

H = TypeVar("H", bound=eagle3.Eagle3Head)


def windows(stream: torch.Tensor, cfg: TrainConfig, generator: torch.Generator, what: str) -> torch.Tensor:
    """A batch of random windows [B, L] of the token stream."""
    if len(stream) <= cfg.seq_len:
        raise SpecbenchError(f"the {what} has {len(stream)} tokens, not enough for --seq-len {cfg.seq_len}")
    start = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s : s + cfg.seq_len] for s in start.tolist()])


@torch.no_grad()
def target_pass(model: Any, ids: torch.Tensor, layers: tuple[int, ...] = (-1,)) -> tuple[torch.Tensor, ...]:
    """Features [B, L, F] (CachedLM.run's `layers`; by default the final normalised states) and logits [B, L, V],
    in float32."""
    device = next(model.parameters()).device
    out = model.get_decoder()(input_ids=ids.to(device), output_hidden_states=any(i != -1 for i in layers))
    return hidden_features(out, layers).float(), model.get_output_embeddings()(out.last_hidden_state).float()


def frozen_float(module: nn.Module) -> nn.Module:
    """A float32 copy to train against, leaving the target in its own dtype."""
    return copy.deepcopy(module).float().requires_grad_(False)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's logits against the target's next-token distributions, per position."""
    return -(target_probs * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def _loop(
    name: str,
    params: list[nn.Parameter],
    loss_fn,
    stream: torch.Tensor,
    model: nn.Module | None,
    cfg: TrainConfig,
    layers: tuple[int, ...] = (-1,),
) -> None:
    """AdamW at a constant rate; loss_fn(ids, features, logits) on each batch of windows (features: `layers`), or
    loss_fn(ids) without a `model` to read."""
    assert cfg.lr is not None  # train_config sets it
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)
    bar = Progress(cfg.steps, f"train {name}", "steps")
    smooth = None
    for _ in range(cfg.steps):
        ids = windows(stream, cfg, generator, "training text")
        loss = loss_fn(ids.to(params[0].device), *(target_pass(model, ids, layers) if model is not None else ()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        value = loss.item()
        smooth = value if smooth is None else 0.9 * smooth + 0.1 * value  # ~ the last 10 steps
        bar.update(loss=f"{smooth:.3f}")
    bar.close()


@torch.no_grad()
def _evaluate(
    depth_hits, heldout: torch.Tensor, model: nn.Module, cfg: TrainConfig, device, layers: tuple[int, ...] = (-1,)
) -> list[float]:
    """Per-depth top-1 accuracy over held-out windows; depth_hits(ids, features, logits) -> [(hits, total)]."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    totals = torch.zeros(())
    for _ in range(cfg.eval_batches):
        ids = windows(heldout, cfg, generator, "held-out text")
        totals = totals + torch.tensor(depth_hits(ids.to(device), *target_pass(model, ids, layers)))  # [depths, 2]
    return [round(hits / max(total, 1), 4) for hits, total in totals.tolist()]


def _hits(guess: torch.Tensor, target_logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreements, positions) of guessed token ids [B, n] with the target's greedy tokens."""
    return float((guess == target_logits.argmax(-1)).sum()), float(guess.numel())


def train_medusa(model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig):
    """Medusa-1 heads (own projection initialised from the target's lm_head, or the target's lm_head itself
    with cfg.medusa_shared_lm_head; blocks start as the identity). Returns the heads and their per-depth
    held-out accuracy."""
    lm_head = model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    device = lm_head.weight.device
    heads = MedusaHeads(cfg.medusa_heads, cfg.medusa_layers, hidden, None if cfg.medusa_shared_lm_head else vocab)
    heads = heads.to(device)
    if not cfg.medusa_shared_lm_head:
        for head in heads:
            head[-1].weight.data.copy_(lm_head.weight.float())  # type: ignore[index]  # a Sequential, typed Module
    lm = frozen_float(lm_head)

    def per_head(features: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Head k at row t against the target's row t + 1 + k (logits or probabilities [B, L, V]); both are
        about token t + 2 + k."""
        out = heads(features, lm)  # [K, B, L, V]
        length = features.shape[1]
        return [(out[k][:, : length - 1 - k], target[:, 1 + k :]) for k in range(len(heads))]

    def loss(ids, features, logits):
        pairs = per_head(features, F.softmax(logits, dim=-1))  # the target's distributions, computed once
        return sum(0.8**k * soft_cross_entropy(h, p) for k, (h, p) in enumerate(pairs))

    def depth_hits(ids, features, logits):
        return [_hits(h.argmax(-1), t) for h, t in per_head(features, logits)]

    _loop("medusa", list(heads.parameters()), loss, train, model, cfg)
    return heads.eval(), _evaluate(depth_hits, heldout, model, cfg, device)


def unroll(
    head: EagleHead | eagle3.Eagle3Head | mtp.MtpHead, features: torch.Tensor, ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The draft's chains from every position at once, as in tree drafting: step 1 reads the target's features
    (row i: feature i, token i + 1); step s > 1 reads its own step s - 1 output and the text's next token,
    seeing the target-fed rows up to its anchor and its own chain (the keys of its anchor's row at steps
    2..s: EAGLE-3's diagonal training-time-test mask), at position i + s - 1. Per step, the head's outputs
    [B, L-1, H] whose row i is about position i + s (valid while i + s < L)."""
    batch, length = ids.shape
    n = length - 1
    cache = DynamicCache(config=head.config)
    rows = torch.arange(n, device=ids.device)
    causal, eye = torch.ones(n, n, dtype=torch.bool).tril(), torch.eye(n, dtype=torch.bool)
    outputs, x = [], features[:, :n]
    for step in range(1, steps + 1):
        tokens = ids[:, (rows + step).clamp(max=length - 1)]
        mask = additive_mask(torch.cat([causal, *[eye] * (step - 1)], dim=1), head.fc.weight.dtype, ids.device)
        x = head(x, tokens, (rows + step - 1)[None].expand(batch, n), mask, cache)
        outputs.append(x)
    return outputs


def train_eagle(model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, depths: int = 6):
    """An EAGLE-1/2 head by the EAGLE-1 recipe (feature regression + token cross-entropy on noisy target
    features). Returns the head, its config.json and its per-depth held-out accuracy (depths 1..depths)."""
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    raw = config_from_target(model.config)
    head = build(raw).to(device)
    head.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight.float())
    head.embed_tokens.weight.requires_grad_(False)  # the target's embedding, kept frozen as in EAGLE
    lm = frozen_float(lm_head)

    def loss(ids, features, logits):
        noise = (torch.rand_like(features[:, :-1]) * 2 - 1) * cfg.eagle_noise
        positions = torch.arange(ids.shape[1] - 1, device=device)[None].expand(ids.shape[0], -1)
        predicted = head(features[:, :-1] + noise, ids[:, 1:], positions)  # [B, L-1, H]: features 1..L-1
        regression = F.smooth_l1_loss(predicted, features[:, 1:])
        return regression + cfg.eagle_cls_weight * soft_cross_entropy(lm(predicted), F.softmax(logits[:, 1:], -1))

    def depth_hits(ids, features, logits):
        steps = unroll(head, features, ids, depths)
        return [_hits(lm(x[:, : ids.shape[1] - s]).argmax(-1), logits[:, s:]) for s, x in enumerate(steps, 1)]

    _loop("eagle", [p for p in head.parameters() if p.requires_grad], loss, train, model, cfg)
    return head.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device)


def draft_vocabulary(stream: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the training stream (ties to the lower id), ascending (EAGLE-3)."""
    return frequencies.most_frequent(torch.bincount(stream, minlength=vocab), size)


def draft_vocab_cross_entropy(draft: torch.Tensor, target: torch.Tensor, t2d: torch.Tensor | None) -> torch.Tensor:
    """Soft cross-entropy of draft logits [B, n, V'] against the target's logits [B, n, V] restricted to the
    draft vocabulary (t2d [V]); positions whose target argmax is outside it count as zero, as in EAGLE-3."""
    inside = torch.ones_like(target[..., 0]) if t2d is None else t2d[target.argmax(-1)].float()  # [B, n]
    restricted = target if t2d is None else target[..., t2d]  # [B, n, V']: columns in draft-id order
    per_position = -(F.softmax(restricted, dim=-1) * F.log_softmax(draft, dim=-1)).sum(-1)
    return (per_position * inside).mean()


def ttt_pairs(
    head: eagle3.Eagle3Head | mtp.MtpHead, features: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, steps: int
):
    """Per unrolled step s: (draft logits [B, L-s, V'], the target's logits [B, L-s, V]) about the same tokens."""
    outputs = unroll(head, features, ids, steps)
    return [(head.logits(x[:, : ids.shape[1] - s]), logits[:, s:]) for s, x in enumerate(outputs, 1)]


def eagle3_start(model: Any, train: torch.Tensor, cfg: TrainConfig, build: Callable[[dict], H], **keys: Any):
    """A head of EAGLE-3's layout to train for `model` (`build` of its config.json: the target's shape, `keys`
    added, the draft vocabulary the training text's `cfg.draft_vocab` most frequent tokens), its readout starting as
    the target's rows, its embedding the target's, frozen as in EAGLE-3. Returns it, its config.json and the target
    states it fuses."""
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    vocab = lm_head.weight.shape[0]
    used = draft_vocabulary(train, vocab, min(cfg.draft_vocab, vocab))
    raw = {**config_from_target(model.config), "draft_vocab_size": len(used), **keys}
    head = build(raw)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight.float())
        head.lm_head.weight.copy_(lm_head.weight[used.to(device)].float())
    if head.d2t is not None:
        head.d2t, head.t2d = eagle3.vocabulary_maps(used, vocab)
    head = head.to(device)
    head.embed_tokens.weight.requires_grad_(False)
    return head, raw, eagle3.feature_layers(model.config.get_text_config().num_hidden_layers)


def train_eagle3(model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, depths: int = 8):
    """An EAGLE-3 head by the training-time test: the draft unrolled cfg.ttt_steps steps on its own outputs,
    step s's loss weighted ttt_decay ** (s - 1); the draft vocabulary is the training text's most frequent
    tokens. Returns the head, its config.json and its per-step held-out accuracy (steps 1..depths)."""
    if cfg.ttt_steps >= cfg.seq_len:
        raise SpecbenchError(f"--ttt-steps {cfg.ttt_steps} leaves no position to train in --seq-len {cfg.seq_len}")
    head, raw, layers = eagle3_start(model, train, cfg, eagle3.build)
    device = head.fc.weight.device

    def loss(ids, features, logits):
        pairs = ttt_pairs(head, features, ids, logits, cfg.ttt_steps)
        return sum(cfg.ttt_decay**s * draft_vocab_cross_entropy(d, t, head.t2d) for s, (d, t) in enumerate(pairs))

    def depth_hits(ids, features, logits):
        return [_hits(head.target_ids(d.argmax(-1)), t) for d, t in ttt_pairs(head, features, ids, logits, depths)]

    _loop("eagle3", [p for p in head.parameters() if p.requires_grad], loss, train, model, cfg, layers)
    return head.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device, layers)


def peagle_rows(
    head: peagle.PEagleHead, ids: torch.Tensor, features: torch.Tensor, kept: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P-EAGLE's training rows of windows ids [B, L] and the target's features [B, L, F] in one forward: pair a
    (feature a, token a + 1, at position a) for every a < L - 1, then the parallel rows of the chains `kept`
    (`pard.drop_rows` over the pairs: block b's row p continues the chain from pair p - b, at position p), each
    seeing what it sees when drafting (`pard.chain_rows`). Returns the head's outputs [B, Q, H], each row's block
    [Q] and position [Q]: row (b, p) guesses the token the target's distribution at p + 1 is about."""
    chains, allowed = pard.chain_rows(kept)
    block, position = (torch.tensor(x, device=ids.device) for x in zip(*chains, strict=True))
    anchor = position - block  # the pair each row's chain starts from
    real = (block == 0)[None, :, None]
    mask_features, mask_ids = head.masks(len(ids), len(block))
    x = torch.where(real, features[:, anchor], mask_features)
    tokens = torch.where(real[..., 0], ids[:, anchor + 1], mask_ids)
    mask = additive_mask(allowed, head.fc.weight.dtype, ids.device)
    return head(x, tokens, position[None].expand(len(ids), -1), mask), block, position


def train_peagle(
    model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, mask_id: int, depths: int = 8
):
    """A P-EAGLE head: an EAGLE-3 head trained to guess cfg.pard_tokens tokens per forward. Each window's pairs
    (row a: feature a, token a + 1; label the target's distribution at a + 1) come first; parallel row b of the
    chain from pair a (mask token, mask_hidden, at position a + b) is labelled with the target's distribution at
    a + b + 1, and a random share max(drop_ratio ** b, drop_floor) of those chains is kept at depth b (COD
    sampling, speculators' `peagle/data.py`; the pattern PARD trains on: `pard.chain_rows`). The draft vocabulary
    is the training text's most frequent tokens; the embedding is the target's, frozen (speculators trains it).
    Returns the head, its config.json and its held-out top-1 accuracy by depth (1..depths)."""
    head, raw, layers = eagle3_start(model, train, cfg, peagle.build, mask_token_id=mask_id)
    device = head.fc.weight.device
    rows = torch.Generator().manual_seed(cfg.seed + 2)

    def parallel(ids, features, logits, ratio: float, floor: float, blocks: int):
        """(draft logits [B, Q, V'], the target's logits [B, Q, V], each row's depth [Q]) of one draw of rows."""
        kept = pard.drop_rows(ids.shape[1] - 1, blocks, ratio, floor, rows)
        out, block, position = peagle_rows(head, ids, features, kept)
        return head.logits(out), logits[:, position + 1], block

    def loss(ids, features, logits):
        draft, target, _ = parallel(ids, features, logits, cfg.drop_ratio, cfg.drop_floor, cfg.pard_tokens)
        return draft_vocab_cross_entropy(draft, target, head.t2d)

    def depth_hits(ids, features, logits):
        draft, target, block = parallel(ids, features, logits, 1.0, 1.0, depths)  # every chain to every depth
        right = (head.target_ids(draft.argmax(-1)) == target.argmax(-1)).float().sum(0)  # [Q]
        return [(float(right[block == b].sum()), float((block == b).sum()) * len(ids)) for b in range(depths)]

    _loop("peagle", [p for p in head.parameters() if p.requires_grad], loss, train, model, cfg, layers)
    return head.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device, layers)


def train_mtp(model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, depths: int = 6):
    """An MTP module (DeepSeek-V3 layout, a decoder layer of the target's class) trained as it drafts: unrolled
    cfg.ttt_steps steps on its own outputs (EAGLE-3's training-time test), step s's cross-entropy against the
    target's distributions weighted ttt_decay ** (s - 1). The embedding and readout are the target's, frozen;
    the final norm starts as the target's. Returns the module and its per-step held-out accuracy."""
    if cfg.ttt_steps >= cfg.seq_len:
        raise SpecbenchError(f"--ttt-steps {cfg.ttt_steps} leaves no position to train in --seq-len {cfg.seq_len}")
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    head = mtp.MtpHead(model, mtp.DEEPSEEK)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight.float())
        head.head.weight.copy_(lm_head.weight.float())
        head.norm.weight.copy_(model.get_decoder().norm.weight.float())
    head = head.to(device)
    head.embed_tokens.weight.requires_grad_(False)
    head.head.weight.requires_grad_(False)

    def loss(ids, features, logits):
        pairs = ttt_pairs(head, features, ids, logits, cfg.ttt_steps)
        return sum(cfg.ttt_decay**s * draft_vocab_cross_entropy(d, t, None) for s, (d, t) in enumerate(pairs))

    def depth_hits(ids, features, logits):
        return [_hits(d.argmax(-1), t) for d, t in ttt_pairs(head, features, ids, logits, depths)]

    _loop("mtp", [p for p in head.parameters() if p.requires_grad], loss, train, model, cfg)
    return head.eval(), _evaluate(depth_hits, heldout, model, cfg, device)


def dflash_anchors(batch: int, length: int, cfg: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    """Distinct random block starts per window [B, N], ascending: every block's rows lie inside the window."""
    room = length - cfg.block_size + 1
    order = torch.rand(batch, room, generator=generator).argsort(dim=1)
    return order[:, : min(cfg.blocks, room)].sort(dim=1).values


def dflash_blocks(
    draft: dflash.DFlashDraft, embedding: nn.Module, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """The drafter's final states [B, N, bs, H] for blocks at `anchors` [B, N] of windows ids [B, L] (features
    [B, L, F]), all in one forward, as the official training does: a block's first row is the anchor's token,
    the rest mask tokens; it sees itself (bidirectionally) and the context rows strictly before its anchor."""
    batch, length = ids.shape
    bs = draft.block_size
    rows = anchors[..., None] + torch.arange(bs, device=ids.device)  # [B, N, bs]: each row's position
    noise = torch.full(rows.shape, draft.mask_token_id, device=ids.device)
    noise[..., 0] = ids.gather(1, anchors)
    block = draft.embed(noise, embedding).flatten(1, 2)  # [B, N * bs, H]
    positions = torch.cat([torch.arange(length, device=ids.device).expand(batch, -1), rows.flatten(1)], dim=1)
    which = torch.arange(rows[0].numel(), device=ids.device) // bs  # [Q]: each query row's block
    sees_context = torch.arange(length, device=ids.device) < anchors[:, which, None]  # [B, Q, L]
    sees_block = (which[:, None] == which[None, :]).expand(batch, -1, -1)  # [B, Q, Q]
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # [B, 1, Q, L + Q]
    hidden, _ = draft(block, features, positions, mask)
    return hidden.view(*rows.shape, -1)


def block_training(model: Any, cfg: TrainConfig) -> tuple[nn.Module, nn.Module, torch.Generator, torch.Tensor]:
    """What a DFlash drafter trains against: the target's embedding and readout (float32 copies), the anchors'
    generator and the rows' weights exp(-(k - 1) / block_decay) [bs - 1]."""
    lm_head = model.get_output_embeddings()
    depth = torch.arange(cfg.block_size - 1, device=lm_head.weight.device)
    generator = torch.Generator().manual_seed(cfg.seed + 2)
    weights = torch.exp(-depth.float() / cfg.block_decay)
    return frozen_float(model.get_input_embeddings()), frozen_float(lm_head), generator, weights


def drafted_rows(
    draft: dflash.DFlashDraft,
    embedding: nn.Module,
    ids: torch.Tensor,
    features: torch.Tensor,
    logits: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DFlash drafter's blocks at random anchors of windows ids [B, L]: the drafted rows' states [B, N, bs - 1, H],
    the target's row predicting each drafted token (whose token comes just before it) [B, N, bs - 1] and that row's
    logits [B, N, bs - 1, V]."""
    anchors = dflash_anchors(ids.shape[0], ids.shape[1], cfg, generator).to(ids.device)
    hidden = dflash_blocks(draft, embedding, ids, features, anchors)[:, :, 1:]
    about = anchors[..., None] + torch.arange(cfg.block_size - 1, device=ids.device)  # [B, N, bs - 1]
    target = logits.gather(1, about.flatten(1)[..., None].expand(-1, -1, logits.shape[-1]))
    return hidden, about, target.view(*about.shape, -1)


def train_dflash(model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, mask_token_id: int):
    """A DFlash drafter by the official recipe (SpecForge's `OnlineDFlashModel`): blocks at random anchors of each
    window, row k of a block trained to give the token k places past its anchor, weighted exp(-(k - 1) / decay).
    Ours distils the target's distributions there instead of the text's hard token (the same for the target's own
    answers). Returns the drafter, its config.json and its held-out accuracy by row (depths 1..block_size - 1)."""
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    raw = dflash.config_for(model.config, cfg.draft_layers, cfg.block_size, mask_token_id)
    draft = dflash.build(raw).to(device)
    embedding, lm, anchor_rng, weights = block_training(model, cfg)

    def pairs(ids, features, logits):
        """(drafter logits, the target's logits) [B, N, bs - 1, V] about the same tokens."""
        hidden, _, target = drafted_rows(draft, embedding, ids, features, logits, cfg, anchor_rng)
        return draft.logits(hidden, lm), target

    def loss(ids, features, logits):
        drafted, target = pairs(ids, features, logits)
        per_row = -(F.softmax(target, dim=-1) * F.log_softmax(drafted, dim=-1)).sum(-1)  # [B, N, bs - 1]
        return (per_row * weights).sum() / (weights.sum() * per_row[..., 0].numel())

    def depth_hits(ids, features, logits):
        drafted, target = pairs(ids, features, logits)
        return [_hits(drafted[:, :, k].argmax(-1), target[:, :, k]) for k in range(cfg.block_size - 1)]

    layers = draft.feature_layers
    _loop("dflash", list(draft.parameters()), loss, train, model, cfg, layers)
    return draft.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device, layers)


DFLASH2_TAPS, DFLASH2_GROUP, DFLASH2_RANK, DFLASH2_TOP = 2, 32, 32, 16  # kernel 2 (z-lab's), 16 candidates a row


def train_dflash2(model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, mask_token_id: int):
    """A DFlash2 drafter: DFlash's blocks and loss (`train_dflash`) through the convolved backbone, plus the
    selector's: for each row, softmax of its edge scores over its top-K candidates against the target's
    distribution there renormalised over them, the edges drawn from the text's token before it (no official
    trainer is published; this is ours). Returns the drafter, its config.json and the held-out accuracy by row of
    the selector's first choice after the text's tokens."""
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    text = model.config.get_text_config()
    raw = dflash2.config_for(
        model.config,
        cfg.draft_layers,
        cfg.block_size,
        mask_token_id,
        DFLASH2_TAPS,
        math.gcd(DFLASH2_GROUP, text.hidden_size),
        DFLASH2_RANK,
        min(DFLASH2_TOP, text.vocab_size),
    )
    draft = dflash2.build(raw).to(device)
    with torch.no_grad():  # (zero codebooks would give the edges no gradient)
        for book in (draft.candidate_selector.predecessor_codebook, draft.candidate_selector.successor_codebook):
            book.normal_(0, 0.02, generator=torch.Generator(device).manual_seed(cfg.seed))
    embedding, lm, anchor_rng, weights = block_training(model, cfg)

    def rows(ids, features, logits):
        """(unary logits [B, N, bs - 1, V], selector scores [B, N, bs - 1, K], candidates, the target's logits)."""
        hidden, about, target = drafted_rows(draft, embedding, ids, features, logits, cfg, anchor_rng)
        unary = draft.logits(hidden, lm)
        values, candidates = unary.topk(draft.top_k, dim=-1)
        before = ids.gather(1, about.flatten(1)).view(about.shape)
        selector = draft.candidate_selector
        gated = selector.predecessor_codebook[before] * selector.hidden_projection(hidden)  # [B, N, bs - 1, r]
        scores = values + (gated[..., None, :] * selector.successor_codebook[candidates]).sum(-1)
        return unary, scores, candidates, target

    def loss(ids, features, logits):
        unary, scores, candidates, target = rows(ids, features, logits)
        per_row = -(F.softmax(target, dim=-1) * F.log_softmax(unary, dim=-1)).sum(-1)  # [B, N, bs - 1]
        chosen = F.softmax(target.gather(-1, candidates), dim=-1)  # the target's law over the candidates
        per_row = per_row - (chosen * F.log_softmax(scores, dim=-1)).sum(-1)
        return (per_row * weights).sum() / (weights.sum() * per_row[..., 0].numel())

    def depth_hits(ids, features, logits):
        _, scores, candidates, target = rows(ids, features, logits)
        first = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        return [_hits(first[:, :, k], target[:, :, k]) for k in range(cfg.block_size - 1)]

    layers = draft.feature_layers
    _loop("dflash2", list(draft.parameters()), loss, train, model, cfg, layers)
    return draft.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device, layers)


def dspark_config(target_config, cfg: TrainConfig, mask_token_id: int) -> dict:
    """The config.json `specbench train dspark` writes: DeepSpec's keys (`qwen3/config.py` build_draft_config) over
    DFlash's for the target, a confidence head reading the Markov embedding when there is one."""
    raw = dflash.config_for(target_config, cfg.draft_layers, cfg.block_size, mask_token_id)
    settings = raw.pop("dflash_config")
    return {
        **raw,
        "architectures": ["Qwen3DSparkModel"],
        "mask_token_id": mask_token_id,
        "target_layer_ids": settings["target_layer_ids"],
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head,
        "enable_confidence_head": True,
        "confidence_head_with_markov": cfg.markov_rank > 0,
    }


def train_dspark(model: Any, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, mask_token_id: int):
    """A DSpark drafter by DeepSpec's recipe (`deepspec/modeling/dspark/loss.py`, the released configs' weights):
    DFlash's blocks at random anchors, every row a draft (row k: the token k + 1 past its anchor), its logits
    Markov-corrected from the text's token before it; the loss 0.1 cross-entropy on the text's tokens + 0.9 the L1
    distance to the target's distribution, rows weighted exp(-k / 4), plus the confidence head's binary
    cross-entropy against each row's acceptance 1 - TV(draft, target). The embedding and readout are the target's,
    frozen. Returns the drafter, its config.json and its held-out accuracy by row (depths 1..block_size)."""
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    raw = dspark_config(model.config, cfg, mask_token_id)
    draft = dspark.build(raw)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight.float())
        draft.lm_head.weight.copy_(lm_head.weight.float())
    draft = draft.to(device)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    anchor_rng = torch.Generator().manual_seed(cfg.seed + 2)
    rows = torch.arange(cfg.block_size, device=device)
    weights = torch.exp(-rows.float() / 4.0)  # [bs]: DeepSpec's loss_decay_gamma 4

    def blocks(ids, features, logits):
        """(corrected draft logits, the target's logits [B, N, bs, V], the text's tokens [B, N, bs], each row's
        confidence logit [B, N, bs]) of one draw of anchors."""
        anchors = dflash_anchors(ids.shape[0], ids.shape[1] - 1, cfg, anchor_rng).to(device)  # (room for row bs)
        hidden = dflash_blocks(draft, draft.embed_tokens, ids, features, anchors)  # [B, N, bs, H]
        at = anchors[..., None] + rows  # [B, N, bs]: the position each row's token follows
        prev = ids.gather(1, at.flatten(1)).view(at.shape)  # the text's token before each row's
        drafted, state = draft.lm_head(hidden), None
        if draft.markov_head is not None:
            biases = []
            for k in range(cfg.block_size):
                bias, state = draft.markov_head.step(prev[..., k].flatten(), hidden[..., k, :].flatten(0, 1), state)
                biases.append(bias.view(*prev.shape[:2], -1))
            drafted = drafted + torch.stack(biases, dim=2)
        target = logits.gather(1, at.flatten(1)[..., None].expand(-1, -1, logits.shape[-1])).view(*at.shape, -1)
        text = ids.gather(1, (at + 1).flatten(1)).view(at.shape)
        confidence = draft.confidence_head(
            torch.cat([hidden, draft.markov_head.markov_w1(prev)], -1) if draft.with_markov else hidden
        )
        return drafted, target, text, confidence

    def loss(ids, features, logits):
        drafted, target, text, confidence = blocks(ids, features, logits)
        ce = F.cross_entropy(drafted.flatten(0, 2), text.flatten(), reduction="none").view(text.shape)
        distance = (F.softmax(drafted, -1) - F.softmax(target, -1)).abs().sum(-1)  # [B, N, bs]: 2 TV
        accept = (1 - distance / 2).clamp(0, 1).detach()
        fit = F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
        return 0.1 * weighted(ce) + 0.9 * weighted(distance) + weighted(fit)

    def weighted(per_row: torch.Tensor) -> torch.Tensor:
        """The rows' mean [B, N, bs] -> [], row k weighing weights[k]."""
        return (per_row * weights).sum() / (weights.sum() * per_row[..., 0].numel())

    def depth_hits(ids, features, logits):
        drafted, target, *_ = blocks(ids, features, logits)
        return [_hits(drafted[:, :, k].argmax(-1), target[:, :, k]) for k in range(cfg.block_size)]

    params = [p for p in draft.parameters() if p.requires_grad]
    _loop("dspark", params, loss, train, model, cfg, draft.feature_layers)
    return draft.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device, draft.feature_layers)


def train_pard(
    draft: Any, target: nn.Module, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, mask_id: int
):
    """Adapt `draft` (float32, trained in place) into a PARD drafter guessing cfg.pard_tokens tokens per forward,
    on the text's own next tokens (the target is not read). Returns it and its held-out top-1 accuracy by depth
    against the target's greedy tokens there."""
    device = draft.get_output_embeddings().weight.device
    draft.train().requires_grad_(True)
    rows = torch.Generator().manual_seed(cfg.seed + 2)

    def loss(ids):
        total = 0.0
        for window in ids.tolist():
            kept = pard.drop_rows(len(window), cfg.pard_tokens, cfg.drop_ratio, cfg.drop_floor, rows)
            example = pard.pard_example(window, kept, mask_id)
            total = total + F.cross_entropy(pard.forward_rows(draft, example), example[3].to(device))  # -100: none
        return total / len(ids)

    def depth_hits(ids, features, logits):
        counts = torch.zeros(cfg.pard_tokens, 2)  # per depth: hits, rows
        for window, greedy in zip(ids.tolist(), logits.argmax(-1), strict=True):
            kept = pard.drop_rows(len(window), cfg.pard_tokens, 1.0, 1.0, rows)  # every row
            example = pard.pard_example(window, kept, mask_id)
            positions, labels = example[1].to(device), example[3].to(device)
            right = (pard.forward_rows(draft, example).argmax(-1) == greedy[positions]).float()
            depth = torch.tensor(pard.depth_rows(kept), device=device) - 1
            valid = (labels >= 0).float()
            counts.index_add_(0, depth.cpu(), torch.stack([right * valid, valid], dim=1).cpu())
        return counts.tolist()

    _loop("pard", list(draft.parameters()), loss, train, None, cfg)
    draft.eval().requires_grad_(False)
    return draft, _evaluate(depth_hits, heldout, target, cfg, device)


def pard2_rows(
    draft: Any,
    proj: nn.Linear,
    scale: float,
    ids: torch.Tensor,
    states: torch.Tensor,
    kept: list[list[int]],
    mask_id: int,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PARD-2's training rows of windows ids [B, L] in one forward of the causal LM `draft`: PARD's rows
    (`pard.chain_rows` of `kept`: row (b, p) the real token p, or for b > 0 a mask at p after real tokens 0..p - b),
    each embedding plus scale * proj of the target's states [B, L, F] one row before its last real token (zero
    before row 0; `pard2_train.py`'s collator shifts the states so), times `keep` [B] (0: a window drafting without
    them). Returns the drafter's logits [B, Q, V], each row's block [Q] and position [Q]."""
    chains, allowed = pard.chain_rows(kept)
    block, position = (torch.tensor(x, device=ids.device) for x in zip(*chains, strict=True))
    tokens = torch.where(block == 0, ids[:, position], mask_id)  # [B, Q]
    shifted = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)  # row q: the states at q - 1
    added = scale * proj(shifted[:, position - block])  # [B, Q, H]
    if keep is not None:
        added = added * keep[:, None, None]
    embeds = draft.get_input_embeddings()(tokens) + added
    mask = additive_mask(allowed, embeds.dtype, ids.device).expand(len(ids), -1, -1, -1)
    out = draft(inputs_embeds=embeds, position_ids=position[None].expand(len(ids), -1), attention_mask=mask)
    return out.logits, block, position


PARD2_CE, PARD2_KD, PARD2_DROP = 0.1, 1.0, 0.1  # example_pard2_qwen3.yaml: ce_alpha, kd_alpha, target_feat_mask


def train_pard2(
    draft: Any,
    target: Any,
    train: torch.Tensor,
    heldout: torch.Tensor,
    cfg: TrainConfig,
    mask_id: int,
    compact: bool = False,
) -> tuple[Any, nn.Linear, dict, list[float]]:
    """A PARD-2 drafter from the causal LM `draft` (float32, trained in place) and a new target_proj, on PARD's
    conditional drop-token rows (`pard2_rows`) with `pard2_train.py`'s loss: PARD2_CE x cross-entropy on the text's
    next token plus PARD2_KD x KL from the target's distribution there, each row weighted by the target's
    probability of the tokens between its last real token and its label (the chance they were accepted); a window's
    states dropped with probability PARD2_DROP, so the drafter drafts without them too. `compact`: the drafter's
    embedding (and readout) are the target's, frozen, so the checkpoint leaves them out. Returns the drafter, its
    projection, config.json and its held-out top-1 accuracy by depth against the target's greedy tokens."""
    text = target.config.get_text_config()
    layers = pard2.official_layers(text.num_hidden_layers)
    ours = pard2.our_layers(layers, text.num_hidden_layers, "target")
    device = draft.get_output_embeddings().weight.device
    if compact:
        if draft.get_input_embeddings().weight.shape != target.get_input_embeddings().weight.shape:
            raise SpecbenchError(
                "--compact pard2 reads through the target's embedding: the draft model's width and vocabulary must be "
                "the target's (drop --compact)"
            )
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
            if draft.get_output_embeddings().weight is not draft.get_input_embeddings().weight:
                draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    generator = torch.Generator().manual_seed(cfg.seed)
    proj = nn.Linear(text.hidden_size * len(layers), draft.config.hidden_size, bias=False).to(device)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=generator) / proj.in_features**0.5)
    draft.train().requires_grad_(True)
    if compact:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    rows = torch.Generator().manual_seed(cfg.seed + 2)

    def forward(ids, states, ratio: float, floor: float, blocks: int, keep=None):
        kept = pard.drop_rows(ids.shape[1] - 1, blocks, ratio, floor, rows)  # (every row has a next token)
        return pard2_rows(draft, proj, pard2.SCALE, ids, states.to(device), kept, mask_id, keep)

    def loss(ids, states, logits):
        keep = (torch.rand(len(ids), generator=generator) >= PARD2_DROP).float().to(device)
        out, block, position = forward(ids, states, cfg.drop_ratio, cfg.drop_floor, cfg.pard_tokens, keep)
        teacher = logits.to(device)
        gold = torch.log_softmax(teacher[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, L - 1]: token q + 1
        before = F.pad(gold, (1, 0)).cumsum(1)  # [B, L]: log-probability of tokens 1..q
        weight = (before[:, position] - before[:, position - block]).exp()  # [B, Q]: tokens p - b + 1..p accepted
        log_q = torch.log_softmax(out.float(), -1)
        ce = F.nll_loss(log_q.transpose(1, 2), ids[:, position + 1], reduction="none")  # [B, Q]
        p = torch.softmax(teacher[:, position], -1)
        kd = (p * (torch.log(p.clamp_min(1e-30)) - log_q)).sum(-1)  # [B, Q]
        return ((PARD2_CE * ce + PARD2_KD * kd) * weight).sum() / weight.sum().clamp_min(1e-6)

    def depth_hits(ids, states, logits):
        out, block, position = forward(ids, states, 1.0, 1.0, cfg.pard_tokens)  # every chain to every depth
        right = (out.argmax(-1) == logits.to(device)[:, position].argmax(-1)).float().sum(0)  # [Q]
        return [(float(right[block == b].sum()), float((block == b).sum()) * len(ids)) for b in range(cfg.pard_tokens)]

    params = [p for p in [*draft.parameters(), *proj.parameters()] if p.requires_grad]
    _loop("pard2", params, loss, train, target, cfg, ours)
    draft.eval().requires_grad_(False)
    proj.eval().requires_grad_(False)
    raw = pard2.config_of(draft.config.to_dict(), mask_id, pard2.SCALE, False, layers, text.hidden_size)
    return draft, proj, raw, _evaluate(depth_hits, heldout, target, cfg, device, ours)


def mask_token(tokenizer, vocab: int) -> int:
    """The id a DFlash block's or a PARD drafter's mask rows carry: the tokenizer's mask token, else the
    vocabulary's last id (the released drafters use a reserved id the text never holds)."""
    found = getattr(tokenizer, "mask_token_id", None)
    return found if isinstance(found, int) and 0 <= found < vocab else vocab - 1


def train_head(
    kind: str,
    target: str,
    data: Path,
    out: Path,
    cfg: TrainConfig,
    device,
    dtype,
    smoke: bool,
    compact: bool = False,
    draft: str | None = None,
    layout: str = "official",
) -> dict:
    """Load the target (alias, folder or hub id), train a `kind` head on `data`, save it in the official
    layout (an EAGLE-3 head or DFlash drafter in vLLM's speculators format with `layout` "speculators") with
    accuracy.json beside it. Returns that report. A PARD drafter is made from `draft` (else the target alias's draft
    model); the target only scores it.

    `compact`: float16 storage, and an EAGLE-1/2 head or MTP module without the embedding (and readout) the
    loader copies from the target, as the bundled tiny heads are stored."""
    from ..models import aliases, loading
    from ..zoo.text import token_streams
    from . import eagle as eagle_heads
    from . import medusa as medusa_heads

    spec = aliases.resolve(target)
    folder = aliases.target_folder(spec)
    model = loading.load_causal_lm(folder, device, dtype, what="target").requires_grad_(False)
    verifier = {"name_or_path": spec.path, "architectures": list(model.config.architectures or [])}  # (speculators)
    tokenizer = loading.load_tokenizer(folder)
    train, heldout = token_streams(data, tokenizer, smoke)
    if kind == "medusa":
        heads, accuracy = train_medusa(model, train, heldout, cfg)
        medusa_heads.save(heads, out, spec.path, compact)
    elif kind == "eagle":
        head, raw, accuracy = train_eagle(model, train, heldout, cfg)
        state = head.state_dict()  # embedding included, as in the Vicuna heads, unless compact
        eagle_heads.save(
            {k: v for k, v in state.items() if not (compact and k == "embed_tokens.weight")}, raw, out, compact
        )
    elif kind == "mtp":
        head, accuracy = train_mtp(model, train, heldout, cfg)
        mtp.save(head, model.config, out, compact, with_shared=not compact)
    elif kind == "dflash":
        vocab = model.get_output_embeddings().weight.shape[0]
        head, raw, accuracy = train_dflash(model, train, heldout, cfg, mask_token(tokenizer, vocab))
        if layout == "speculators":
            speculators.write(speculators.dflash_speculators(raw, verifier), dflash.saved_state(head), out, compact)
        else:
            dflash.save(head, raw, out, compact)
    elif kind == "dflash2":
        vocab = model.get_output_embeddings().weight.shape[0]
        head, raw, accuracy = train_dflash2(model, train, heldout, cfg, mask_token(tokenizer, vocab))
        if layout == "speculators":
            speculators.write(speculators.dflash2_speculators(raw, verifier), dflash.saved_state(head), out, compact)
        else:
            dflash.save(head, raw, out, compact)
    elif kind == "dspark":
        vocab = model.get_output_embeddings().weight.shape[0]
        draft_model, raw, accuracy = train_dspark(model, train, heldout, cfg, mask_token(tokenizer, vocab))
        if layout == "speculators":
            raw = speculators.dspark_speculators(raw, verifier)
        speculators.write(raw, dspark.saved_state(draft_model, compact), out, compact)
    elif kind == "peagle":
        vocab = model.get_output_embeddings().weight.shape[0]
        head, raw, accuracy = train_peagle(model, train, heldout, cfg, mask_token(tokenizer, vocab))
        if layout == "speculators":
            layers = list(eagle3.feature_layers(model.config.get_text_config().num_hidden_layers))
            state = eagle3.saved_state(head)
            speculators.save_eagle3(state, raw, out, verifier, layers, compact, "peagle", cfg.pard_tokens)
        else:
            peagle.save(head, raw, out, compact)
    elif kind == "pard":
        source = aliases.draft_folder(spec, draft)
        drafter = loading.load_causal_lm(source, device, torch.float32, what="draft model")
        mask = mask_token(loading.load_tokenizer(source), drafter.get_output_embeddings().weight.shape[0])
        drafter, accuracy = train_pard(drafter, model, train, heldout, cfg, mask)
        pard.save(drafter, source, out, mask, compact)
    elif kind == "pard2":
        source = aliases.draft_folder(spec, draft)
        drafter = loading.load_causal_lm(source, device, torch.float32, what="draft model")
        mask = mask_token(loading.load_tokenizer(source), drafter.get_output_embeddings().weight.shape[0])
        drafter, proj, raw, accuracy = train_pard2(drafter, model, train, heldout, cfg, mask, compact)
        pard2.save(drafter, proj, raw, out, compact)
    else:
        head, raw, accuracy = train_eagle3(model, train, heldout, cfg)
        if layout == "speculators":
            layers = list(eagle3.feature_layers(model.config.get_text_config().num_hidden_layers))
            speculators.save_eagle3(eagle3.saved_state(head), raw, out, verifier, layers, compact)
        else:
            eagle3.save(head, raw, out, compact)
    if kind in ("eagle", "eagle3", "peagle"):
        frequencies.write(out, train, raw["vocab_size"], str(data))  # ranks `draft_vocab`
    report = {
        "kind": kind,
        "target": spec.path,
        "data": str(data),
        "train_tokens": len(train),
        "heldout_tokens": len(heldout),
        "config": asdict(cfg),
        "compact": compact,
        "target_signature": target_signature(model),  # checked when the head is loaded with a target
        "top1_accuracy_by_depth": accuracy,  # depth d: the head's first guess d tokens past the root
    }
    (out / "accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
