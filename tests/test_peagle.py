"""P-EAGLE: an EAGLE-3 head drafting a chain of k tokens in one forward (parallel rows of a mask token and a learned
mask_hidden), on preallocated rows for every slot; the speculators peagle layout both ways; training on the
conditional drop-token rows."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specbench import methods
from specbench.cli.main import main
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Feedback, Turn
from specbench.core.tree import additive_mask
from specbench.engines.translate import speculative_config, why_not
from specbench.errors import SpecbenchError
from specbench.heads import eagle as eagle_heads
from specbench.heads import eagle3, pard, peagle, speculators
from specbench.heads.convert import convert
from specbench.heads.train import peagle_rows, target_pass
from specbench.methods.peagle import PEagle
from specbench.methods.vanilla import Vanilla

from . import conftest
from .conftest import propose_one, random_llama

VOCAB, HIDDEN, LAYERS = 64, 64, 7  # fused states 2, 3 and 4
USED = torch.tensor(sorted(range(0, VOCAB, 3)) + [7, 8, 40, 41])  # a reduced draft vocabulary of target ids
PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 3], [1, 40], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
MASK = VOCAB - 1


@pytest.fixture(scope="module")
def llama():
    return random_llama(VOCAB, layers=LAYERS, seed=0, init=0.3)


def random_head(model, used=None, layers: int = 1, seed: int = 3, std: float = 0.1, **flags) -> peagle.PEagleHead:
    """A random P-EAGLE head for `model` (`used`: its draft vocabulary, target ids ascending; default all)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    raw = {
        **eagle_heads.config_from_target(model.config),
        "draft_vocab_size": vocab if used is None else len(used),
        "mask_token_id": vocab - 1,
        **({"draft_layers": layers} if layers > 1 else {}),
        **flags,
    }
    head = peagle.build(raw)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    if used is not None:
        head.d2t, head.t2d = eagle3.vocabulary_maps(used, vocab)
    return head.eval()


def drafter(model, head, k: int, slots: int = 1) -> PEagle:
    layers = eagle3.feature_layers(model.config.num_hidden_layers)
    return PEagle(head, k, feature_layers=layers, target_vocab=VOCAB, slots=slots)


def greedy(model, proposer, prompt, n=30):
    return decode(CachedLM(model), proposer, prompt, max_new_tokens=n, temperature=0, stop_ids=set())


@pytest.mark.parametrize(("used", "layers"), [(None, 1), (USED, 1), (USED, 2)])
def test_greedy_peagle_matches_vanilla_token_for_token(llama, used, layers):
    head = random_head(llama, used, layers)
    for prompt in PROMPTS:
        reference = greedy(llama, Vanilla(), prompt, n=40).tokens
        for k in (1, 4, 8):
            gen = greedy(llama, drafter(llama, head, k), prompt, n=40)
            assert gen.tokens == reference and max(s.tree_size for s in gen.steps) <= k + 1


@torch.no_grad()
def test_each_draft_is_the_heads_forward_over_every_pair_and_the_parallel_rows(llama):
    """Brute force: at every step the chain equals the argmax of one cacheless causal forward over all committed
    pairs and k - 1 parallel rows (the drafter keeps its earlier pairs' keys and overwrites the parallel rows')."""
    head, k = random_head(llama, USED, layers=2, std=0.3), 5
    made = drafter(llama, head, k)
    target = CachedLM(llama)
    target.reset()
    tokens = list(PROMPTS[2][:6])
    made.start([0], [Turn(tokens, 0.0, None, target.run(tokens[:-1], layers=made.feature_layers).features)])
    rest = PROMPTS[2][6:]
    for accepted in (2, 0, 3):
        drafted = propose_one(made, tokens, k).tree.tokens
        ids = torch.tensor([tokens])
        features, _ = target_pass(llama, ids, made.feature_layers)  # [1, L, F]
        n = len(tokens) - 1
        masks, mask_ids = head.masks(1, k - 1)
        x = torch.cat([features[:, :n], masks], dim=1)
        t = torch.cat([ids[:, 1:], mask_ids], dim=1)
        out = head(x, t, torch.arange(n + k - 1)[None])  # causal, no cache
        want = head.target_ids(head.logits(out[0, n - 1 :]).argmax(-1)).tolist()
        assert list(drafted) == want
        committed, rest = rest[: accepted + 1], rest[accepted + 1 :]  # the accepted tokens and the target's
        tokens = tokens + committed
        fed = target_pass(llama, torch.tensor([tokens]), made.feature_layers)[0][0, n : n + len(committed)]
        made.update([0], [tokens], [], [Feedback(None, fed)])  # type: ignore[arg-type]  # (what it reads)
        assert made.lengths[0] == n


