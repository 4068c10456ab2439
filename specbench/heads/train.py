"""Self-distillation of Medusa heads, EAGLE heads and MTP modules from a frozen target over text: the labels are the
target's own next-token distributions on that text (no generation), the inputs its hidden states (the final
ones; three inner ones for EAGLE-3).

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
from transformers import DynamicCache

from ..core.cached_lm import hidden_features
from ..core.tree import additive_mask
from ..errors import SpecbenchError
from ..progress import Progress
from . import eagle3, frequencies, mtp
from .checkpoint import target_signature
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
    medusa_shared_lm_head: bool = False  # no projection of their own: every head reads out through the target's
    eagle_cls_weight: float = 0.1  # EAGLE-1: smooth-L1 on features + 0.1 x cross-entropy on tokens
    eagle_noise: float = 0.1  # uniform noise on the input features, U(-a, a) (EAGLE-1 paper)
    draft_vocab: int = 32000  # EAGLE-3: the most frequent training tokens the draft predicts (capped at the vocab)
    ttt_steps: int = 7  # EAGLE-3: steps of the training-time test (the reference unrolls 7)
    ttt_decay: float = 0.8  # EAGLE-3: step s's loss weighs ttt_decay ** (s - 1)
    seed: int = 0

    def smoke(self) -> TrainConfig:
        """A few steps on short windows: the whole pipeline in seconds."""
        return replace(self, steps=min(self.steps, 5), seq_len=min(self.seq_len, 32), batch_size=2, eval_batches=1)


def train_config(kind: str, lr: float | None = None, smoke: bool = False, **sizes) -> TrainConfig:
    """The TrainConfig of a `specbench train KIND` (sizes: TrainConfig's fields), checked; lr by default 1e-3 for
    Medusa heads, 3e-4 for the others; `smoke`: a few tiny steps."""
    cfg = TrainConfig(lr=lr or (1e-3 if kind == "medusa" else 3e-4), **sizes)
    if min(cfg.steps, cfg.seq_len, cfg.batch_size, cfg.medusa_heads, cfg.draft_vocab, cfg.ttt_steps) < 1:
        raise SpecbenchError("--steps, --batch-size, --medusa-heads, --draft-vocab and --ttt-steps must be >= 1")
    if cfg.seq_len < 8:
        raise SpecbenchError("--seq-len must be >= 8")
    return cfg.smoke() if smoke else cfg


def windows(stream: torch.Tensor, cfg: TrainConfig, generator: torch.Generator, what: str) -> torch.Tensor:
    """A batch of random windows [B, L] of the token stream."""
    if len(stream) <= cfg.seq_len:
        raise SpecbenchError(f"the {what} has {len(stream)} tokens, not enough for --seq-len {cfg.seq_len}")
    start = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s : s + cfg.seq_len] for s in start.tolist()])


@torch.no_grad()
def target_pass(model: nn.Module, ids: torch.Tensor, layers: tuple[int, ...] = (-1,)) -> tuple[torch.Tensor, ...]:
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
    model: nn.Module,
    cfg: TrainConfig,
    layers: tuple[int, ...] = (-1,),
) -> None:
    """AdamW at a constant rate; loss_fn(ids, features, logits) on each batch of windows (features: `layers`)."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)
    bar = Progress(cfg.steps, f"train {name}", "steps")
    smooth = None
    for _ in range(cfg.steps):
        ids = windows(stream, cfg, generator, "training text")
        loss = loss_fn(ids.to(params[0].device), *target_pass(model, ids, layers))
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
    totals = 0
    for _ in range(cfg.eval_batches):
        ids = windows(heldout, cfg, generator, "held-out text")
        totals = totals + torch.tensor(depth_hits(ids.to(device), *target_pass(model, ids, layers)))  # [depths, 2]
    return [round(hits / max(total, 1), 4) for hits, total in totals.tolist()]


def _hits(guess: torch.Tensor, target_logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreements, positions) of guessed token ids [B, n] with the target's greedy tokens."""
    return float((guess == target_logits.argmax(-1)).sum()), float(guess.numel())


def train_medusa(model: nn.Module, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig):
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
        return [_hits(h.argmax(-1), t) for h, t in per_head(features, logits)]

    _loop("medusa", list(heads.parameters()), loss, train, model, cfg)
    return heads.eval(), _evaluate(depth_hits, heldout, model, cfg, device)


def unroll(
    head: EagleHead | eagle3.Eagle3Head, features: torch.Tensor, ids: torch.Tensor, steps: int
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


def train_eagle3(model: nn.Module, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, depths: int = 8):
    """An EAGLE-3 head by the training-time test: the draft unrolled cfg.ttt_steps steps on its own outputs,
    step s's loss weighted ttt_decay ** (s - 1); the draft vocabulary is the training text's most frequent
    tokens. Returns the head, its config.json and its per-step held-out accuracy (steps 1..depths)."""
    if cfg.ttt_steps >= cfg.seq_len:
        raise SpecbenchError(f"--ttt-steps {cfg.ttt_steps} leaves no position to train in --seq-len {cfg.seq_len}")
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    vocab = lm_head.weight.shape[0]
    layers = eagle3.feature_layers(model.config.get_text_config().num_hidden_layers)
    used = draft_vocabulary(train, vocab, min(cfg.draft_vocab, vocab))
    raw = config_from_target(model.config)
    raw["draft_vocab_size"] = len(used)
    head = eagle3.build(raw)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight.float())
        head.lm_head.weight.copy_(lm_head.weight[used.to(device)].float())  # start from the target's readout
    if head.d2t is not None:
        head.d2t, head.t2d = eagle3.vocabulary_maps(used, vocab)
    head = head.to(device)
    head.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen as in EAGLE-3

    def loss(ids, features, logits):
        pairs = ttt_pairs(head, features, ids, logits, cfg.ttt_steps)
        return sum(cfg.ttt_decay**s * draft_vocab_cross_entropy(d, t, head.t2d) for s, (d, t) in enumerate(pairs))

    def depth_hits(ids, features, logits):
        return [_hits(head.target_ids(d.argmax(-1)), t) for d, t in ttt_pairs(head, features, ids, logits, depths)]

    _loop("eagle3", [p for p in head.parameters() if p.requires_grad], loss, train, model, cfg, layers)
    return head.eval(), raw, _evaluate(depth_hits, heldout, model, cfg, device, layers)


def train_mtp(model: nn.Module, train: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, depths: int = 6):
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


def train_head(
    kind: str, target: str, data: Path, out: Path, cfg: TrainConfig, device, dtype, smoke: bool, compact: bool = False
) -> dict:
    """Load the target (alias, folder or hub id), train a `kind` head on `data`, save it in the official
    layout with accuracy.json beside it. Returns that report.

    `compact`: float16 storage, and an EAGLE-1/2 head or MTP module without the embedding (and readout) the
    loader copies from the target, as the bundled tiny heads are stored."""
    from ..models import aliases, loading
    from ..zoo.text import token_streams
    from . import eagle as eagle_heads
    from . import medusa as medusa_heads

    spec = aliases.resolve(target)
    folder = aliases.target_folder(spec)
    model = loading.load_causal_lm(folder, device, dtype, what="target").requires_grad_(False)
    train, heldout = token_streams(data, loading.load_tokenizer(folder), smoke)
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
    else:
        head, raw, accuracy = train_eagle3(model, train, heldout, cfg)
        eagle3.save(head, raw, out, compact)
    if kind in ("eagle", "eagle3"):
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
