"""Building the whole tiny family: corpus, tokenizer, target, draft, saved folders and model card."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specbench.zoo.card import CardData, Model, Sample, write_card
from specbench.zoo.corpus import Conversation, build_corpus
from specbench.zoo.evaluate import agreement, decode_ms, distinct2, greedy_answer, heldout_loss, repeated4
from specbench.zoo.models import draft_from_target, llama_config, new_model, parameter_count
from specbench.zoo.packing import pack
from specbench.zoo.plan import FULL, SMOKE, FamilyPlan
from specbench.zoo.prompts import GENERAL, gsm8k_test
from specbench.zoo.save import save_model
from specbench.zoo.tokenizer import train_tokenizer
from specbench.zoo.train import distill_draft, train_target

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


def build_family(out_dir: Path, data_dir: Path, *, smoke: bool = False, seed: int = 0) -> Path:
    """Train and save the tiny target/draft family into `out_dir`; return the model card's path.

    `smoke` runs the same pipeline in seconds on a corpus sample with toy sizes (for tests).
    """
    plan = SMOKE if smoke else FULL
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(
        data_dir,
        seed=seed,
        heldout_frac=plan.heldout_frac,
        max_article_chars=plan.max_article_chars,
        per_source_limit=plan.per_source_limit,
    )
    tqdm.write(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out conversations")
    tokenizer = train_tokenizer((c.render() for c in corpus.train), plan.vocab_size)
    train_docs, heldout_docs = _tokenize(tokenizer, corpus.train), _tokenize(tokenizer, corpus.heldout)
    heldout_rows = pack(heldout_docs, plan.seq_len)
    train_tokens = sum(map(len, train_docs))
    tqdm.write(f"tokenizer: vocabulary {len(tokenizer)}, {train_tokens} training tokens")

    target = new_model(llama_config(plan.target, tokenizer), seed)
    target_log = train_target(target, train_docs, heldout_rows, plan, seed)
    draft = draft_from_target(target, plan.draft_layers, seed)
    draft_log = distill_draft(draft, target, train_docs, heldout_rows, plan, seed)
    save_model(target, tokenizer, out_dir / "target")
    save_model(draft, tokenizer, out_dir / "draft")

    rows = heldout_rows[: plan.card_eval_seqs]
    target_card, target = _describe("target", out_dir / "target", rows, plan)
    draft_card, draft = _describe("draft", out_dir / "draft", rows, plan)
    samples = []
    prompts = gsm8k_test(data_dir, plan.gsm8k_prompts) + GENERAL
    for prompt in tqdm(prompts, desc="greedy samples"):
        ids = greedy_answer(target, tokenizer, prompt, plan.gen_new_tokens)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        samples.append(Sample(prompt, text, len(ids), distinct2(ids), repeated4(ids)))
    data = CardData(
        seed=seed,
        plan=plan,
        manifest=corpus.manifest,
        removed_as_eval=corpus.removed_as_eval,
        heldout_conversations=len(corpus.heldout),
        train_tokens=train_tokens,
        heldout_tokens=sum(map(len, heldout_docs)),
        vocab_size=len(tokenizer),
        models=[target_card, draft_card],
        logs=[target_log, draft_log],
        agreement=agreement(target, draft, rows),
        threads=torch.get_num_threads(),
        cache_len=CACHE_LEN,
        samples=samples,
        build_seconds=time.perf_counter() - start,
    )
    return write_card(out_dir, data)
