"""Answer tuning loss: cross-entropy on answer tokens plus token-level unlikelihood on repeats.

Token-level unlikelihood (Welleck et al., 2019, "Neural text generation with unlikelihood training")
pushes down the probability of tokens that already occurred earlier in the same answer, except the true
next token. It is the standard cure for the greedy loops a small MLE-trained model falls into. The
prompt is not a candidate source: copying from the article or the question is legitimate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PROMPT = 0  # tag of prompt tokens; answer tokens carry their conversation's number (1, 2, ...)


def answer_tags(prompt_len: int, length: int, conversation: int) -> list[int]:
    """Per-token tags of one tokenised conversation: PROMPT for its first `prompt_len` tokens, then its number."""
    if conversation <= PROMPT:
        raise ValueError("conversation numbers start at 1")
    return [PROMPT] * prompt_len + [conversation] * (length - prompt_len)


def repeat_candidates(ids: torch.Tensor, tags: torch.Tensor, vocab: int) -> torch.Tensor:
    """Which tokens to push down when predicting each next answer token.

    ids, tags: [B, T]. Returns bool [B, T-1, V]: entry (b, t, v) is set when position t+1 is an answer
    token, v occurred at some answer position j <= t of the same conversation, and v != ids[b, t+1].
    """
    answer = tags != PROMPT
    b, length = ids.shape
    onehot = torch.zeros(b, length, vocab, dtype=torch.int16)
    onehot.scatter_(2, ids.unsqueeze(-1), answer.unsqueeze(-1).to(torch.int16))
    seen = onehot.cumsum(1, dtype=torch.int16)  # [B, T, V]: answer occurrences of v at positions <= t
    t = torch.arange(ids.shape[1]).expand_as(ids)
    # start of each position's answer run (a run = consecutive positions with the same non-prompt tag)
    run_start = torch.where(answer & ~_continues(tags), t, torch.zeros_like(t))
    run_start = run_start.cummax(1).values  # [B, T]
    # occurrences before the run that position t+1 belongs to must not count
    before = (run_start[:, 1:] - 1).clamp(min=0)  # [B, T-1]
    base = seen.gather(1, before.unsqueeze(-1).expand(-1, -1, vocab))
    base = base * (run_start[:, 1:] > 0).unsqueeze(-1)
    counts = seen[:, :-1] - base  # [B, T-1, V]
    same_run = answer[:, 1:] & (tags[:, 1:] == tags[:, :-1])
    cand = (counts > 0) & same_run.unsqueeze(-1)
    return cand.scatter_(2, ids[:, 1:].unsqueeze(-1), False)


def _continues(tags: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: position t has the same tag as position t-1 (False at t = 0)."""
    same = torch.zeros_like(tags, dtype=torch.bool)
    same[:, 1:] = tags[:, 1:] == tags[:, :-1]
    return same


def answer_loss(logits: torch.Tensor, ids: torch.Tensor, tags: torch.Tensor, alpha: float) -> torch.Tensor:
    """Mean over next-answer-token positions of CE + alpha * sum over repeat candidates of -log(1 - p).

    logits: [B, T, V] for ids [B, T]; position t predicts ids[t+1]. Rows without answer tokens add nothing.
    """
    logits = logits[:, :-1].float()
    targets = ids[:, 1:]
    predict = tags[:, 1:] != PROMPT  # [B, T-1]
    n = predict.sum().clamp(min=1)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    loss = (ce * predict).sum() / n
    if alpha == 0:
        return loss
    p = logits.softmax(-1)
    cand = repeat_candidates(ids, tags, logits.shape[-1])
    ul = -(torch.log1p(-p.clamp(max=1 - 1e-5)) * cand).sum()
    return loss + alpha * ul / n


def repeated_ngram_mask(ids: list[int], n: int = 4) -> list[bool]:
    """Which tokens belong to an n-gram that already occurred earlier in `ids` (sequence-level candidates).

    Sequence-level unlikelihood (same paper) penalises exactly these tokens of the model's own greedy
    continuations, which is what breaks loops that token-level training on reference text leaves.
    """
    seen: set[tuple[int, ...]] = set()
    mask = [False] * len(ids)
    for start in range(len(ids) - n + 1):
        gram = tuple(ids[start : start + n])
        if gram in seen:
            mask[start : start + n] = [True] * n
        seen.add(gram)
    return mask


def continuation_loss(logits: torch.Tensor, ids: torch.Tensor, start: int, n: int = 4) -> torch.Tensor:
    """Sequence-level unlikelihood: mean over continuation tokens of -log(1 - p) on repeated n-grams.

    logits: [B, L, V] for ids [B, L]; the continuation is ids[:, start:].
    """
    cont = ids[:, start:]
    mask = torch.tensor([repeated_ngram_mask(row.tolist(), n) for row in cont])
    p = logits[:, start - 1 : -1].float().softmax(-1).gather(-1, cont.unsqueeze(-1)).squeeze(-1)  # [B, N]
    return -(torch.log1p(-p.clamp(max=1 - 1e-5)) * mask).sum() / cont.numel()