@torch.no_grad()
def test_training_rows_equal_the_drafting_forward(llama):
    """A chain's rows in the training layout (`peagle_rows`) give the logits the drafter gives after those pairs."""
    head = random_head(llama, None, layers=2, std=0.3)
    ids = torch.tensor([PROMPTS[2][:12]])
    features, _ = target_pass(llama, ids, eagle3.feature_layers(LAYERS))
    kept = pard.drop_rows(ids.shape[1] - 1, 4, 1.0, 1.0, torch.Generator())
    out, block, position = peagle_rows(head, ids, features, kept)
    anchor = 6  # the chain from pair 6: its rows (b, 6 + b)
    chain = [int(((block == b) & (position == anchor + b)).nonzero()) for b in range(4)]
    made = drafter(llama, head, 4)
    prompt = ids[0, : anchor + 2].tolist()
    made.start([0], [Turn(prompt, 0.0, None, features[0, : anchor + 1])])
    ((logits, _),) = made._apart([(0, features[0, : anchor + 1], prompt[1:], 0)]).values()
    torch.testing.assert_close(head.logits(out[0, chain]), logits, atol=1e-5, rtol=1e-4)


def test_slots_draft_together_and_keep_their_batch_of_one_tokens(llama):
    """Three turns through two slots drafting in one forward: each turn's tokens and accepted lengths are its own."""
    head = random_head(llama, USED, layers=2, std=0.3)
    alone = [greedy(llama, drafter(llama, head, 4), p, n=24) for p in PROMPTS]
    made, widths = drafter(llama, head, 4, slots=2), []
    together = made._together
    made._together = lambda members: widths.append(len(members)) or together(members)
    conftest.same_tokens_in_slots(llama, made, alone, PROMPTS, 24)
    assert max(widths) == 2


class ClaimsUniform(conftest.ClaimsUniform, PEagle):
    pass


def small_sampling_test(cls, samples: int, batch: int = 1):
    model = random_llama(8, layers=5, hidden=32, seed=0, init=0.5)
    head = random_head(model, torch.tensor([0, 2, 3, 5, 7]), std=0.3)
    made = cls(head, 2, feature_layers=eagle3.feature_layers(5), target_vocab=8, slots=batch)
    return conftest.audited(made, model, [1, 2, 3], samples, batch)  # (two pairs: the first draft fits the padding)


def test_peagle_passes_the_sampling_test_and_the_planted_mistake_fails():
    """Draft vocabulary 5 of 8 target tokens: each row drawn over it and verified against that law on the target's,
    at B = 1 and with four slots drafting together (each slot's draws from its own generator)."""
    assert small_sampling_test(PEagle, 600).passed
    assert small_sampling_test(PEagle, 600, batch=4).passed
    assert not small_sampling_test(ClaimsUniform, 1500, batch=4).passed


def write_official(folder: Path, head: peagle.PEagleHead, raw: dict) -> Path:
    peagle.save(head, raw, folder)
    return folder


def raw_of(model, used=None, layers: int = 1) -> dict:
    vocab = model.get_output_embeddings().weight.shape[0]
    raw = {**eagle_heads.config_from_target(model.config), "draft_vocab_size": len(used) if used is not None else vocab}
    raw["mask_token_id"] = MASK
    if layers > 1:
        raw["draft_layers"] = layers
    return raw


def test_official_and_speculators_layouts_load_and_convert_byte_identically(tmp_path, llama):
    """speculators' peagle checkpoint (`models/peagle/config.py`: eagle3's keys plus mask_token_id; `core.py`: the
    tensor mask_hidden [1, 1, 3H], the first layer `layers.0.`, the others `layers.{i}.`) and ours (EAGLE-3's
    official layout plus mask_hidden and mask_token_id) hold the same tensors."""
    head = random_head(llama, USED, layers=2, std=0.2)
    raw = raw_of(llama, USED, layers=2)
    official = write_official(tmp_path / "official", head, raw)
    spec = tmp_path / "spec"
    convert(official, "speculators", spec)
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == MASK and config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["speculators_config"]["algorithm"] == "peagle"
    tensors = load_file(spec / "model.safetensors")
    assert tensors["mask_hidden"].shape == (1, 1, 3 * HIDDEN)
    assert "layers.0.self_attn.q_proj.weight" in tensors and "layers.1.mlp.down_proj.weight" in tensors
    assert not any(k.startswith("midlayer.") for k in tensors)
    back = tmp_path / "back"
    convert(spec, "official", back)
    before, after = load_file(official / "model.safetensors"), load_file(back / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((back / "config.json").read_text())["draft_layers"] == 2
    for folder in (official, spec, back):
        loaded = peagle.load(folder, llama)
        assert loaded.mask_token_id == MASK and len(loaded.layers) == 1
        assert torch.equal(loaded.mask_hidden, head.mask_hidden)
        reference = greedy(llama, Vanilla(), PROMPTS[0]).tokens
        assert greedy(llama, drafter(llama, loaded, 4), PROMPTS[0]).tokens == reference


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw, state: raw.pop("mask_token_id"), "needs mask_token_id"),
        (lambda raw, state: raw.update(mask_token_id=VOCAB), "needs mask_token_id"),
        (lambda raw, state: state.pop("mask_hidden"), "key 'mask_hidden' is missing"),
        (lambda raw, state: raw.update(draft_layers=0), "draft_layers must be"),
    ],
)
def test_bad_heads_are_one_line_errors(tmp_path, llama, edit, message):
    head = random_head(llama)
    raw, state = raw_of(llama), eagle3.saved_state(head)
    edit(raw, state)
    eagle_heads.save(state, raw, tmp_path)
    with pytest.raises(SpecbenchError, match=message) as err:
        peagle.load(tmp_path, llama)
    assert "\n" not in str(err.value)


