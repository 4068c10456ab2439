"""DSpark drafters (DeepSeek, arXiv 2607.05147; deepseek-ai/DeepSpec): DFlash's backbone (`heads.dflash`) whose
block rows are corrected left to right by a low-rank Markov head, plus a confidence head. Every row of the block is
a draft, the anchor's (the last committed token's) included: row k guesses the token k + 1 places past the anchor.

- Markov head (`deepspec/modeling/dspark/markov_head.py`): row k's logits are lm_head(h_k) plus a bias from the
  token before it (the anchor for row 0, else the draft of row k - 1): `vanilla` W2(W1[prev]); `gated`
  W2(sigmoid(gate_proj([h_k; W1[prev]])) * W1[prev]); `rnn` a GRU-like state s (s_0 = 0):
  (g, c, o) = joint_proj([s; W1[prev]; h_k]), s' = sigmoid(g) s + (1 - sigmoid(g)) tanh(c), bias W2(tanh(o)).
- Confidence head (`common.py` AcceptRatePredictor, `modeling.py` predict_confidence_step): c_k =
  sigmoid(proj([h_k; W1[prev_k]])) (or of h_k alone without `confidence_head_with_markov`), the predicted chance
  that row k is accepted; DeepSpec's evaluator verifies the rows before the first c_k under its threshold.
- `confidence_temperatures` (ours, not DeepSpec's: `specbench calibrate` writes it, with `confidence_calibration`,
  what it was measured on): the paper's Sequential Temperature Scaling, c_k = sigmoid(logit_k / T_k), which the
  adaptive schedule weighs (`core.calibration`).

Checkpoint (DeepSpec's `Qwen3DSparkModel`, `qwen3/config.py` build_draft_config): config.json is the target's Qwen3
config plus `block_size`, `mask_token_id`, `target_layer_ids` (DeepSpec's numbering, as z-lab's),
`num_target_layers`, `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`;
model.safetensors holds DFlash's tensors plus its own `embed_tokens.weight` and `lm_head.weight` (frozen copies of
the target's: a compact checkpoint leaves them out, and the target's are copied), `markov_head.markov_w1.weight`
[V, R], `markov_head.markov_w2.weight` [V, R] (`gate_proj.{weight,bias}` gated, `joint_proj.{weight,bias}` rnn) and
`confidence_head.proj.{weight,bias}`. vLLM's speculators `dspark` type loads too (`heads.speculators`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config

from ..core.calibration import scaled
from ..errors import SpecbenchError
from ..registry import HeadFamily, head_family
from . import dflash, speculators
from .checkpoint import check, read_weights
from .folder import HEAD_LAYOUTS

TITLE = "DSpark drafter"
MARKOV = ("vanilla", "gated", "rnn")


class Markov(nn.Module):
    """The Markov head: a bias on row k's logits from the token before it (module docstring)."""

    def __init__(self, kind: str, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(
        self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bias [m, V] of a row from the token before it [m] and the row's state [m, H], and the recurrent state
        after it (rnn; None otherwise)."""
        embedded = self.markov_w1(prev)  # [m, R]
        if self.kind == "vanilla":
            return self.markov_w2(embedded), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1)))
            return self.markov_w2(gate * embedded), None
        state = embedded.new_zeros(embedded.shape) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)), state


class Confidence(nn.Module):
    """DeepSpec's AcceptRatePredictor: one logit per row."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraft(dflash.DFlashDraft):
    def __init__(self, config: Qwen3Config, layer_ids: list[int], block_size: int, mask_token_id: int) -> None:
        super().__init__(config, layer_ids, block_size, mask_token_id, config.hidden_size)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        rank = int(getattr(config, "markov_rank", 0) or 0)
        kind = str(getattr(config, "markov_head_type", "vanilla")).lower()
        self.markov_head = Markov(kind, vocab, rank, hidden) if rank > 0 else None
        self.with_markov = bool(getattr(config, "confidence_head_with_markov", False)) and rank > 0
        enabled = bool(getattr(config, "enable_confidence_head", False))
        self.confidence_head = Confidence(hidden + (rank if self.with_markov else 0)) if enabled else None
        self.temperatures: list[float] = list(getattr(config, "confidence_temperatures", None) or [])  # STS's

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor, calibrated: bool = False) -> torch.Tensor:
        """Each row's predicted acceptance in [0, 1] [..., k] from its state [..., k, H] and the token before it
        [..., k]; `calibrated`: each row's logit divided by its STS temperature (`confidence_temperatures`)."""
        return torch.sigmoid(scaled(self.confidence_logits(hidden, prev), self.temperatures if calibrated else None))

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head's logits [..., k] (`confidence` before its sigmoid)."""
        assert self.confidence_head is not None
        if self.with_markov:
            assert self.markov_head is not None
            hidden = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
        return self.confidence_head(hidden).float()


def build(raw: dict) -> DSparkDraft:
    """The drafter a config.json describes (random weights)."""
    settings = {k: raw.get(k) for k in ("target_layer_ids", "mask_token_id", "block_size")}
    config, layer_ids, block, mask = dflash.settings_of({**raw, "dflash_config": settings}, TITLE)
    rank, kind = raw.get("markov_rank", 0), str(raw.get("markov_head_type", "vanilla")).lower()
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise SpecbenchError(f"{TITLE} config.json: markov_rank must be a whole number >= 0, not {rank!r}")
    if rank and kind not in MARKOV:
        raise SpecbenchError(f"{TITLE} config.json: markov_head_type '{kind}' is none of {', '.join(MARKOV)}")
    temperatures = raw.get("confidence_temperatures")
    if temperatures is not None and not (
        isinstance(temperatures, list)
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in temperatures)
    ):
        raise SpecbenchError(
            f"{TITLE} config.json: confidence_temperatures must be a list of positive numbers (one a row), not "
            f"{temperatures!r}: calibrate again with `specbench calibrate`"
        )
    return DSparkDraft(config, layer_ids, block, mask)


