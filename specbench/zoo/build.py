"""Building the whole tiny family: corpus, tokenizer, target, draft, saved folders and model card."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specbench.errors import SpecbenchError
from specbench.progress import Progress
from specbench.zoo.card import CardData, Model, Sample, write_card
from specbench.zoo.corpus import Conversation, Corpus, build_corpus
from specbench.zoo.evaluate import (
    agreement,
    decode_ms,
    degeneracy,
    distinct2,
    greedy_answer,
    heldout_loss,
    repeated4,
    vicuna_reference,
)
from specbench.zoo.models import draft_from_target, llama_config, new_model, parameter_count
from specbench.zoo.packing import pack
from specbench.zoo.plan import CONTINUED, FULL, SMOKE, SMOKE_CONTINUED, SMOKE_TUNED, TUNED, FamilyPlan
from specbench.zoo.prompts import GENERAL, gsm8k_test, quick_first_turns
from specbench.zoo.save import save_model
from specbench.zoo.tokenizer import train_tokenizer
from specbench.zoo.train import (
    HISTORY,
    TrainLog,
    distill_draft,
    read_history,
    train_target,
    tune_target,
    write_history,
)
from specbench.zoo.unlikelihood import answer_tags

CACHE_LEN = 200


def _tokenize(tokenizer: PreTrainedTokenizerFast, conversations: list[Conversation]) -> list[list[int]]:
    texts = [c.render(tokenizer.bos_token, tokenizer.eos_token) for c in conversations]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _describe(name: str, path: Path, rows: torch.Tensor, plan: FamilyPlan) -> tuple[Model, torch.nn.Module]:
    """Reload a saved model as shipped and measure its held-out loss and decode time."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    ms = [decode_ms(model, cache_len=CACHE_LEN, new_tokens=k, repeats=plan.timing_repeats, seed=0) for k in (1, 16)]
    loss = heldout_loss(model, rows)
    card = Model(name, parameter_count(model), cfg.num_hidden_layers, cfg.hidden_size, loss, ms[0], ms[1])
    return card, model