def test_an_eagle3_speculators_head_is_not_a_peagle_one(tmp_path, llama):
    head = random_head(llama)
    raw = raw_of(llama)
    raw.pop("mask_token_id")
    state = {k: v for k, v in eagle3.saved_state(head).items() if k != "mask_hidden"}
    speculators.save_eagle3(state, raw, tmp_path, None, None)
    with pytest.raises(SpecbenchError, match="speculators 'eagle3' checkpoint: only peagle ones load as P-EAGLE"):
        peagle.load(tmp_path, llama)


def test_speculators_eagle3_heads_of_several_layers_now_load(tmp_path, llama):
    """speculators' eagle3 stacks `num_hidden_layers` layers (`eagle3/core.py`): the EAGLE-3 family runs them."""
    head = random_head(llama, layers=3)
    raw = {k: v for k, v in raw_of(llama, layers=3).items() if k != "mask_token_id"}
    state = {k: v for k, v in eagle3.saved_state(head).items() if k != "mask_hidden"}
    speculators.save_eagle3(state, raw, tmp_path, None, None)
    loaded = eagle3.load(tmp_path, llama)
    assert len(loaded.layers) == 2 and loaded.config.num_hidden_layers == 3


def test_train_peagle_writes_a_head_that_verify_passes(capsys, tiny_models, quick_text, tmp_path):
    """`specbench train peagle --format speculators` writes a peagle checkpoint the method runs (the greedy audit;
    the sampling audit is the small test's above: this random target's law is too flat to sample)."""
    target_dir, _ = tiny_models
    deep = tmp_path / "deep"  # EAGLE-3's fused states need >= 5 target layers
    model = random_llama(400, layers=5, seed=0, init=0.1)
    model.save_pretrained(deep)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (deep / name).write_bytes((target_dir / name).read_bytes())
    out = tmp_path / "peagle"
    argv = ["train", "peagle", "--target", str(deep), "--data", str(quick_text), "--out", str(out), "--smoke"]
    assert main([*argv, "--device", "cpu", "--format", "speculators", "--draft-vocab", "300"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["draft_vocab_size"] == 300
    accuracy = json.loads((out / "accuracy.json").read_text())["top1_accuracy_by_depth"]
    assert len(accuracy) == 8
    verify = "verify --method peagle --mode greedy --limit 1 --max-new-tokens 8 --device cpu"
    code = main([*verify.split(), "--model", str(deep), "--head", f"peagle={out}"])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 0 and "greedy: 6/6 questions token-identical" in text and "real mismatches -> pass" in text, text


def test_engine_mappings(tmp_path):
    assert speculative_config("peagle", {"peagle head": tmp_path}) == {
        "method": "eagle3",
        "model": str(tmp_path),
        "num_speculative_tokens": 8,
        "parallel_drafting": True,
    }
    assert "no P-EAGLE" in why_not("peagle", "llamacpp")


def test_preset():
    spec = methods.preset("peagle")
    assert spec.lossless and spec.params["num_draft_tokens"] == 8
    assert methods.registered("peagle").batched


def test_the_mask_rows_see_the_pairs_and_each_other_only_causally(llama):
    """The training mask gives parallel row (b, p) the pairs 0..p-b and its own chain's rows up to itself."""
    kept = [[0, 1, 2, 3], [1, 2, 3], [2, 3]]
    chains, allowed = pard.chain_rows(kept)
    assert chains[allowed[chains.index((2, 3))].nonzero().flatten().tolist()[-1]] == (2, 3)
    seen = {chains[j] for j in allowed[chains.index((2, 3))].nonzero().flatten().tolist()}
    assert seen == {(0, 0), (0, 1), (1, 2), (2, 3)}
    assert additive_mask(allowed, torch.float32).shape == (1, 1, len(chains), len(chains))
