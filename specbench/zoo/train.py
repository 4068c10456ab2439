"""Training loops: the target by next-token prediction or answer tuning, the draft by distillation from it."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from specbench.errors import SpecbenchError
from specbench.progress import Progress
from specbench.zoo import HISTORY
from specbench.zoo.evaluate import heldout_loss
from specbench.zoo.packing import batches
from specbench.zoo.plan import FamilyPlan
from specbench.zoo.unlikelihood import answer_loss, continuation_loss


@dataclass
class TrainLog:
    """Losses and budget of one training run."""

    name: str
    planned_steps: int
    peak_lr: float
    warmup: int
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    train: list[tuple[int, float]] = field(default_factory=list)  # (step, mean training loss since last log)
    heldout: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out next-token loss)


def read_history(family_dir: Path) -> list[TrainLog]:
    """The training runs recorded in a family folder, oldest first (none for a folder without a record)."""
    path = family_dir / HISTORY
    if not path.is_file():
        return []
    runs = json.loads(path.read_text(encoding="utf-8"))
    return [
        TrainLog(**{**r, "train": [tuple(x) for x in r["train"]], "heldout": [tuple(x) for x in r["heldout"]]})
        for r in runs
    ]


def write_history(family_dir: Path, logs: list[TrainLog]) -> Path:
    """Record every training run that produced the family's weights, so a continued build can extend it."""
    path = family_dir / HISTORY
    path.write_text(json.dumps([asdict(g) for g in logs], indent=1) + "\n", encoding="utf-8")
    return path


def _optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _lr_factor(step: int, warmup: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to a tenth of the peak as `progress` goes to 1."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def _loop(
    name: str,
    model: LlamaForCausalLM,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    docs: list[list[int]],
    heldout_rows: torch.Tensor,
    plan: FamilyPlan,
    steps: int,
    budget_s: float,
    seed: int,
    tags: list[list[int]] | None = None,
) -> TrainLog:
    """Train for `steps` steps, or fewer if `budget_s` seconds run out first.

    The cosine decay follows max(step / steps, elapsed / budget_s), so on a machine fast enough for the
    planned steps the run is exactly reproducible, and on a slower or busier one it still anneals and
    ends in time (the card records the steps actually taken).
    """
    torch.manual_seed(seed)
    log = TrainLog(name, steps, plan.lr, plan.warmup)
    opt = _optimizer(model, plan.lr)
    data = batches(docs, plan.seq_len, plan.batch, seed, tags)
    start, running, step, progress = time.perf_counter(), [], 0, 0.0
    bar = Progress(steps, f"train {name}", "steps")
    while progress < 1.0:
        step += 1
        lr = plan.lr * _lr_factor(step - 1, plan.warmup, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running.append(loss.item())
        log.tokens += x.shape[0] * plan.seq_len
        bar.update()
        elapsed = time.perf_counter() - start
        progress = max(step / steps, elapsed / budget_s)
        if step % plan.eval_every == 0 or progress >= 1.0:
            log.train.append((step, sum(running) / len(running)))
            log.heldout.append((step, heldout_loss(model, heldout_rows[: plan.eval_seqs], bf16=True)))
            running = []
            bar.write(
                f"[{name}] step {step}/{steps} train {log.train[-1][1]:.3f} heldout {log.heldout[-1][1]:.3f} "
                f"lr {lr:.2e} {log.tokens / elapsed:.0f} tok/s {elapsed / 60:.1f} min",
            )
    bar.close()
    log.steps, log.seconds = step, time.perf_counter() - start
    return log


def train_target(
    model: LlamaForCausalLM,
    docs: list[list[int]],
    heldout_rows: torch.Tensor,
    plan: FamilyPlan,
    seed: int,
    name: str = "target",
) -> TrainLog:
    """Next-token cross-entropy on every token of the packed conversations."""

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x, labels=x).loss

    return _loop(name, model, loss_fn, docs, heldout_rows, plan, plan.target_steps, plan.target_budget_s, seed)


def tune_target(
    model: LlamaForCausalLM,
    docs: list[list[int]],
    tags: list[list[int]],
    prompts: list[list[int]],
    heldout_rows: torch.Tensor,
    plan: FamilyPlan,
    seed: int,
    name: str,
) -> TrainLog:
    """Answer tuning: answer cross-entropy, token-level unlikelihood on that text, and sequence-level
    unlikelihood on greedy continuations of `prompts` (tokenised templated prompts), weights from `plan`."""
    rng = random.Random(seed)
    pool = [p for p in prompts if len(p) <= plan.continuation_prompt_tokens]
    if plan.sequence_unlikelihood and len(pool) < plan.continuation_batch:
        raise SpecbenchError(
            f"answer tuning needs {plan.continuation_batch} prompts of at most "
            f"{plan.continuation_prompt_tokens} tokens, the corpus has {len(pool)}"
        )
    eos = model.generation_config.eos_token_id

    def loss_fn(x: torch.Tensor) -> torch.Tensor:  # x: [B, 2, T] (ids, tags)
        ids, tok_tags = x[:, 0], x[:, 1]
        loss = answer_loss(model(input_ids=ids).logits, ids, tok_tags, plan.unlikelihood)
        if plan.sequence_unlikelihood:
            batch = rng.sample(pool, plan.continuation_batch)
            width = plan.continuation_prompt_tokens
            seq, attention = greedy_continuations(model, batch, plan.continuation_tokens, eos, width)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=seq, attention_mask=attention, position_ids=positions).logits
            loss = loss + plan.sequence_unlikelihood * continuation_loss(logits, seq, width)
        return loss

    steps, budget = plan.target_steps, plan.target_budget_s
    return _loop(name, model, loss_fn, docs, heldout_rows, plan, steps, budget, seed, tags)


@torch.no_grad()
def greedy_continuations(
    model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int, eos: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's greedy continuations of `prompts`, left-padded to `width` tokens, `new_tokens` long.

    The end of turn is suppressed: a continuation that could stop early would let the model escape the
    repeat penalty by answering in a few words (a first tuning run did exactly that). Fixed shapes step
    after step also let the CPU kernels be reused. Returns ids and attention mask, both [B, width + new].
    """
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    training = model.training
    model.eval()
    with torch.autocast("cpu", enabled=False):  # bfloat16 decoding on CPU re-plans its kernels every token
        out = model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    model.train(training)
    return out, torch.cat([attention, torch.ones(len(prompts), new_tokens, dtype=attention.dtype)], dim=1)


def distill_draft(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    docs: list[list[int]],
    heldout_rows: torch.Tensor,
    plan: FamilyPlan,
    seed: int,
    name: str = "draft",
) -> TrainLog:
    """Forward KL from the target's next-token distribution to the draft's, at every position."""
    target.eval()

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=x).logits.float(), dim=-1)
        student = F.log_softmax(draft(input_ids=x).logits.float(), dim=-1)
        return F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")

    return _loop(name, draft, loss_fn, docs, heldout_rows, plan, plan.draft_steps, plan.draft_budget_s, seed + 1)