def _corpus(data_dir: Path, plan: FamilyPlan, seed: int) -> Corpus:
    corpus = build_corpus(
        data_dir,
        seed=seed,
        heldout_frac=plan.heldout_frac,
        max_article_chars=plan.max_article_chars,
        per_source_limit=plan.per_source_limit,
    )
    tqdm.write(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out conversations")
    return corpus


def build_family(out_dir: Path, data_dir: Path, *, smoke: bool = False, seed: int = 0) -> Path:
    """Train and save the tiny target/draft family into `out_dir`; return the model card's path.

    `smoke` runs the same pipeline in seconds on a corpus sample with toy sizes (for tests).
    """
    plan = SMOKE if smoke else FULL
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(data_dir, plan, seed)
    tokenizer = train_tokenizer((c.render() for c in corpus.train), plan.vocab_size)
    docs = _tokenized(tokenizer, corpus)
    train_docs, heldout_rows = docs[0], pack(docs[1], plan.seq_len)
    target = new_model(llama_config(plan.target, tokenizer), seed)
    target_log = train_target(target, train_docs, heldout_rows, plan, seed)
    draft = draft_from_target(target, plan.draft_layers, seed)
    draft_log = distill_draft(draft, target, train_docs, heldout_rows, plan, seed)
    return _finish(
        out_dir, data_dir, (target, draft, tokenizer), corpus, docs, plan, seed, [target_log, draft_log], start
    )


def continue_family(
    family_dir: Path, data_dir: Path, *, smoke: bool = False, seed: int = 0, tune: bool = False
) -> Path:
    """Train a saved family further: the target from its weights, then the draft against the new target.

    The corpus, split and tokenizer are the family's own (same seed); the data order is reshuffled. The
    runs are appended to the family's training log, and the card is rewritten with all of them. With
    `tune`, the target stage is answer tuning (answer tokens only, repeat unlikelihood) instead of more
    next-token training on all text.
    """
    plan = (SMOKE_TUNED if tune else SMOKE_CONTINUED) if smoke else (TUNED if tune else CONTINUED)
    history = read_history(family_dir)
    if not history:
        raise SpecbenchError(f"{family_dir} has no {HISTORY}: build it first with `specbench zoo build`")
    start = time.perf_counter()
    corpus = _corpus(data_dir, plan, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(family_dir / "target")
    docs = _tokenized(tokenizer, corpus)
    train_docs, heldout_rows = docs[0], pack(docs[1], plan.seq_len)
    target = AutoModelForCausalLM.from_pretrained(family_dir / "target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(family_dir / "draft", dtype=torch.float32)
    stage = 1 + sum(g.name.startswith("target") for g in history)
    target_seed = seed + 2 * stage
    if tune:
        bos = tokenizer.bos_token
        prompts = tokenizer([c.render_prompt(bos) for c in corpus.train], add_special_tokens=False)["input_ids"]
        tags = _answer_tags(prompts, train_docs)
        name = f"target (stage {stage}, answer tuning)"
        target_log = tune_target(target, train_docs, tags, prompts, heldout_rows, plan, target_seed, name)
    else:
        target_log = train_target(target, train_docs, heldout_rows, plan, target_seed, f"target (stage {stage})")
    draft_log = distill_draft(
        draft, target, train_docs, heldout_rows, plan, seed + 2 * stage + 1, f"draft (stage {stage})"
    )
    logs = [*history, target_log, draft_log]
    return _finish(family_dir, data_dir, (target, draft, tokenizer), corpus, docs, plan, seed, logs, start)


def _answer_tags(prompts: list[list[int]], docs: list[list[int]]) -> list[list[int]]:
    """Per-token tags (prompt or the conversation's number) of tokenised conversations.

    The prompt is the longest common prefix of the conversation's tokens and its templated prompt's
    tokens, so a token merged across the boundary counts as answer.
    """
    tags = []
    for number, (doc, prompt) in enumerate(zip(docs, prompts, strict=True), start=1):
        pairs = enumerate(zip(doc, prompt, strict=False))
        common = next((i for i, (a, b) in pairs if a != b), min(len(doc), len(prompt)))
        tags.append(answer_tags(common, len(doc), number))
    return tags


def _tokenized(tokenizer: PreTrainedTokenizerFast, corpus: Corpus) -> tuple[list[list[int]], list[list[int]]]:
    """Training and held-out conversations as token ids."""
    train_docs, heldout_docs = _tokenize(tokenizer, corpus.train), _tokenize(tokenizer, corpus.heldout)
    tqdm.write(f"tokenizer: vocabulary {len(tokenizer)}, {sum(map(len, train_docs))} training tokens")
    return train_docs, heldout_docs


def _finish(
    out_dir: Path,
    data_dir: Path,
    models: tuple[torch.nn.Module, torch.nn.Module, PreTrainedTokenizerFast],
    corpus: Corpus,
    docs: tuple[list[list[int]], list[list[int]]],
    plan: FamilyPlan,
    seed: int,
    logs: list[TrainLog],
    start: float,
) -> Path:
    """Save both models and the training log, measure them as shipped, write the model card."""
    target, draft, tokenizer = models
    save_model(target, tokenizer, out_dir / "target")
    save_model(draft, tokenizer, out_dir / "draft")
    write_history(out_dir, logs)
    train_docs, heldout_docs = docs
    rows = pack(heldout_docs, plan.seq_len)[: plan.card_eval_seqs]
    target_card, target = _describe("target", out_dir / "target", rows, plan)
    draft_card, draft = _describe("draft", out_dir / "draft", rows, plan)
    gsm8k, others = gsm8k_test(data_dir, plan.gsm8k_prompts), quick_first_turns() + GENERAL
    samples, answers = [], []
    bar = Progress(len(gsm8k + others), "greedy samples", "prompts")
    for prompt in gsm8k + others:
        ids = greedy_answer(target, tokenizer, prompt, plan.gen_new_tokens)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        samples.append(Sample(prompt, text, len(ids), distinct2(ids), repeated4(ids)))
        answers.append(ids)
        bar.update()
    bar.close()
    stats = [
        degeneracy("tiny target, GSM8K test questions", answers[: len(gsm8k)]),
        degeneracy("tiny target, `quick` task and card prompts", answers[len(gsm8k) :]),
        degeneracy("tiny target, all of the above", answers),
        *vicuna_reference(data_dir, tokenizer, plan.gen_new_tokens),
    ]
    data = CardData(
        seed=seed,
        plan=plan,
        manifest=corpus.manifest,
        removed_as_eval=corpus.removed_as_eval,
        heldout_conversations=len(corpus.heldout),
        train_tokens=sum(map(len, train_docs)),
        heldout_tokens=sum(map(len, heldout_docs)),
        vocab_size=len(tokenizer),
        models=[target_card, draft_card],
        logs=logs,
        agreement=agreement(target, draft, rows),
        threads=torch.get_num_threads(),
        cache_len=CACHE_LEN,
        samples=samples,
        degeneracy=stats,
        build_seconds=time.perf_counter() - start,
    )
    return write_card(out_dir, data)