def load(source: str | Path, target_model: Any) -> DSparkDraft:
    """DeepSpec's layout, checked against the target: its width, vocabulary and layers."""
    what = f"{TITLE} '{source}'"
    raw, shipped_as_speculators = speculators.official(source, "dspark", TITLE)
    draft = build(raw)
    vocab, hidden = target_model.get_output_embeddings().weight.shape
    layers = target_model.config.get_text_config().num_hidden_layers
    if (draft.config.hidden_size, draft.config.vocab_size) != (hidden, vocab):
        raise SpecbenchError(
            f"{what} is for hidden size {draft.config.hidden_size} and vocabulary {draft.config.vocab_size}, the "
            f"target has {hidden} and {vocab}: use a drafter trained for this target"
        )
    if raw.get("num_target_layers", layers) != layers or max(draft.layer_ids) >= layers:
        raise SpecbenchError(
            f"{what} reads target layers {draft.layer_ids} of {raw.get('num_target_layers', '?')}, the target has "
            f"{layers}: use a drafter trained for this target"
        )
    state = read_weights(source, dflash.FILES, TITLE)
    if shipped_as_speculators:
        state = speculators.dflash_official_state(state)
    state.pop("rotary_emb.inv_freq", None)
    for key, module in (
        ("embed_tokens.weight", target_model.get_input_embeddings()),
        ("lm_head.weight", target_model.get_output_embeddings()),
    ):
        if key not in state:  # (a compact checkpoint: the released ones hold frozen copies of the target's)
            state[key] = module.weight.detach().cpu()
    check({k: v.shape for k, v in dflash.saved_state(draft).items()}, state, what)
    draft.load_state_dict(state, strict=False)
    return draft


def saved_state(draft: DSparkDraft, compact: bool = False) -> dict[str, torch.Tensor]:
    """The tensors a drafter is stored with; `compact`: without the embedding and readout (the target's)."""
    state = dflash.saved_state(draft)
    return {k: v for k, v in state.items() if not (compact and k in ("embed_tokens.weight", "lm_head.weight"))}


def fits(folder: Path) -> tuple[int, int | None]:
    config = speculators.official(folder, "dspark", TITLE)[0]
    if not isinstance(config.get("hidden_size"), int):
        raise SpecbenchError(f"{TITLE} '{folder}': config.json has no hidden_size")
    return config["hidden_size"], config.get("vocab_size")


FAMILY = head_family(HeadFamily("dspark", "DSpark", HEAD_LAYOUTS["dspark"], load, fits))
