"""The family's MODEL_CARD.md and its loss-curve figure."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from specbench.zoo.evaluate import Agreement, Degeneracy
from specbench.zoo.plan import FamilyPlan
from specbench.zoo.train import TrainLog

CARD = "MODEL_CARD.md"
LOSS_PNG = "loss_curves.png"


@dataclass
class Sample:
    """One greedy answer and its degeneracy statistics (over answer token ids)."""

    prompt: str
    answer: str
    tokens: int
    distinct2: float
    repeated4: float


@dataclass
class Model:
    """What the card reports about one model of the family."""

    name: str
    params: int
    layers: int
    hidden: int
    heldout_loss: float
    ms_1: float  # forward over 1 new token
    ms_16: float  # forward over 16 new tokens


@dataclass
class CardData:
    """Everything the card shows."""

    seed: int
    plan: FamilyPlan
    manifest: dict[str, dict[str, int]]
    removed_as_eval: int
    heldout_conversations: int
    train_tokens: int
    heldout_tokens: int
    vocab_size: int
    models: list[Model]
    logs: list[TrainLog]
    agreement: Agreement
    threads: int
    cache_len: int
    samples: list[Sample]
    degeneracy: list[Degeneracy]  # the target's answers by prompt group, then reference models' answers
    tuning: FamilyPlan  # the plan answer-tuning runs use, whatever the last run's plan was
    build_seconds: float | None  # the last build command's, None when the card was measured without training


def plot_losses(logs: list[TrainLog], path: Path) -> Path:
    """Training and held-out loss of every run with recorded curves, one panel each (Agg, no pyplot)."""
    logs = [g for g in logs if g.train or g.heldout]
    fig = Figure(figsize=(5 * len(logs), 3.5))
    axes = fig.subplots(1, len(logs), squeeze=False)
    for ax, log in zip(axes[0], logs, strict=True):
        for label, points in (("train", log.train), ("held-out", log.heldout)):
            ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker=".")
        objective = "KL to target" if log.name.startswith("draft") else "cross-entropy"
        if "answer tuning" in log.name:
            objective = "answer CE + unlikelihood"
        ax.set_title(f"{log.name} (train: {objective}; held-out: CE)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _quote(text: str) -> str:
    return "\n".join("> " + line for line in (text.strip() or "(empty)").splitlines())


def _continued(data: CardData) -> list[str]:
    """The paragraph on training stages, when the weights come from more than one target or draft run."""
    if len(data.logs) <= 2:
        return []
    return [
        "",
        "The runs named `(stage N)` continued from the weights of the runs above them, within one "
        "`specbench zoo build` (whose draft is distilled once, from the final target, on the corpus plus "
        "the final target's greedy answers to the first training prompts: `+ N target answers`) or by "
        "`specbench zoo build --continue` (which distils the draft again after its target stage): a fresh "
        "optimizer, the same corpus, split and tokenizer, a data order reshuffled per stage, and the same "
        "schedule shape. Curves of runs recorded before the training log kept them are not plotted.",
        "",
        *_redistilled(data),
        *_tuned(data),
    ]


def _redistilled(data: CardData) -> list[str]:
    """The sentence on draft-only runs and extra draft text, when a run had either."""
    if not any("draft only" in g.name or ", + " in g.name for g in data.logs):
        return []
    return [
        "A `draft only` run (`specbench zoo build --continue --draft-only`) distils the draft again, from its "
        "weights, against the unchanged target. `+ FILE` in a draft run's name means its distillation text "
        "was the corpus plus that JSONL (`--draft-text`, such as the target's own greedy answers to training "
        "prompts written by `specbench regenerate`), shuffled together.",
        "",
    ]


def _tuned(data: CardData) -> list[str]:
    """The paragraph on answer tuning, when a run did it."""
    if not any("answer tuning" in g.name for g in data.logs):
        return []
    p = data.tuning
    return [
        "Runs marked `answer tuning` (`specbench zoo build --continue --tune`) train the target on answer "
        "tokens only, with the two unlikelihood terms of Welleck et al. (2019). Token level (weight "
        f"{p.unlikelihood:g}): at each answer position, every token already used earlier in the same answer, "
        "other than the true next token, has its probability p pushed down by -log(1 - p); prompt tokens are "
        "not candidates, so copying from the article or question is not penalised. Sequence level (weight "
        f"{p.sequence_unlikelihood:g}): each step the model greedily continues {p.continuation_batch} training "
        f"prompts (at most {p.continuation_prompt_tokens} tokens) by {p.continuation_tokens} tokens without "
        "the option to stop, and every token of a 4-gram that already occurred in its continuation gets the "
        "same penalty. Both aim at the greedy loops that next-token training on all text left; the degeneracy "
        "table below measures the result.",
        "",
    ]


def _last_step(data: CardData) -> str:
    if data.build_seconds is None:
        return "This card was measured again from the saved models, without training (`specbench zoo card --measure`)"
    return f"Last build step (corpus, tokenizer, training, evaluation, card): {data.build_seconds / 60:.1f} minutes"


def write_card(out_dir: Path, data: CardData) -> Path:
    """Write MODEL_CARD.md and the loss figure into `out_dir`."""
    plot_losses(data.logs, out_dir / LOSS_PNG)
    p = data.plan
    lines = [
        "# specbench tiny model family",
        "",
        "A Llama-architecture target (`target/`) and its draft model (`draft/`) sharing one byte-level BPE "
        "tokenizer with the Vicuna v1.1 chat template, trained from scratch by `specbench.zoo.build_family` "
        f"(seed {data.seed}) on CPU. Weights are stored in float16; the configs say float32, so "
        "`AutoModelForCausalLM.from_pretrained(dir)` gives a float32 model. They exist to exercise "
        "speculative decoding end to end on any machine; they are not useful assistants.",
        "",
        "## Corpus",
        "",
        "Single-turn conversations rendered with the chat template "
        "(`<s>{system} USER: {prompt} ASSISTANT: {answer}</s>`). Summarisation prompts are "
        f"`Summarize: {{article}}` (articles cut to {p.max_article_chars} characters at a sentence end), "
        "translation prompts `Translate German to English: {de}`. Spec-Bench, MT-bench and their model "
        f"answers are excluded; {data.removed_as_eval} conversations whose prompt matched a Spec-Bench turn "
        f"were dropped. {data.heldout_conversations} conversations ({p.heldout_frac:.0%}) are held out.",
        "",
        "| source | conversations | characters |",
        "|---|---:|---:|",
    ]
    lines += [f"| {s} | {m['conversations']:,} | {m['characters']:,} |" for s, m in data.manifest.items()]
    total_conv = sum(m["conversations"] for m in data.manifest.values())
    total_chars = sum(m["characters"] for m in data.manifest.values())
    lines += [
        f"| **total** | {total_conv:,} | {total_chars:,} |",
        "",
        f"Tokens: {data.train_tokens:,} training, {data.heldout_tokens:,} held out (vocabulary {data.vocab_size:,}).",
        "",
        "## Models",
        "",
        f"Per-token decode time: median of {p.timing_repeats} forwards over 1 or 16 new tokens on top of a "
        f"{data.cache_len}-token KV cache, float32, {data.threads} torch threads, on the build machine.",
        "",
        "| model | parameters | layers | width | held-out loss | 1 token (ms) | 16 tokens (ms) | 16 / 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {m.name} | {m.params:,} | {m.layers} | {m.hidden} | {m.heldout_loss:.3f} | {m.ms_1:.2f} | "
        f"{m.ms_16:.2f} | {m.ms_16 / m.ms_1:.2f} |"
        for m in data.models
    ]
    target, draft = data.models
    lines += [
        "",
        f"Draft / target cost per token: {draft.ms_1 / target.ms_1:.2f}. On held-out text the draft's "
        f"top-1 token equals the target's at {data.agreement.greedy:.1%} of positions; the expected "
        "acceptance of one speculative-sampling proposal (sum of min(p, q)) is "
        f"{data.agreement.sampled:.1%}.",
        "",
        "## Training",
        "",
        f"Packed sequences of {p.seq_len} tokens, batch {p.batch}, AdamW (betas 0.9/0.95, weight decay 0.1 "
        f"on matrices), linear warm-up to the peak learning rate (per run below), cosine decay to a tenth, "
        "gradient clipping 1.0, bfloat16 autocast, no dropout. The target is trained by next-token "
        "cross-entropy on every token (prompts included: the tiny model needs all the text it can get, and "
        "the repeated system prompt is cheap to predict). The draft has the target's width, starts from the "
        "target's embeddings, first layer and final norm, and is distilled by forward KL to the target's "
        "next-token distribution at every position.",
        "",
        *_continued(data),
        "Each run has a planned step count and a wall-clock cap; past the cap the cosine decay speeds up so "
        "that the run still anneals and ends in time (steps below the planned count mean the cap bit).",
        "",
        "| run | steps | planned steps | tokens | peak lr | warm-up steps | wall time (min) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {g.name} | {g.steps:,} | {g.planned_steps:,} | {g.tokens:,} | {g.peak_lr:g} | {g.warmup} | "
        f"{g.seconds / 60:.1f} |"
        for g in data.logs
    ]
    lines += [
        "",
        f"{_last_step(data)}; all training runs together: {sum(g.seconds for g in data.logs) / 60:.1f} minutes.",
        "",
        f"![loss curves]({LOSS_PNG})",
        "",
        "## Greedy samples (target)",
        "",
        f"`generate(do_sample=False, max_new_tokens={p.gen_new_tokens})` on the chat-templated prompt. "
        "Degeneracy over answer token ids: distinct-2 = unique bigrams / bigrams; repeated-4 = share of "
        "4-grams that already occurred earlier in the same answer.",
        "",
    ]
    lines += [
        f"Means over answers (each cut to {p.gen_new_tokens} tokens of this tokenizer). The Spec-Bench rows are "
        f"the tiny target's greedy answers to the first turn of the first {p.spec_bench_prompts} questions of "
        "each subtask, the prompts the benchmark runs on (never trained on; samples not shown). The Vicuna-7B "
        "rows are that model's own greedy Spec-Bench answers (shared data), a reference for a target that does "
        "not loop.",
        "",
        "| answers | n | distinct-2 | repeated-4 |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {d.label} | {d.answers} | {d.distinct2:.3f} | {d.repeated4:.3f} |" for d in data.degeneracy]
    lines.append("")
    for s in data.samples:
        lines += [
            "**Prompt**",
            "",
            _quote(s.prompt),
            "",
            f"**Answer** ({s.tokens} tokens, distinct-2 {s.distinct2:.3f}, repeated-4 {s.repeated4:.3f})",
            "",
            _quote(s.answer),
            "",
        ]
    path = out_dir / CARD
    path.write_text("\n".join(lines), encoding="utf-8")
    return update_heads_section(out_dir)


HEADS = "## Heads"
HEAD_KINDS = {
    "eagle": "EAGLE-1/2 head",
    "eagle3": "EAGLE-3 head",
    "peagle": "P-EAGLE head",
    "medusa": "Medusa heads",
    "mtp": "MTP module",
    "dflash": "DFlash drafter",
    "dflash2": "DFlash2 drafter",
    "dspark": "DSpark drafter",
    "pard": "PARD drafter",
    "pard2": "PARD-2 drafter",
}


def heads_section(family_dir: Path) -> list[str]:
    """The card's section on the heads trained for the target (`specbench train`), from their accuracy.json."""
    lines = [
        HEADS,
        "",
        "Trained by the family's script (`scripts/tiny_heads.sh`, `scripts/tiny_drafters.sh`, "
        "`scripts/smollm2_heads.sh`: `specbench train ... --compact`; size: the head's files as bundled) on the "
        "text the table names: the family's own corpus split, or a JSONL file such as the target's own answers to "
        "training prompts (`specbench regenerate`); a head must be retrained whenever the target changes. "
        "Accuracy: held-out share of positions where the head's first guess d tokens past the last target token "
        "equals the target's greedy token (the tokens in between taken from the text; a P-EAGLE head, a DFlash, "
        "DFlash2, DSpark, PARD or PARD-2 drafter sees none of them: it guesses all d places in one forward). It is "
        "measured on the held-out part of the head's own training text, so heads trained on different text do not "
        "compare by it: the target's own answers are easier to predict than the corpus.",
        "",
        "| head | training text | steps | lr | sequence length | size | "
        + " | ".join(f"d={d}" for d in range(1, 9))
        + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    found = False
    for kind, label in HEAD_KINDS.items():
        path = family_dir / kind / "accuracy.json"
        if not path.is_file():
            continue
        found = True
        report = json.loads(path.read_text(encoding="utf-8"))
        cfg = report["config"]
        accuracy = [f"{a:.3f}" for a in report["top1_accuracy_by_depth"][:8]]
        accuracy += [""] * (8 - len(accuracy))
        extra = ""
        if kind == "eagle3":
            extra = f", draft vocabulary {cfg['draft_vocab']}, training-time test {cfg['ttt_steps']} steps"
        elif kind == "peagle":
            extra = f", draft vocabulary {cfg['draft_vocab']}, {cfg['pard_tokens']} tokens per forward (speculators)"
        elif kind == "mtp":
            extra = f" (DeepSeek-V3 layout), training-time test {cfg['ttt_steps']} steps"
        elif kind == "dflash":
            extra = f", {cfg['draft_layers']} layers, blocks of {cfg['block_size']}"
        elif kind == "dflash2":
            extra = f", {cfg['draft_layers']} layer{'s' * (cfg['draft_layers'] > 1)}, blocks of {cfg['block_size']}"
        elif kind == "dspark":
            extra = f", {cfg['draft_layers']} layers, blocks of {cfg['block_size']}, {cfg['markov_head']} Markov head"
        elif kind == "pard":
            extra = f", {cfg['pard_tokens']} tokens per forward, adapted from the family's draft"
        elif kind == "pard2":
            embedding = ", the target's embedding" if report.get("compact") else ""
            extra = f", {cfg['pard_tokens']} tokens per forward, from the family's draft{embedding}"
        elif kind == "medusa":
            shared = ", reading out through the target's lm_head" if cfg.get("medusa_shared_lm_head") else ""
            extra = f", {cfg['medusa_heads']} heads{shared}"
        size = sum(f.stat().st_size for f in (family_dir / kind).iterdir() if f.is_file()) / 1e6
        row = [
            f"{label}{extra}",
            _training_text(report),
            f"{cfg['steps']:,}",
            f"{cfg['lr']:g}",
            str(cfg["seq_len"]),
            f"{size:.1f} MB",
        ]
        lines.append(f"| {' | '.join(row + accuracy)} |")
    return [*lines, ""] if found else []


def _training_text(report: dict) -> str:
    """Where a head's training text came from, from its accuracy.json ("data": a data folder or a file)."""
    data = report.get("data")
    tokens = f"{report['train_tokens']:,} tokens" if "train_tokens" in report else ""
    if data is None:
        return tokens
    source = "zoo corpus" if Path(data).suffix == "" else f"`{Path(data).name}`"
    return f"{source}, {tokens}" if tokens else source


def update_heads_section(family_dir: Path) -> Path:
    """Rewrite the card's heads section (kept last) from the heads now in `family_dir`."""
    path = family_dir / CARD
    text = path.read_text(encoding="utf-8")
    body = text.split(f"\n{HEADS}\n")[0].rstrip("\n")
    path.write_text("\n".join([body, "", *heads_section(family_dir)]).rstrip("\n") + "\n", encoding="utf-8")
    return path
