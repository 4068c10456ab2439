"""The tiny-family build pipeline, run end to end at smoke size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specbench.cli.main import main
from specbench.errors import SpecbenchError
from specbench.models.chat import vicuna_prompt
from specbench.zoo.build import build_family, continue_family
from specbench.zoo.corpus import build_corpus
from specbench.zoo.evaluate import distinct2, repeated4
from specbench.zoo.plan import FULL
from specbench.zoo.prompts import spec_bench_first_turns
from specbench.zoo.train import HISTORY, read_history

from .conftest import DATA as DATA_DIR

RECIPE_RUNS = ["target", "target (stage 2)", "target (stage 3, answer tuning)", "draft (+ 3 target answers)"]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("family")
    build_family(out, DATA_DIR, smoke=True)
    return out


@pytest.mark.parametrize("name", ["target", "draft"])
def test_saved_models_load_offline_in_float32(family: Path, name: str) -> None:
    folder = family / name
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3)
    assert out.shape[1] > ids.shape[1]


def test_draft_is_shallower_than_target(family: Path) -> None:
    target = json.loads((family / "target" / "config.json").read_text())
    draft = json.loads((family / "draft" / "config.json").read_text())
    assert draft["num_hidden_layers"] < target["num_hidden_layers"]
    assert draft["vocab_size"] == target["vocab_size"]


def test_chat_template_renders_vicuna(family: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(family / "target")
    for messages in (
        [{"role": "user", "content": "hi"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
    ):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == vicuna_prompt(messages, bos="<s>")
    text = "  Grüße, world!\n\n\tdone 42"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id


def test_corpus_excludes_evaluation_prompts() -> None:
    corpus = build_corpus(
        DATA_DIR,
        seed=0,
        heldout_frac=FULL.heldout_frac,
        max_article_chars=FULL.max_article_chars,
        per_source_limit=None,
    )
    turns = set()
    with open(DATA_DIR / "spec_bench" / "question.jsonl", encoding="utf-8") as f:
        for line in f:
            turns.update(t.strip() for t in json.loads(line)["turns"])
    prompts = {c.prompt for c in corpus.train + corpus.heldout}
    assert not prompts & turns
    assert set(corpus.manifest) >= {"gsm8k_train", "xsum", "tatoeba_de_en"}
    assert all(not s.startswith(("mt_bench", "spec_bench")) for s in corpus.manifest)


def test_model_card_has_every_section(family: Path) -> None:
    card = (family / "MODEL_CARD.md").read_text()
    for section in ("## Corpus", "## Models", "## Training", "## Greedy samples"):
        assert section in card
    assert list(family.glob("*.png"))
    assert "| tiny target, Spec-Bench first turns (1 per subtask) | 6 |" in card
    assert "| tiny target, Spec-Bench mt_bench | 1 |" in card


def test_spec_bench_prompts_are_optional_and_by_subtask(tmp_path: Path) -> None:
    assert spec_bench_first_turns(tmp_path, 3) == {}
    by_subtask = spec_bench_first_turns(DATA_DIR, 2)
    assert sorted(by_subtask) == ["math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation"]
    assert all(len(prompts) == 2 for prompts in by_subtask.values())


def test_full_build_runs_the_target_stages_then_the_draft(family: Path) -> None:
    assert [g.name for g in read_history(family)] == RECIPE_RUNS
    card = (family / "MODEL_CARD.md").read_text()
    assert "whose draft is distilled once, from the final target" in card and "unlikelihood" in card


def test_degeneracy_statistics() -> None:
    assert distinct2([1, 2, 1, 2]) == pytest.approx(2 / 3)
    assert repeated4([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)
    assert repeated4([1, 2]) == 0.0


def test_specbench_run_on_the_smoke_family(family: Path, tmp_path: Path) -> None:
    from specbench.config import RunConfig
    from specbench.results import read_answers
    from specbench.run.runner import run

    cfg = RunConfig(
        model=str(family / "target"),
        draft=str(family / "draft"),
        limit=1,
        max_new_tokens=8,
        out=str(tmp_path / "run"),
        progress=False,
    )
    answers = read_answers(run(cfg) / "answers")
    assert {a.method for a in answers} == {"vanilla", "sps", "pld", "vanilla-aa"}  # vanilla-aa: the A/A column
    assert all(a.greedy_check["match"] for a in answers if a.method != "vanilla")


def test_continued_build_trains_on_and_extends_the_log(family: Path, tmp_path: Path) -> None:
    copy = tmp_path / "family"
    shutil.copytree(family, copy)
    before = AutoModelForCausalLM.from_pretrained(copy / "target").state_dict()
    continue_family(copy, DATA_DIR, smoke=True)
    names = [g.name for g in read_history(copy)]
    assert names == [*RECIPE_RUNS, "target (stage 4)", "draft (stage 4)"]
    after = AutoModelForCausalLM.from_pretrained(copy / "target").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    card = (copy / "MODEL_CARD.md").read_text()
    assert "target (stage 4)" in card and "zoo build --continue" in card
    assert "Vicuna-7B-v1.3, math_reasoning (GSM8K)" in card


def test_continuing_a_folder_without_a_training_log_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecbenchError, match="zoo build"):
        continue_family(tmp_path, DATA_DIR, smoke=True)


def test_card_heads_section_is_rewritten_not_repeated(family: Path, tmp_path: Path) -> None:
    copy = tmp_path / "family"
    shutil.copytree(family, copy)
    heads = {
        "eagle3": {
            "data": "results/regenerated.jsonl",
            "train_tokens": 300000,
            "config": {"steps": 300, "lr": 0.001, "seq_len": 256, "draft_vocab": 2048, "ttt_steps": 7},
            "top1_accuracy_by_depth": [0.7, 0.6, 0.5],
        },
        "eagle": {
            "data": "../shared/data",
            "train_tokens": 3705895,
            "config": {"steps": 600, "lr": 0.001, "seq_len": 256},
            "top1_accuracy_by_depth": [0.65],
        },
    }
    for kind, report in heads.items():
        (copy / kind).mkdir()
        (copy / kind / "accuracy.json").write_text(json.dumps(report))
    (copy / "eagle3" / "model.safetensors").write_bytes(b"0" * 2_000_000)  # the card sums the head's files
    assert main(["zoo", "card", "--out", str(copy)]) == 0
    assert main(["zoo", "card", "--out", str(copy)]) == 0
    card = (copy / "MODEL_CARD.md").read_text()
    assert card.count("## Heads") == 1 and "## Greedy samples" in card
    eagle3 = "| EAGLE-3 head, draft vocabulary 2048, training-time test 7 steps | `regenerated.jsonl`, 300,000 tokens |"
    assert eagle3 + " 300 | 0.001 | 256 | 2.0 MB | 0.700 | 0.600 | 0.500 |" in card
    assert "| EAGLE-1/2 head | zoo corpus, 3,705,895 tokens | 600 | 0.001 | 256 | 0.0 MB | 0.650 |" in card


def test_answer_tuning_trains_on_and_says_so_in_the_card(family: Path, tmp_path: Path) -> None:
    copy = tmp_path / "family"
    shutil.copytree(family, copy)
    before = AutoModelForCausalLM.from_pretrained(copy / "target").state_dict()
    main(["zoo", "build", "--continue", "--tune", "--smoke", "--out", str(copy), "--data-dir", str(DATA_DIR)])
    names = [g.name for g in read_history(copy)]
    assert names[-2:] == ["target (stage 4, answer tuning)", "draft (stage 4)"]
    after = AutoModelForCausalLM.from_pretrained(copy / "target").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    card = (copy / "MODEL_CARD.md").read_text()
    assert "unlikelihood" in card and "--tune" in card


def test_draft_only_stage_leaves_the_target_and_learns_the_extra_text(family: Path, tmp_path: Path) -> None:
    copy = tmp_path / "family"
    shutil.copytree(family, copy)
    answers = tmp_path / "answers.jsonl"
    texts = [
        vicuna_prompt([{"role": "user", "content": q}]) + " " + a + "</s>"
        for q, a in [("2 + 2?", "4."), ("A colour?", "Blue.")]
    ]
    answers.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    target_before = (copy / "target" / "model.safetensors").read_bytes()
    draft_before = AutoModelForCausalLM.from_pretrained(copy / "draft").state_dict()
    args = ["zoo", "build", "--continue", "--draft-only", "--draft-text", str(answers), "--smoke"]
    assert main([*args, "--out", str(copy), "--data-dir", str(DATA_DIR)]) == 0
    assert (copy / "target" / "model.safetensors").read_bytes() == target_before
    draft_after = AutoModelForCausalLM.from_pretrained(copy / "draft").state_dict()
    assert any(not torch.equal(draft_before[k], draft_after[k]) for k in draft_before)
    names = [g.name for g in read_history(copy)]
    assert names == [*RECIPE_RUNS, "draft (stage 4, draft only, + answers.jsonl)"]
    card = (copy / "MODEL_CARD.md").read_text()
    assert "--draft-only" in card and "| draft (stage 4, draft only, + answers.jsonl) |" in card
    assert "Token level (weight 1)" in card  # the tuning run's weights, not the last (draft) run's


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tune"], "--continue"),
        (["--draft-only"], "--continue"),
        (["--draft-text", "answers.jsonl"], "--continue"),
        (["--continue", "--tune", "--draft-only"], "one of them"),
        (["--continue", "--draft-only", "--draft-text", "missing.jsonl"], "not a file"),
    ],
)
def test_bad_stage_flags_are_one_line_errors(
    family: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    copy = tmp_path / "family"
    shutil.copytree(family, copy)
    args = ["zoo", "build", *flags, "--smoke", "--out", str(copy), "--data-dir", str(DATA_DIR)]
    assert main(args) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_card_measure_rewrites_the_card_and_trains_nothing(family: Path, tmp_path: Path) -> None:
    copy = tmp_path / "family"
    shutil.copytree(family, copy)
    weights = {name: (copy / name / "model.safetensors").read_bytes() for name in ("target", "draft")}
    history = (copy / HISTORY).read_text()
    card = copy / "MODEL_CARD.md"
    card.write_text(card.read_text().replace("Spec-Bench first turns", "an older card"))
    assert main(["zoo", "card", "--measure", "--smoke", "--out", str(copy), "--data-dir", str(DATA_DIR)]) == 0
    assert {name: (copy / name / "model.safetensors").read_bytes() for name in weights} == weights
    assert (copy / HISTORY).read_text() == history
    text = card.read_text()
    assert "Spec-Bench first turns" in text and "without training (`specbench zoo card --measure`)" in text


def test_card_measure_needs_a_trained_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo", "card", "--measure", "--smoke", "--out", str(tmp_path), "--data-dir", str(DATA_DIR)]) != 0
    err = capsys.readouterr().err.strip()
    assert "build it first" in err and "\n" not in err
