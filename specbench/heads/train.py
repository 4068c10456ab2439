"""Self-distillation of Medusa heads and EAGLE heads from a frozen target over text: the labels are the
target's own next-token distributions on that text (no generation), the inputs its final hidden states.

Per-depth top-1 accuracy on held-out text is the share of positions where the head's first guess at depth
d equals the target's greedy token there (tokens in between taken from the text).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache

from ..errors import SpecbenchError
from ..tree import additive_mask
from .eagle import EagleHead, build, config_from_target
from .medusa import MedusaHeads


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    lr: float = 1e-3
    seq_len: int = 256
    batch_size: int = 8
    eval_batches: int = 8  # held-out windows = eval_batches x batch_size
    medusa_heads: int = 5
    medusa_layers: int = 1
    eagle_cls_weight: float = 0.1  # EAGLE-1: smooth-L1 on features + 0.1 x cross-entropy on tokens
    eagle_noise: float = 0.1  # uniform noise on the input features, U(-a, a) (EAGLE-1 paper)
    seed: int = 0

    def smoke(self) -> TrainConfig:
        """A few steps on short windows: the whole pipeline in seconds."""
        return replace(self, steps=min(self.steps, 5), seq_len=min(self.seq_len, 32), batch_size=2, eval_batches=1)


def windows(stream: torch.Tensor, cfg: TrainConfig, generator: torch.Generator, what: str) -> torch.Tensor:
    """A batch of random windows [B, L] of the token stream."""
    if len(stream) <= cfg.seq_len:
        raise SpecbenchError(f"the {what} has {len(stream)} tokens, not enough for --seq-len {cfg.seq_len}")
    start = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s : s + cfg.seq_len] for s in start.tolist()])


@torch.no_grad()
def target_pass(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final normalised hidden states [B, L, H] and logits [B, L, V] in float32."""
    device = next(model.parameters()).device
    hidden = model.get_decoder()(input_ids=ids.to(device)).last_hidden_state
    return hidden.float(), model.get_output_embeddings()(hidden).float()


def frozen_float(module: nn.Module) -> nn.Module:
    """A float32 copy to train against, leaving the target in its own dtype."""
    return copy.deepcopy(module).float().requires_grad_(False)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's logits against the target's next-token distributions, per position."""
    return -(target_probs * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def _loop(name: str, params: list[nn.Parameter], loss_fn, stream: torch.Tensor, model, cfg: TrainConfig) -> None:
    """AdamW at a constant rate; loss_fn(ids, features, logits) on each batch of windows."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(range(cfg.steps), desc=f"train {name}", unit="step", leave=False, disable=None)
    for _ in bar:
        ids = windows(stream, cfg, generator, "training text")
        loss = loss_fn(ids.to(params[0].device), *target_pass(model, ids))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")


@torch.no_grad()
def _evaluate(depth_hits, heldout: torch.Tensor, model: nn.Module, cfg: TrainConfig, device) -> list[float]:
    """Per-depth top-1 accuracy over held-out windows; depth_hits(ids, features, logits) -> [(hits, total)]."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    totals = 0
    for _ in range(cfg.eval_batches):
        ids = windows(heldout, cfg, generator, "held-out text")
        totals = totals + torch.tensor(depth_hits(ids.to(device), *target_pass(model, ids)))  # [depths, 2]
    return [round(hits / max(total, 1), 4) for hits, total in totals.tolist()]


def _hits(guess: torch.Tensor, target_logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreements, positions) of guess logits [B, n, V] with the target's greedy tokens."""
    return float((guess.argmax(-1) == target_logits.argmax(-1)).sum()), float(guess.shape[0] * guess.shape[1])


def train_medusa(model: nn.Module, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig):
    """Medusa-1 heads (own projection initialised from the target's lm_head; blocks start as the identity).
    Returns the heads and their per-depth held-out accuracy."""
    lm_head = model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    device = lm_head.weight.device
    heads = MedusaHeads(cfg.medusa_heads, cfg.medusa_layers, hidden, vocab).to(device)
    for head in heads:
        head[-1].weight.data.copy_(lm_head.weight.float())
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
        return [_hits(h, t) for h, t in per_head(features, logits)]

    _loop("medusa", list(heads.parameters()), loss, train, model, cfg)
    return heads.eval(), _evaluate(depth_hits, heldout, model, cfg, device)


def unroll(head: EagleHead, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The draft's chains from every position at once, as in tree drafting: step 1 reads the target's features
    (row i: feature i, token i + 1); step s > 1 reads its own step s - 1 output and the text's next token,
    seeing the target-fed rows up to its anchor and its own chain. Per step, predicted features [B, L-1, H]
    whose row i is the feature at position i + s (valid while i + s < L)."""
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


def train_eagle(model: nn.Module, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, depths: int = 6):
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
        return [_hits(lm(x[:, : ids.shape[1] - s]), logits[:, s:]) for s, x in enumerate(steps, 1)]

    _loop("eagle", [p for p in head.parameters() if p.requires_grad], loss, train, model, cfg)
    return head.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device)


def train_head(kind: str, target: str, data: Path, out: Path, cfg: TrainConfig, device, dtype, smoke: bool) -> dict:
    """Load the target (alias, folder or hub id), train a `kind` head on `data`, save it in the official
    layout with accuracy.json beside it. Returns that report."""
    from .. import models
    from . import eagle as eagle_heads
    from . import medusa as medusa_heads
    from .data import token_streams

    spec = models.resolve(target)
    model = models.load_causal_lm(spec.path, device, dtype, what="target").requires_grad_(False)
    train, heldout = token_streams(data, models.load_tokenizer(spec.path), smoke)
    if kind == "medusa":
        heads, accuracy = train_medusa(model, train, heldout, cfg)
        medusa_heads.save(heads, out, spec.path)
    else:
        head, raw, accuracy = train_eagle(model, train, heldout, cfg)
        eagle_heads.save(head, raw, out)
    report = {
        "kind": kind,
        "target": spec.path,
        "data": str(data),
        "train_tokens": len(train),
        "heldout_tokens": len(heldout),
        "config": asdict(cfg),
        "top1_accuracy_by_depth": accuracy,  # depth d: the head's first guess d tokens past the root
    }
    (out / "accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
