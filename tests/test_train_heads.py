"""`specbench train medusa|eagle|mtp` end to end on a tiny random target; the saved heads load like official ones."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from specbench.cli.main import main
from specbench.heads import eagle as eagle_heads
from specbench.heads import medusa as medusa_heads
from specbench.heads import mtp as mtp_heads
from specbench.heads.eagle import build, config_from_target
from specbench.heads.train import target_pass, unroll
from specbench.models.loading import load_causal_lm, load_tokenizer
from specbench.zoo.text import token_streams

from .conftest import DATA, random_llama


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, quick_text):
    """The quick task's turns as a JSONL file and as a plain-text file."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "text.jsonl").write_text(quick_text.read_text())
    texts = [json.loads(line)["text"] for line in quick_text.read_text().splitlines()]
    (root / "text.txt").write_text("\n\n".join(texts))
    return root


@pytest.mark.parametrize("kind, data", [("medusa", "text.txt"), ("eagle", "text.jsonl"), ("mtp", "text.jsonl")])
def test_train_writes_official_layout_that_loads_and_decodes(capsys, tiny_models, corpus, tmp_path, kind, data):
    target_dir, _ = tiny_models
    out = tmp_path / kind
    argv = ["train", kind, "--target", str(target_dir), "--data", str(corpus / data), "--out", str(out), "--smoke"]
    assert main([*argv, "--device", "cpu"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "held-out top-1 accuracy by depth" in captured.out
    assert f"train {kind}: 5/5 steps loss" in captured.err  # progress lines when stderr is not a terminal
    report = json.loads((out / "accuracy.json").read_text())
    assert len(report["top1_accuracy_by_depth"]) == (5 if kind == "medusa" else 6)
    assert len(report["target_signature"]) == 16  # checked when the head is loaded
    assert all(0 <= a <= 1 for a in report["top1_accuracy_by_depth"])
    config = json.loads((out / "config.json").read_text())
    model = load_causal_lm(str(target_dir), torch.device("cpu"), torch.float32)
    if kind == "medusa":
        assert (out / "medusa_lm_head.safetensors").is_file() and config["medusa_num_heads"] == 5
        assert len(medusa_heads.load(str(out))) == 5
    elif kind == "mtp":  # the DeepSeek-V3 layout, keys under the layer after the target's last
        assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
        assert "model.layers.2.eh_proj.weight" in load_file(str(out / "model.safetensors"))
        mtp_heads.load(str(out), model)
    else:
        assert (out / "model.safetensors").is_file() and "bias" not in config  # fc.bias, as official heads write it
        eagle_heads.load(str(out), model)
    method = {"eagle": "eagle2", "medusa": "medusa", "mtp": "mtp"}[kind]
    verify = f"verify --method {method} --mode greedy --limit 1 --max-new-tokens 8 --device cpu".split()
    code = main([*verify, "--model", str(target_dir), "--head", f"{kind}={out}"])
    text = capsys.readouterr().out
    assert code == 0 and "real mismatches -> pass" in text, text


def test_train_errors_are_one_line(capsys, tiny_models, corpus, tmp_path):
    target_dir, _ = tiny_models
    argv = ["train", "eagle", "--target", str(target_dir), "--out", str(tmp_path / "e"), "--device", "cpu"]
    assert main([*argv, "--data", str(tmp_path / "nothing.txt")]) == 2
    assert "neither a file nor a folder" in capsys.readouterr().err
    assert main([*argv, "--data", str(corpus / "text.jsonl"), "--seq-len", "100000", "--steps", "1"]) == 2
    assert "not enough for --seq-len" in capsys.readouterr().err


def test_unroll_matches_drafting_one_chain_at_a_time():
    """Training-time evaluation unrolls every anchor at once; it must equal feeding one chain through a cache."""
    model = random_llama(64, seed=0, init=0.3)
    head = build(config_from_target(model.config)).eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    features, _ = target_pass(model, ids)
    with torch.no_grad():
        steps = unroll(head, features, ids, 3)
        anchor = 5
        cache = DynamicCache(config=head.config)
        x = head(features[:, : anchor + 1], ids[:, 1 : anchor + 2], torch.arange(anchor + 1)[None], None, cache)[:, -1:]
        for step in (2, 3):
            position = torch.tensor([[anchor + step - 1]])
            x = head(x, ids[:, anchor + step : anchor + step + 1], position, None, cache)
            torch.testing.assert_close(x[0, 0], steps[step - 1][0, anchor], atol=1e-5, rtol=1e-5)


def test_data_folder_gives_the_zoo_corpus_split(tiny_models):
    tokenizer = load_tokenizer(str(tiny_models[0]))
    train, heldout = token_streams(DATA, tokenizer, smoke=True)
    assert len(train) > 5 * len(heldout) > 0  # the smoke plan holds out 10%


def test_run_with_trained_heads(capsys, tiny_models, corpus, tmp_path):
    target_dir, _ = tiny_models
    for kind in ("medusa", "eagle"):
        argv = ["train", kind, "--target", str(target_dir), "--data", str(corpus / "text.txt"), "--smoke"]
        assert main([*argv, "--out", str(tmp_path / kind), "--device", "cpu"]) == 0
    run = "run --methods medusa,eagle,eagle2 --limit 1 --max-new-tokens 6 --no-report --no-warmup --device cpu"
    heads = ["--head", f"medusa={tmp_path / 'medusa'}", "--head", f"eagle={tmp_path / 'eagle'}"]
    code = main([*run.split(), "--model", str(target_dir), "--out", str(tmp_path / "run"), *heads])
    assert code == 0, capsys.readouterr().err
    for method in ("medusa", "eagle", "eagle2"):
        assert (tmp_path / "run" / "answers" / "quick" / f"{method}-temperature-0.jsonl").is_file()


@pytest.mark.parametrize("kind, extra", [("medusa", ["--medusa-shared-lm-head"]), ("eagle", [])])
def test_compact_heads_are_float16_and_load_like_the_full_ones(capsys, tiny_models, corpus, tmp_path, kind, extra):
    from safetensors.torch import load_file

    target_dir, _ = tiny_models
    out = tmp_path / kind
    argv = ["train", kind, "--target", str(target_dir), "--data", str(corpus / "text.jsonl"), "--out", str(out)]
    assert main([*argv, "--smoke", "--device", "cpu", "--compact", *extra]) == 0, capsys.readouterr().err
    name = "medusa_lm_head.safetensors" if kind == "medusa" else "model.safetensors"
    state = load_file(str(out / name))
    assert {v.dtype for v in state.values()} == {torch.float16}
    model = load_causal_lm(str(target_dir), torch.device("cpu"), torch.float32)
    if kind == "medusa":
        assert "0.1.weight" not in state  # no projection of its own
        heads = medusa_heads.load(str(out))
        assert heads.shared_lm_head and next(heads.parameters()).dtype == torch.float32
    else:
        assert "embed_tokens.weight" not in state
        head = eagle_heads.load(str(out), model)
        assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)
    method = "eagle" if kind == "eagle" else "medusa"
    verify = f"verify --method {method} --mode greedy --limit 1 --max-new-tokens 8 --device cpu".split()
    code = main([*verify, "--model", str(target_dir), "--head", f"{kind}={out}"])
    text = capsys.readouterr().out
    assert code == 0 and "real mismatches -> pass" in text, text


def test_token_counts_rank_a_trained_heads_draft_vocab(capsys, tiny_models, corpus, tmp_path):
    """`train eagle` counts its training stream beside the head; `token-counts` writes the same file for a head
    trained elsewhere; `eagle2[draft_vocab=N]` reads it, and without it says how to make it."""
    target_dir, _ = tiny_models
    out, data = tmp_path / "eagle", str(corpus / "text.jsonl")
    argv = ["train", "eagle", "--target", str(target_dir), "--data", data, "--out", str(out), "--smoke"]
    assert main([*argv, "--device", "cpu"]) == 0, capsys.readouterr().err
    written = json.loads((out / "token_counts.json").read_text())
    trained = json.loads((out / "accuracy.json").read_text())["train_tokens"]
    assert written["tokens"] == sum(written["counts"]) == trained
    verify = [
        "verify",
        "--method",
        "eagle2[draft_vocab=64]",
        "--mode",
        "greedy",
        "--limit",
        "1",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--model",
        str(target_dir),
        "--head",
        f"eagle={out}",
    ]
    (out / "token_counts.json").unlink()
    capsys.readouterr()
    assert main(verify) == 2
    assert "token_counts.json is missing" in capsys.readouterr().err
    counts = ["token-counts", "--target", str(target_dir), "--data", data, "--out", str(out)]
    assert main(counts) == 0 and "counted" in capsys.readouterr().out
    assert json.loads((out / "token_counts.json").read_text()) == written
    code = main(verify)
    text = capsys.readouterr().out
    assert code == 0 and "real mismatches -> pass" in text, text
    assert main(["token-counts", "--data", data, "--out", str(tmp_path / "none")]) == 2
    assert "is not a folder" in capsys.readouterr().err
