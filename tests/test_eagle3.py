"""EAGLE-3: the official head layout (scaled down), drafting through the shared EAGLE-2 tree loop with d2t,
greedy equality with vanilla, the sampling test, and training by the training-time test."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from specbench import methods
from specbench.cli.main import main
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.losslessness import sampling_test
from specbench.core.proposer import Turn
from specbench.errors import SpecbenchError
from specbench.heads import eagle as eagle_heads
from specbench.heads import eagle3
from specbench.heads.train import (
    draft_vocab_cross_entropy,
    draft_vocabulary,
    target_pass,
    train_eagle3,
    ttt_pairs,
    unroll,
)
from specbench.heads.train_config import TrainConfig
from specbench.methods.eagle import Eagle
from specbench.methods.eagle_trees import DynamicTree
from specbench.methods.vanilla import Vanilla
from specbench.models import aliases
from specbench.models import loading as models

from .conftest import propose_one, random_llama, random_qwen2

VOCAB, HIDDEN, LAYERS = 64, 64, 7  # fused states 2, 3 and 4
USED = torch.tensor(sorted(range(0, VOCAB, 3)) + [7, 8, 40, 41])  # a reduced draft vocabulary of target ids
PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 3], [1, 40], [7]]

# EAGLE3-LLaMA3.1-Instruct-8B's config.json key set, scaled down (draft_vocab_size set per test).
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 2 * HIDDEN,
    "max_position_embeddings": 1024,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": VOCAB,
}


def layout(hidden: int, draft_vocab: int, target_hidden: int = HIDDEN) -> dict[str, list[int]]:
    """The official key set and shapes (eagle.md §2.3), without d2t/t2d."""
    kv = hidden // 2  # 2 of 4 heads
    return {
        "fc.weight": [hidden, 3 * target_hidden],
        "midlayer.hidden_norm.weight": [hidden],
        "midlayer.input_layernorm.weight": [hidden],
        "midlayer.self_attn.q_proj.weight": [hidden, 2 * hidden],
        "midlayer.self_attn.k_proj.weight": [kv, 2 * hidden],
        "midlayer.self_attn.v_proj.weight": [kv, 2 * hidden],
        "midlayer.self_attn.o_proj.weight": [hidden, hidden],
        "midlayer.post_attention_layernorm.weight": [hidden],
        "midlayer.mlp.gate_proj.weight": [2 * hidden, hidden],
        "midlayer.mlp.up_proj.weight": [2 * hidden, hidden],
        "midlayer.mlp.down_proj.weight": [hidden, 2 * hidden],
        "norm.weight": [hidden],
        "lm_head.weight": [draft_vocab, hidden],
    }


def official_state(draft_vocab: int, maps: bool, hidden: int = HIDDEN, target_hidden: int = HIDDEN) -> dict:
    torch.manual_seed(2)
    state = {k: torch.randn(shape) * 0.1 for k, shape in layout(hidden, draft_vocab, target_hidden).items()}
    for key in [k for k in state if k.endswith("norm.weight")]:
        state[key] = torch.ones_like(state[key])
    if maps:
        used = USED if draft_vocab < VOCAB else torch.arange(VOCAB)
        state["d2t"], state["t2d"] = eagle3.vocabulary_maps(used, VOCAB)
    return state


def write(folder, state, config_extra=None, name="pytorch_model.bin"):
    """An official-layout folder; config_extra's None values delete keys."""
    folder.mkdir(exist_ok=True)
    config = {**CONFIG, "draft_vocab_size": state["lm_head.weight"].shape[0], **(config_extra or {})}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    if name == "pytorch_model.bin":
        torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, folder / name)
    else:
        save_file(state, str(folder / name))
    return str(folder)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return (random_llama if request.param == "llama" else random_qwen2)(VOCAB, layers=LAYERS, seed=0, init=0.3)


@pytest.fixture(scope="module")
def llama():
    return random_llama(VOCAB, layers=LAYERS, seed=0, init=0.3)


def resources(model, head: str | None) -> methods.Resources:
    return methods.Resources(
        "random", model, None, torch.device("cpu"), torch.float32, None, {"eagle3": Path(head)} if head else {}
    )


def greedy(model, proposer, prompt=PROMPTS[0], n=30):
    return decode(CachedLM(model), proposer, prompt, max_new_tokens=n, temperature=0, stop_ids=set())


def random_head(model, used: torch.Tensor | None = None, seed: int = 3, std: float = 0.1) -> eagle3.Eagle3Head:
    """A random head for `model`; `used`: the draft vocabulary (target ids, ascending), default the whole one."""
    vocab = model.get_output_embeddings().weight.shape[0]
    raw = eagle_heads.config_from_target(model.config)
    head = eagle3.build({**raw, "draft_vocab_size": vocab if used is None else len(used)})
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    if used is not None:
        head.d2t, head.t2d = eagle3.vocabulary_maps(used, vocab)
    return head.eval()


