"""Measurements for the model card: held-out loss, draft/target agreement, decode time, generations."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BatchEncoding, DynamicCache, LlamaForCausalLM, PreTrainedTokenizerFast

from ..core.cached_lm import cache_argument

_EVAL_BATCH = 4


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, rows: torch.Tensor, *, bf16: bool = False) -> float:
    """Mean next-token cross-entropy over packed held-out rows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), _EVAL_BATCH):
        x = rows[i : i + _EVAL_BATCH]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits.float()
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


@dataclass
class Agreement:
    """How often the draft proposes what the target would emit, over held-out positions."""

    greedy: float  # P(argmax draft == argmax target)
    sampled: float  # E[sum_v min(p_target, q_draft)]: acceptance rate of one speculative-sampling proposal


@torch.no_grad()
def agreement(target: LlamaForCausalLM, draft: LlamaForCausalLM, rows: torch.Tensor) -> Agreement:
    """Top-1 agreement and expected speculative-sampling acceptance of `draft` against `target`."""
    target.eval()
    draft.eval()
    same, overlap, count = 0, 0.0, 0
    for i in range(0, len(rows), _EVAL_BATCH):
        x = rows[i : i + _EVAL_BATCH]
        p = target(input_ids=x).logits.float().softmax(-1)
        q = draft(input_ids=x).logits.float().softmax(-1)
        same += (p.argmax(-1) == q.argmax(-1)).sum().item()
        overlap += torch.minimum(p, q).sum(-1).sum().item()
        count += x.numel()
    return Agreement(same / count, overlap / count)


@torch.no_grad()
def decode_ms(model: LlamaForCausalLM, *, cache_len: int, new_tokens: int, repeats: int, seed: int) -> float:
    """Median milliseconds of one forward over `new_tokens` tokens on top of a `cache_len`-token KV cache."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    keyword = cache_argument(type(model))  # type: ignore[arg-type]  # a class is hashable
    model(input_ids=torch.randint(vocab, (1, cache_len), generator=gen), **{keyword: cache}, use_cache=True)
    times = []
    for _ in range(repeats + 2):  # the first two warm up
        x = torch.randint(vocab, (1, new_tokens), generator=gen)
        start = time.perf_counter()
        model(input_ids=x, **{keyword: cache}, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-new_tokens)  # back to `cache_len` tokens
    return 1000 * statistics.median(times[2:])


@torch.no_grad()
def greedy_answer(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, new_tokens: int
) -> list[int]:
    """Token ids of the greedy answer to a single-turn chat `prompt`."""
    model.eval()
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        enable_thinking=False,  # as runs render prompts (models.chat.prompt_ids): Qwen3's template would think
        return_tensors="pt",
        return_dict=True,
    )
    assert isinstance(encoded, BatchEncoding)  # return_dict=True
    ids = encoded["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
    return out[0, ids.shape[1] :].tolist()


def ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    """All n-grams of `ids`, in order."""
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def distinct2(ids: list[int]) -> float:
    """Unique bigrams over bigrams (1.0 for outputs too short to have any)."""
    grams = ngrams(ids, 2)
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated4(ids: list[int]) -> float:
    """Share of 4-grams that already occurred earlier in the same output."""
    seen, repeats, grams = set(), 0, ngrams(ids, 4)
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams) if grams else 0.0


VICUNA_ANSWERS = "spec_bench_model_answers/vicuna-7b-v1.3-vanilla-float16-temp-0.0.jsonl"


@dataclass
class Degeneracy:
    """Mean distinct-2 and repeated-4 over a set of answers."""

    label: str
    answers: int
    distinct2: float
    repeated4: float


def degeneracy(label: str, answers: list[list[int]]) -> Degeneracy:
    """Mean degeneracy statistics of token-id answers."""
    n = len(answers)
    return Degeneracy(label, n, sum(map(distinct2, answers)) / n, sum(map(repeated4, answers)) / n)


def vicuna_reference(data_dir: Path, tokenizer: PreTrainedTokenizerFast, max_tokens: int) -> list[Degeneracy]:
    """Vicuna-7B's own greedy Spec-Bench answers (every turn, cut to `max_tokens` of our tokenizer), as a bar.

    Empty when the answer file is not in `data_dir`.
    """
    path = data_dir / VICUNA_ANSWERS
    if not path.is_file():
        return []
    turns: dict[str, list[list[int]]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            for text in row["choices"][0]["turns"]:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
                turns.setdefault(row["category"], []).append(ids)
    groups = {
        "Vicuna-7B-v1.3, all Spec-Bench answers": [ids for group in turns.values() for ids in group],
        "Vicuna-7B-v1.3, math_reasoning (GSM8K)": turns.get("math_reasoning", []),
    }
    return [degeneracy(label, answers) for label, answers in groups.items() if answers]
