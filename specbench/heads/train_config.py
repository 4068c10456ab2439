"""The knobs of `specbench train`, each written once: its name, type, default and help are a field here; the
command's options are generated from the fields (`cli.parser`) and read back by name (`cli.handlers`), so renaming
or adding a field changes the command with no second edit."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import SpecbenchError


def knob(default: Any, help: str) -> Any:
    """A TrainConfig field: its default and the help `specbench train --help` shows."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    steps: int = knob(2000, "optimizer steps")
    lr: float | None = knob(None, "learning rate (default: 1e-3 for medusa, 3e-4 for the others)")
    seq_len: int = knob(256, "tokens per training window")
    batch_size: int = knob(8, "windows per step")
    eval_batches: int = knob(8, "held-out batches the accuracy is measured on")
    medusa_heads: int = knob(5, "medusa: number of heads (tree depth limit)")
    medusa_layers: int = knob(1, "medusa: residual blocks per head")
    medusa_shared_lm_head: bool = knob(
        False, "medusa: no projections of their own; each head reads out through the target's lm_head"
    )
    eagle_cls_weight: float = knob(0.1, "eagle: weight of the tokens' cross-entropy beside the features' smooth-L1")
    eagle_noise: float = knob(0.1, "eagle: uniform noise U(-a, a) on the input features (EAGLE-1 paper)")
    draft_vocab: int = knob(
        32000, "eagle3, peagle: draft vocabulary, the most frequent training tokens (at most the target's)"
    )
    ttt_steps: int = knob(7, "eagle3, mtp: steps of the training-time test (the reference unrolls 7)")
    ttt_decay: float = knob(0.8, "eagle3, mtp: step s's loss weighs ttt_decay ** (s - 1)")
    block_size: int = knob(16, "dflash, dflash2: rows per block, the root included (the released drafters' 16)")
    draft_layers: int = knob(3, "dflash, dflash2: drafter layers (= target layers read)")
    blocks: int = knob(32, "dflash, dflash2: blocks trained per window, at random distinct anchors")
    block_decay: float = knob(7.0, "dflash, dflash2: a block's row k weighs exp(-(k - 1) / block_decay) in the loss")
    markov_rank: int = knob(256, "dspark: rank of the Markov head (0: none; the released drafters' 256)")
    markov_head: str = knob("vanilla", "dspark: the Markov head, vanilla, gated or rnn")
    pard_tokens: int = knob(8, "pard, pard2, peagle: tokens guessed per forward (k - 1 mask blocks; the papers' 8)")
    drop_ratio: float = knob(
        0.7, "pard, pard2, peagle: mask block b keeps max(drop_ratio ** b, drop_floor) of its rows"
    )
    drop_floor: float = knob(0.2, "pard, pard2, peagle: the least share of rows a mask block keeps")
    seed: int = knob(0, "seed of the windows and the initial weights")

    def smoke(self) -> TrainConfig:
        """A few steps on short windows: the whole pipeline in seconds."""
        return replace(
            self,
            steps=min(self.steps, 5),
            seq_len=min(self.seq_len, 32),
            batch_size=2,
            eval_batches=1,
            block_size=min(self.block_size, 8),
            blocks=min(self.blocks, 4),
            pard_tokens=min(self.pard_tokens, 4),
        )


def train_config(kind: str, smoke: bool = False, lr: float | None = None, **knobs: Any) -> TrainConfig:
    """The TrainConfig of a `specbench train KIND` (knobs: TrainConfig's fields), checked, its learning rate set
    (`lr` None: 1e-3 for Medusa heads, 3e-4 for the others); `smoke`: a few tiny steps."""
    cfg = TrainConfig(lr=lr if lr is not None else 1e-3 if kind == "medusa" else 3e-4, **knobs)
    if (
        min(
            cfg.steps,
            cfg.seq_len,
            cfg.batch_size,
            cfg.medusa_heads,
            cfg.draft_vocab,
            cfg.ttt_steps,
            cfg.draft_layers,
            cfg.eval_batches,
            cfg.blocks,
            cfg.medusa_layers,
        )
        < 1
        or cfg.pard_tokens < 2
    ):
        raise SpecbenchError(
            "--steps, --batch-size, --eval-batches, --medusa-heads, --medusa-layers, --draft-vocab, "
            "--ttt-steps, --draft-layers and --blocks must be >= 1, --pard-tokens >= 2"
        )
    if cfg.seq_len < 8:
        raise SpecbenchError("--seq-len must be >= 8")
    if kind in ("dflash", "dspark") and not 2 <= cfg.block_size <= cfg.seq_len // 2:
        raise SpecbenchError(f"--block-size must be from 2 to half of --seq-len ({cfg.seq_len // 2})")
    if kind == "dspark" and (cfg.markov_rank < 0 or cfg.markov_head not in ("vanilla", "gated", "rnn")):
        raise SpecbenchError("--markov-rank must be >= 0 and --markov-head one of vanilla, gated, rnn")
    return cfg.smoke() if smoke else cfg