def proposer(model, head: eagle3.Eagle3Head, tree: DynamicTree) -> Eagle:
    layers = eagle3.feature_layers(model.config.num_hidden_layers)
    return Eagle(head, head.logits, tree, feature_layers=layers, target_ids=head.target_ids)


def test_vocabulary_maps_and_feature_layers_follow_the_reference():
    used = draft_vocabulary(torch.tensor([5, 5, 5, 2, 2, 9, 1, 7, 7]), vocab=10, size=3)
    assert used.tolist() == [2, 5, 7]  # most frequent first, ties to the lower id, then ascending
    d2t, t2d = eagle3.vocabulary_maps(used, 10)
    assert d2t.tolist() == [2, 4, 5] and t2d.nonzero().flatten().tolist() == [2, 5, 7]
    assert (torch.arange(3) + d2t).tolist() == used.tolist()
    assert eagle3.feature_layers(32) == (2, 16, 29) and eagle3.feature_layers(40) == (2, 20, 37)
    with pytest.raises(SpecbenchError, match="needs >= 5 layers"):
        eagle3.feature_layers(4)


@pytest.mark.parametrize(
    "draft_vocab, maps, name",
    [(len(USED), True, "pytorch_model.bin"), (VOCAB, False, "model.safetensors"), (VOCAB, True, "pytorch_model.bin")],
    ids=["reduced_vocab", "full_vocab_no_maps", "full_vocab_zero_d2t"],
)
def test_official_layout_loads_and_decodes(tmp_path, llama, draft_vocab, maps, name):
    state = official_state(draft_vocab, maps)
    head = eagle3.load(write(tmp_path / "h", state, name=name), llama)
    reduced = draft_vocab < VOCAB
    assert set(head.state_dict()) == {*layout(HIDDEN, draft_vocab), "embed_tokens.weight"} | (
        {"d2t", "t2d"} if reduced else set()
    )
    assert torch.equal(head.embed_tokens.weight, llama.get_input_embeddings().weight)  # none in the file
    torch.testing.assert_close(head.fc.weight, state["fc.weight"], atol=1e-3, rtol=1e-3)  # fp16 in the .bin
    assert head.target_ids(torch.arange(draft_vocab)).tolist() == (USED if reduced else torch.arange(VOCAB)).tolist()
    gen = greedy(llama, methods.build("eagle3", resources(llama, str(tmp_path / "h"))))
    assert gen.tokens == greedy(llama, Vanilla()).tokens


def test_a_hub_head_without_counts_names_the_command_that_makes_them(tmp_path, llama):
    folder = write(tmp_path / "h", official_state(len(USED), True))
    with pytest.raises(SpecbenchError, match=r"token_counts.json is missing.*specbench token-counts --data TEXT"):
        methods.build("eagle3[draft_vocab=10]", resources(llama, folder))


def test_target_hidden_size_and_own_embedding(tmp_path, llama):
    """A 32-wide head on the 64-wide target: fc reads 3 x target_hidden_size, the embedding is the head's own."""
    state = official_state(len(USED), True, hidden=32)
    extra = {"hidden_size": 32, "intermediate_size": 64, "target_hidden_size": HIDDEN}
    with pytest.raises(SpecbenchError, match="must ship its own embedding"):
        eagle3.load(write(tmp_path / "a", state, extra), llama)
    state["embed_tokens.weight"] = torch.randn(VOCAB, 32)
    head = eagle3.load(write(tmp_path / "b", state, extra, "model.safetensors"), llama)
    assert head.fc.weight.shape == (32, 3 * HIDDEN)
    assert torch.equal(head.embed_tokens.weight, state["embed_tokens.weight"])
    gen = greedy(llama, methods.build("eagle3", resources(llama, str(tmp_path / "b"))))
    assert gen.tokens == greedy(llama, Vanilla()).tokens


