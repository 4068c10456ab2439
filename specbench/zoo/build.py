"""Building the whole tiny family: corpus, tokenizer, target, draft, saved folders and model card."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

from specbench.errors import SpecbenchError
from specbench.progress import Progress
from specbench.zoo import HISTORY
from specbench.zoo.card import CardData, Model, Sample, write_card
from specbench.zoo.corpus import Conversation, Corpus, build_corpus
from specbench.zoo.evaluate import (
    Degeneracy,
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
from specbench.zoo.plan import CONTINUED, DISTILLED, FULL, SMOKE, SMOKE_CONTINUED, SMOKE_TUNED, TUNED, FamilyPlan
from specbench.zoo.prompts import GENERAL, gsm8k_test, quick_first_turns, spec_bench_first_turns
from specbench.zoo.regenerate import regenerate
from specbench.zoo.save import save_model
from specbench.zoo.text import check_draft_text, jsonl_texts
from specbench.zoo.tokenizer import train_tokenizer
from specbench.zoo.train import TrainLog, distill_draft, read_history, train_target, tune_target, write_history
from specbench.zoo.unlikelihood import answer_tags

CACHE_LEN = 200


def _tokenize(tokenizer: PreTrainedTokenizerFast, conversations: list[Conversation]) -> list[list[int]]:
    texts = [c.render(tokenizer.bos_token, tokenizer.eos_token) for c in conversations]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _describe(name: str, path: Path, rows: torch.Tensor, plan: FamilyPlan) -> tuple[Model, LlamaForCausalLM]:
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


# The full build: the target trained in stages from fresh optimizers (more next-token training, then answer
# tuning against greedy loops), then the draft distilled from the final target. Each entry is (kind, plan).
RECIPE = (("target", FULL), ("target", CONTINUED), ("tune", TUNED))
SMOKE_RECIPE = (("target", SMOKE), ("target", SMOKE_CONTINUED), ("tune", SMOKE_TUNED))
# `zoo build --continue`: one more stage of a saved family; "draft" leaves the target as it is.
STAGES = {"target": (CONTINUED, SMOKE_CONTINUED), "tune": (TUNED, SMOKE_TUNED), "draft": (DISTILLED, SMOKE_CONTINUED)}


def build_family(out_dir: Path, data_dir: Path, *, smoke: bool = False, seed: int = 0) -> Path:
    """Train and save the tiny target/draft family into `out_dir` by the full recipe; return the card's path.

    `smoke` runs the same pipeline in seconds on a corpus sample with toy sizes (for tests).
    """
    recipe = SMOKE_RECIPE if smoke else RECIPE
    plan = recipe[0][1]
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(data_dir, plan, seed)
    tokenizer = train_tokenizer((c.render() for c in corpus.train), plan.vocab_size)
    docs = _tokenized(tokenizer, corpus)
    heldout_rows = pack(docs[1], plan.seq_len)
    target = new_model(llama_config(plan.target, tokenizer), seed)
    logs = [
        _target_stage(kind, target, tokenizer, corpus, docs[0], heldout_rows, stage_plan, seed, number)
        for number, (kind, stage_plan) in enumerate(recipe, 1)
    ]
    answers = _own_answers(target, tokenizer, corpus, plan, seed)
    draft = draft_from_target(target, plan.draft_layers, seed)
    name = f"draft (+ {len(answers)} target answers)"
    logs.append(distill_draft(draft, target, docs[0] + answers, heldout_rows, plan, seed, name))
    plans = (recipe[-1][1], recipe[-1][1])
    return _finish(out_dir, data_dir, (target, draft, tokenizer), corpus, docs, plans, seed, logs, start)


def _own_answers(
    target: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, corpus: Corpus, plan: FamilyPlan, seed: int
) -> list[list[int]]:
    """Token ids of the first training prompts followed by the target's greedy answers to them.

    The draft is judged on predicting the target's own answers, which differ from the corpus answers it is
    otherwise distilled on (the bundled draft, distilled again on such answers, went from sps tau 2.05 to
    3.24 on a spec_bench subset).
    """
    prompts = [c.prompt for c in corpus.train[: plan.draft_answers]]
    sequences, _ = regenerate(
        target, tokenizer, prompts, max_new_tokens=plan.answer_tokens, temperature=0.0, batch_size=32, seed=seed
    )
    tqdm.write(f"target answers for the draft: {len(sequences)} prompts, {sum(map(len, sequences))} tokens")
    return sequences


def continue_family(
    family_dir: Path,
    data_dir: Path,
    *,
    smoke: bool = False,
    seed: int = 0,
    stage: str = "target",
    draft_text: Path | None = None,
) -> Path:
    """Train a saved family one stage further: the target from its weights, then the draft against it.

    The corpus, split and tokenizer are the family's own (same seed); the data order is reshuffled. The
    runs are appended to the family's training log, and the card is rewritten with all of them. `stage`
    "tune" makes the target run answer tuning (answer tokens only, repeat unlikelihood) instead of more
    next-token training on all text; "draft" leaves the target as it is and only distils the draft again.
    `draft_text` (JSONL "text" lines, e.g. the target's own answers) is added to the draft's training text.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    plan = STAGES[stage][smoke]
    history = _history(family_dir)
    start = time.perf_counter()
    corpus = _corpus(data_dir, plan, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(family_dir / "target")
    extra = _draft_docs(tokenizer, draft_text)
    docs = _tokenized(tokenizer, corpus)
    heldout_rows = pack(docs[1], plan.seq_len)
    target = LlamaForCausalLM.from_pretrained(family_dir / "target", dtype=torch.float32)
    draft = LlamaForCausalLM.from_pretrained(family_dir / "draft", dtype=torch.float32)
    number = 1 + sum(g.name.startswith("target") or "draft only" in g.name for g in history)
    logs = [*history]
    if stage != "draft":
        logs.append(_target_stage(stage, target, tokenizer, corpus, docs[0], heldout_rows, plan, seed, number))
    name = f"draft (stage {number}" + (", draft only" if stage == "draft" else "")
    name += f", + {draft_text.name})" if draft_text else ")"
    seed_n = seed + 2 * number + 1
    logs.append(distill_draft(draft, target, docs[0] + extra, heldout_rows, plan, seed_n, name))
    plans = (plan, STAGES["tune"][smoke])
    return _finish(family_dir, data_dir, (target, draft, tokenizer), corpus, docs, plans, seed, logs, start)


def measure_family(family_dir: Path, data_dir: Path, *, smoke: bool = False, seed: int = 0) -> Path:
    """Measure a saved family again and rewrite its card, training nothing (for a card that gained a
    measurement since the family was trained). The heads section is kept."""
    history = _history(family_dir)
    plan = STAGES["draft"][smoke]
    corpus = _corpus(data_dir, plan, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(family_dir / "target")
    docs = _tokenized(tokenizer, corpus)
    plans = (plan, STAGES["tune"][smoke])
    return _measure(family_dir, data_dir, tokenizer, (corpus, docs), plans, seed, history, None)


def _history(family_dir: Path) -> list[TrainLog]:
    history = read_history(family_dir)
    if not history:
        raise SpecbenchError(f"{family_dir} has no {HISTORY}: build it first with `specbench zoo build`")
    return history


def _target_stage(
    kind: str,
    target: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    corpus: Corpus,
    train_docs: list[list[int]],
    heldout_rows: torch.Tensor,
    plan: FamilyPlan,
    seed: int,
    number: int,
) -> TrainLog:
    """Train the target for one stage in place: next-token training ("target") or answer tuning ("tune").

    Stage 1 is "target" with the build's seed; later stages reshuffle the data with a seed of their own.
    """
    stage_seed = seed if number == 1 else seed + 2 * number
    if kind == "tune":
        bos = tokenizer.bos_token
        prompts = tokenizer([c.render_prompt(bos) for c in corpus.train], add_special_tokens=False)["input_ids"]
        tags = _answer_tags(prompts, train_docs)
        name = f"target (stage {number}, answer tuning)"
        return tune_target(target, train_docs, tags, prompts, heldout_rows, plan, stage_seed, name)
    name = "target" if number == 1 else f"target (stage {number})"
    return train_target(target, train_docs, heldout_rows, plan, stage_seed, name)


def _draft_docs(tokenizer: PreTrainedTokenizerFast, path: Path | None) -> list[list[int]]:
    """Token ids of extra draft training text, BOS added as `specbench regenerate` leaves it to the tokenizer."""
    if path is None:
        return []
    check_draft_text(path)
    docs = tokenizer(jsonl_texts(path), add_special_tokens=True, verbose=False)["input_ids"]
    tqdm.write(f"draft text: {len(docs)} documents, {sum(map(len, docs))} tokens from {path}")
    return docs


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
    models: tuple[LlamaForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast],
    corpus: Corpus,
    docs: tuple[list[list[int]], list[list[int]]],
    plans: tuple[FamilyPlan, FamilyPlan],
    seed: int,
    logs: list[TrainLog],
    start: float,
) -> Path:
    """Save both models and the training log, then measure them as shipped and write the model card."""
    target, draft, tokenizer = models
    save_model(target, tokenizer, out_dir / "target")
    save_model(draft, tokenizer, out_dir / "draft")
    write_history(out_dir, logs)
    return _measure(out_dir, data_dir, tokenizer, (corpus, docs), plans, seed, logs, start)


def _measure(
    out_dir: Path,
    data_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    data: tuple[Corpus, tuple[list[list[int]], list[list[int]]]],
    plans: tuple[FamilyPlan, FamilyPlan],
    seed: int,
    logs: list[TrainLog],
    start: float | None,
) -> Path:
    """Measure the saved models as shipped and write the card (`start` None: nothing was trained).

    `plans` are the last run's plan (sizes, evaluation budgets) and the answer-tuning plan the card describes.
    """
    plan, tuning = plans
    corpus, docs = data
    train_docs, heldout_docs = docs
    rows = pack(heldout_docs, plan.seq_len)[: plan.card_eval_seqs]
    target_card, target = _describe("target", out_dir / "target", rows, plan)
    draft_card, draft = _describe("draft", out_dir / "draft", rows, plan)
    gsm8k, others = gsm8k_test(data_dir, plan.gsm8k_prompts), quick_first_turns() + GENERAL
    answers = _greedy(target, tokenizer, gsm8k + others, plan)
    samples = [
        Sample(
            prompt,
            tokenizer.decode(ids, skip_special_tokens=True),  # type: ignore[arg-type]  # one sequence: a str
            len(ids),
            distinct2(ids),
            repeated4(ids),
        )
        for prompt, ids in zip(gsm8k + others, answers, strict=True)
    ]
    stats = [
        degeneracy("tiny target, GSM8K test questions", answers[: len(gsm8k)]),
        degeneracy("tiny target, `quick` task and card prompts", answers[len(gsm8k) :]),
        degeneracy("tiny target, all of the above", answers),
        *_spec_bench_degeneracy(target, tokenizer, data_dir, plan),
        *vicuna_reference(data_dir, tokenizer, plan.gen_new_tokens),
    ]
    card = CardData(
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
        tuning=tuning,
        build_seconds=None if start is None else time.perf_counter() - start,
    )
    return write_card(out_dir, card)


def _greedy(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[str], plan: FamilyPlan
) -> list[list[int]]:
    """The target's greedy answers (token ids, at most `plan.gen_new_tokens`) to single-turn prompts."""
    bar = Progress(len(prompts), "greedy answers", "prompts")
    answers = []
    for prompt in prompts:
        answers.append(greedy_answer(target, tokenizer, prompt, plan.gen_new_tokens))
        bar.update()
    bar.close()
    return answers


def _spec_bench_degeneracy(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, data_dir: Path, plan: FamilyPlan
) -> list[Degeneracy]:
    """Degeneracy of the target's greedy answers to the benchmark's own prompts: all, then by subtask.

    The card's prompts are the ones answer tuning was judged on; Spec-Bench's writing and QA prompts loop
    more, and those loops flatter prompt lookup in every report on them.
    """
    by_subtask = spec_bench_first_turns(data_dir, plan.spec_bench_prompts)
    prompts = [p for group in by_subtask.values() for p in group]
    if not prompts:
        return []
    answers = iter(_greedy(target, tokenizer, prompts, plan))
    grouped = {name: [next(answers) for _ in group] for name, group in by_subtask.items()}
    per = plan.spec_bench_prompts
    rows = [degeneracy(f"tiny target, Spec-Bench first turns ({per} per subtask)", sum(grouped.values(), []))]
    return rows + [degeneracy(f"tiny target, Spec-Bench {name}", ids) for name, ids in grouped.items()]
