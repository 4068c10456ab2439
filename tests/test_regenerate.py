"""`specbench regenerate`: the target's own answers to training prompts, as head training text."""

import json

import torch

from specbench import tasks
from specbench.cli.main import main
from specbench.models.chat import prompt_ids
from specbench.models.loading import load_causal_lm, load_tokenizer
from specbench.zoo.regenerate import read_prompts, regenerate, write_texts
from specbench.zoo.text import token_streams, zoo_corpus

from .conftest import DATA

PROMPTS = [q.turns[0] for q in tasks.load("quick").questions][:5]


def _load(target_dir):
    return load_causal_lm(str(target_dir), torch.device("cpu"), torch.float32), load_tokenizer(str(target_dir))


def _greedy_by_hand(model, ids: list[int], new: int, eos: int) -> list[int]:
    out = list(ids)
    for _ in range(new):
        token = int(model(torch.tensor([out])).logits[0, -1].argmax())
        out.append(token)
        if token == eos:
            break
    return out


def test_batched_greedy_answers_are_the_models_own(tiny_models):
    model, tokenizer = _load(tiny_models[0])
    batched, skipped = regenerate(model, tokenizer, PROMPTS, max_new_tokens=6, temperature=0, batch_size=4, seed=0)
    assert skipped == 0 and len(batched) == len(PROMPTS)
    for prompt, seq in zip(PROMPTS, batched, strict=True):  # prompts of different lengths share left-padded batches
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        assert seq == _greedy_by_hand(model, ids, 6, tokenizer.eos_token_id)


def test_sampled_answers_follow_the_seed(tiny_models):
    model, tokenizer = _load(tiny_models[0])
    args = {"max_new_tokens": 8, "temperature": 1.0, "batch_size": 2}
    first, _ = regenerate(model, tokenizer, PROMPTS, seed=1, **args)
    again, _ = regenerate(model, tokenizer, PROMPTS, seed=1, **args)
    other, _ = regenerate(model, tokenizer, PROMPTS, seed=2, **args)
    assert first == again and first != other


def test_prompts_longer_than_the_context_are_left_out(tiny_models):
    model, tokenizer = _load(tiny_models[0])
    context = model.config.max_position_embeddings
    sequences, skipped = regenerate(
        model, tokenizer, [PROMPTS[0], "word " * context], max_new_tokens=4, temperature=0, batch_size=2, seed=0
    )
    assert skipped == 1 and len(sequences) == 1


def test_written_text_tokenises_back_to_the_sequences(tiny_models, tmp_path):
    tokenizer = load_tokenizer(str(tiny_models[0]))
    sequences = [prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    for seq in sequences:
        seq.append(tokenizer.eos_token_id)
    tokens = write_texts(tokenizer, sequences, tmp_path / "regen.jsonl")
    assert tokens == sum(map(len, sequences))
    lines = (tmp_path / "regen.jsonl").read_text().splitlines()
    (tmp_path / "all.jsonl").write_text("\n".join(lines + lines[:1]) + "\n")  # the last line is held out
    train, _ = token_streams(tmp_path / "all.jsonl", tokenizer)
    assert train.tolist() == [t for seq in sequences for t in seq]


def test_cli_writes_training_text_that_trains_a_head(capsys, tiny_models, tmp_path):
    target = str(tiny_models[0])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]) + json.dumps({"turns": PROMPTS[3:]}) + "\n"
    )
    out = tmp_path / "regen.jsonl"
    argv = ["regenerate", "--target", target, "--prompts", str(prompts), "--out", str(out), "--device", "cpu"]
    assert main([*argv, "--max-new-tokens", "12", "--limit", "3"]) == 0, capsys.readouterr().err
    assert "3 answered prompts" in capsys.readouterr().out
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(texts) == 3 and all(p in t for p, t in zip(PROMPTS, texts, strict=False))
    assert main([*argv, "--max-new-tokens", "40"]) == 0  # all four prompts, the "turns" line included
    train = ["train", "eagle", "--target", target, "--data", str(out), "--out", str(tmp_path / "eagle"), "--smoke"]
    assert main([*train, "--device", "cpu", "--seq-len", "16"]) == 0, capsys.readouterr().err


def test_cli_errors_are_one_line(capsys, tiny_models, tmp_path):
    base = ["regenerate", "--target", str(tiny_models[0]), "--out", str(tmp_path / "o.jsonl"), "--device", "cpu"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "hi"}) + "\n")
    assert main([*base, "--prompts", str(tmp_path / "bad.jsonl")]) == 2
    assert 'bad.jsonl:1: each line needs a "prompt" string' in capsys.readouterr().err
    assert main([*base, "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "must be a data folder or a .jsonl file" in capsys.readouterr().err
    assert main([*base, "--prompts", str(tmp_path / "bad.jsonl"), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_data_folder_prompts_are_the_corpus_training_prompts():
    prompts = read_prompts(DATA, smoke=True)
    assert prompts == [c.prompt for c in zoo_corpus(DATA, smoke=True).train]