@pytest.mark.parametrize(
    "edit, extra, message",
    [
        (
            lambda s: s.update({"midlayer.hidden_nrm.weight": s.pop("midlayer.hidden_norm.weight")}),
            {},
            "midlayer.hidden_norm.weight",
        ),
        (lambda s: s.update({"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}), {}, "'fc.weight' has shape"),
        (
            lambda s: s.update({"midlayer.self_attn.q_proj.weight": torch.zeros(HIDDEN, HIDDEN)}),
            {},
            "q_proj.weight' has shape",
        ),
        (lambda s: s.pop("d2t"), {}, "'d2t' is missing"),
        (lambda s: s.update({"layers.0.input_layernorm.weight": torch.ones(HIDDEN)}), {}, "unexpected key"),
        (lambda s: s["d2t"].add_(VOCAB), {}, "outside the target vocabulary"),
        (lambda s: None, {"draft_vocab_size": None}, "no draft_vocab_size"),
        (lambda s: None, {"vocab_size": 2 * VOCAB}, "use a head trained for this target"),
    ],
    ids=["renamed", "fc_shape", "attention_not_2h", "no_d2t", "extra", "bad_d2t", "eagle1_config", "other_target"],
)
def test_bad_layout_is_a_clear_error(tmp_path, llama, edit, extra, message):
    state = official_state(len(USED), True)
    edit(state)
    folder = write(tmp_path / "h", state, extra, "model.safetensors")
    with pytest.raises(SpecbenchError, match=message):
        eagle3.load(folder, llama)


def test_families_do_not_mix_and_shallow_targets_are_refused(tmp_path, llama):
    folder = write(tmp_path / "h", official_state(len(USED), True))
    with pytest.raises(SpecbenchError, match="use the eagle3 method"):
        eagle_heads.load(folder, llama)
    with pytest.raises(SpecbenchError, match="needs >= 5 layers"):
        methods.build("eagle3", resources(random_llama(VOCAB, layers=2), folder))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_eagle3_matches_vanilla_token_for_token(target, prompt):
    reference = greedy(target, Vanilla(), prompt, n=40).tokens
    for used in (USED, None):
        head = random_head(target, used)
        for tree in (DynamicTree(60, 7, 10), DynamicTree(8, 3, 2)):
            gen = greedy(target, proposer(target, head, tree), prompt, n=40)
            assert gen.tokens == reference and sum(gen.accept_lengths) == len(reference)


def test_drafted_tokens_are_target_ids_of_the_draft_vocabulary(llama):
    p = proposer(llama, random_head(llama, USED), DynamicTree(60, 7, 10))
    prompt = PROMPTS[0]
    target = CachedLM(llama)
    target.reset()
    p.start([0], [Turn(prompt, 0.0, None, target.run(prompt[:-1], layers=p.feature_layers).features)])
    assert p.lanes[0].pending.shape == (0, 3 * HIDDEN) and p.feature_layers == (2, 3, 4)
    tree = propose_one(p, prompt, 8).tree
    assert len(tree) + 1 == 60, "total_tokens counts the verified rows, root included (59 drafts)"
    assert tree.max_depth() <= 8 and set(tree.tokens) <= set(USED.tolist())
    shallow = propose_one(p, prompt, 1).tree
    assert len(shallow) == 10 and shallow.max_depth() == 1, "one token left to draft: the top 10 at depth 1 only"


def test_restrict_keeps_the_rows_and_target_ids_of_a_shortlist():
    head = random_head(random_llama(VOCAB, layers=LAYERS, seed=0, init=0.3), USED)
    keep = torch.tensor([0, 3, 20, 22])  # draft ids, ascending
    rows, ids = head.lm_head.weight[keep].clone(), head.target_ids(keep)
    head.restrict(keep)
    assert torch.equal(head.lm_head.weight, rows) and head.lm_head.out_features == 4
    assert head.target_ids(torch.arange(4)).tolist() == ids.tolist() == [0, 9, 60, 7]
    assert head.t2d.nonzero().flatten().tolist() == [0, 7, 9, 60]
    assert head.logits(torch.randn(2, HIDDEN)).shape == (2, 4)


@pytest.mark.parametrize("shortlist", [None, [0, 2, 4]])
def test_eagle3_passes_the_sampling_test(shortlist):
    """Draft vocabulary 5 of 8 target tokens: every drafted id goes through d2t; a shortlist of 3 of them
    (draft ids 0, 2, 4: target ids 0, 3, 7) as `draft_vocab` reads out."""
    model = random_llama(8, layers=5, hidden=32, seed=0, init=0.5)
    head = random_head(model, torch.tensor([0, 2, 3, 5, 7]), std=0.3)
    if shortlist is not None:
        head.restrict(torch.tensor(shortlist))
    result = sampling_test(
        CachedLM(model),
        proposer(model, head, DynamicTree(10, 1, 3)),
        [1, 2, 3, 1, 2],
        horizon=3,
        samples=1000,
        temperature=1.0,
        stop_ids=set(),
    )
    assert result.passed, result


def test_unroll_matches_drafting_one_chain_at_a_time(llama):
    """The training-time test's steps equal the proposer's: fc on the target's features at step 1 only."""
    head = random_head(llama, USED)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    layers = eagle3.feature_layers(LAYERS)
    features, _ = target_pass(llama, ids, layers)
    assert features.shape == (1, 12, 3 * HIDDEN)
    with torch.no_grad():
        steps = unroll(head, features, ids, 3)
        anchor, cache = 5, DynamicCache(config=head.config)
        x = head(features[:, : anchor + 1], ids[:, 1 : anchor + 2], torch.arange(anchor + 1)[None], None, cache)[:, -1:]
        for step in (2, 3):
            x = head(x, ids[:, anchor + step : anchor + step + 1], torch.tensor([[anchor + step - 1]]), None, cache)
            torch.testing.assert_close(x[0, 0], steps[step - 1][0, anchor], atol=1e-5, rtol=1e-5)


def test_training_time_test_lowers_the_loss_of_later_steps():
    """Same budget: a head trained on step 1 only drifts on its own outputs; the training-time test does not.
    The target's attention is off, so each next token depends on the current one only: learnable in seconds.
    The trained head then drafts deep accepted trees (training and drafting agree on features, positions, d2t)."""
    model = random_llama(VOCAB, layers=5, hidden=32, seed=4, init=0.3)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
    text = [greedy(model, Vanilla(), [1, s], n=40).tokens for s in range(2, VOCAB, 2)]
    stream = torch.tensor([t for doc in text[1::2] for t in doc])
    ids = torch.tensor(text[::2][:8])  # held-out windows [8, 42]
    features, logits = target_pass(model, ids, eagle3.feature_layers(5))
    cfg = TrainConfig(steps=60, lr=3e-3, seq_len=24, batch_size=8, eval_batches=1, draft_vocab=48)
    losses = {}
    for ttt in (1, 3):
        head, raw, accuracy = train_eagle3(model, stream, stream, replace(cfg, ttt_steps=ttt), 3)
        assert raw["draft_vocab_size"] == 48 and len(accuracy) == 3
        with torch.no_grad():
            pairs = ttt_pairs(head, features, ids, logits, 3)
            losses[ttt] = [draft_vocab_cross_entropy(d, t, head.t2d).item() for d, t in pairs]
    assert all(ttt < 0.8 * one for ttt, one in zip(losses[3][1:], losses[1][1:], strict=True)), losses
    gen = greedy(model, proposer(model, head, DynamicTree(20, 4, 4)), [1, 50], n=40)
    assert gen.tokens == greedy(model, Vanilla(), [1, 50], n=40).tokens
    assert sum(gen.accept_lengths) / len(gen.steps) > 2, gen.accept_lengths


@pytest.fixture(scope="module")
def deep_target(tiny_models, tmp_path_factory):
    """A 7-layer random target with the tiny tokenizer (EAGLE-3 needs >= 5 layers)."""
    folder = tmp_path_factory.mktemp("deep")
    tokenizer = models.load_tokenizer(str(tiny_models[0]))
    random_llama(len(tokenizer), layers=LAYERS, seed=0, init=0.1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_train_eagle3_writes_the_official_layout(capsys, deep_target, tmp_path):
    from specbench import tasks

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for q in tasks.load("quick").questions for t in q.turns) * 2)
    out = tmp_path / "eagle3"
    argv = ["train", "eagle3", "--target", str(deep_target), "--data", str(data), "--out", str(out), "--smoke"]
    assert main([*argv, "--device", "cpu", "--draft-vocab", "100"]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    assert config["draft_vocab_size"] == 100 and "bias" not in config
    assert "embed_tokens.weight" not in state and state["d2t"].shape == (100,) and state["t2d"].sum() == 100
    report = json.loads((out / "accuracy.json").read_text())
    assert len(report["top1_accuracy_by_depth"]) == 8
    counts = json.loads((out / "token_counts.json").read_text())  # what `draft_vocab` ranks
    assert counts["tokens"] == sum(counts["counts"]) == report["train_tokens"]
    for method in ("eagle3", "eagle3[draft_vocab=40]"):
        verify = f"verify --method {method} --mode greedy --limit 1 --max-new-tokens 8 --device cpu --head eagle3={out}"
        code = main([*verify.split(), "--model", str(deep_target)])
        text = capsys.readouterr().out
        assert code == 0 and "real mismatches -> pass" in text, text


def test_preset_and_aliases():
    assert methods.preset("eagle3").params == {
        "total_tokens": 60,
        "depth": 7,
        "top_k": 10,
        "sampled": False,
        "draft_dtype": None,
        "draft_vocab": None,
    }
    assert aliases.resolve("vicuna-13b").heads["eagle3"].id == "yuhuili/EAGLE3-Vicuna1.3-13B"
    llama31 = aliases.resolve("llama3.1-8b")
    assert llama31.path == "meta-llama/Llama-3.1-8B-Instruct"
    assert llama31.heads["eagle3"].id == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert llama31.heads["eagle3:redhat"].id == "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"
    with pytest.raises(SpecbenchError, match="specbench train eagle3"):
        methods.build("eagle3", methods.Resources("vicuna-7b", None, None, "cpu", torch.float32))
