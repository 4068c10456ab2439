"""PARD-2: PARD's parallel drafter with the target's projected states added to its inputs (row p reads the states at
p - 1, a mask row its last real row's), on the owned decoder for every slot; its official layout (AMD-AGI/PARD
`pard/pard2_train.py`'s converter: config.json's pard2_* keys and warp_model.bin) and training."""

import json

import pytest
import torch

from specbench import methods
from specbench.cli.main import main
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.lanes import Lanes
from specbench.core.proposer import Feedback, Turn
from specbench.core.static_lm import BatchedLM
from specbench.engines.translate import why_not
from specbench.errors import SpecbenchError
from specbench.heads import pard2
from specbench.heads.train import pard2_rows, target_pass
from specbench.methods.pard2 import Pard2
from specbench.methods.vanilla import Vanilla
from specbench.models.decoder import Decoder

from . import conftest
from .conftest import propose_one, random_llama

VOCAB, LAYERS, WIDTH = 64, 4, 48  # the target's vocabulary and layers; the drafter's width (the target's is 64)
OFFICIAL = [-1, 2]  # transformers' hidden_states indices: the final normalised state, layer 2's output
PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 3], [1, 40], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
MASK = VOCAB - 1


@pytest.fixture(scope="module")
def llama():
    return random_llama(VOCAB, layers=LAYERS, seed=0, init=0.3)


def random_drafter(model, seed: int = 5, scale: float = 1.0, bias: bool = True, vocab: int = VOCAB):
    """(the transformers drafter, its target_proj, config.json): random, its states weighing as much as its tokens."""
    hf = random_llama(vocab, layers=2, hidden=WIDTH, seed=seed, init=0.3)
    hidden = model.config.hidden_size
    raw = pard2.config_of(hf.config.to_dict(), vocab - 1, scale, bias, OFFICIAL, hidden)
    proj = torch.nn.Linear(hidden * len(OFFICIAL), WIDTH, bias=bias)
    torch.nn.init.normal_(proj.weight, 0, 0.3)
    return hf, proj, raw


def owned(model, hf, proj, raw) -> pard2.Pard2Draft:
    layers = pard2.our_layers(raw["pard2_target_layers"], model.config.num_hidden_layers, "test")
    return pard2.Pard2Draft(Decoder.adopt(hf), proj, raw["pard2_scale"], raw, layers).eval()


def drafter(draft, k: int, slots: int = 1, features: bool = True, cls=Pard2) -> Pard2:
    return cls(draft, Lanes(BatchedLM(draft, slots, capture=False)), VOCAB, k, features)


def greedy(model, proposer, prompt, n=30):
    return decode(CachedLM(model), proposer, prompt, max_new_tokens=n, temperature=0, stop_ids=set())


@pytest.mark.parametrize("features", [True, False])
def test_greedy_pard2_matches_vanilla_token_for_token(llama, features):
    draft = owned(llama, *random_drafter(llama))
    for prompt in PROMPTS:
        reference = greedy(llama, Vanilla(), prompt, n=40).tokens
        for k in (1, 4, 8):
            gen = greedy(llama, drafter(draft, k, features=features), prompt, n=40)
            assert gen.tokens == reference and max(s.tree_size for s in gen.steps) <= k + 1


@torch.no_grad()
def official_drafts(hf, proj, scale: float, tokens: list[int], features: torch.Tensor | None, k: int) -> list[int]:
    """pard2_infer.py's drafting, cacheless: the committed tokens and k - 1 mask tokens, each row's input embedding
    plus scale * target_proj of the target's states one row back (zero at row 0; a mask row its last real row's),
    the last k rows' argmax."""
    ids = torch.tensor([tokens + [MASK] * (k - 1)])
    embeds = hf.get_input_embeddings()(ids)
    if features is not None:  # [len(tokens) - 1, F]: the states of every committed row but the root
        shifted = torch.cat([torch.zeros_like(features[:1]), features])  # row p: the states at p - 1
        shifted = torch.cat([shifted, shifted[-1:].expand(k - 1, -1)])
        embeds = embeds + scale * proj(shifted)[None]
    return hf(inputs_embeds=embeds).logits[0, -k:].argmax(-1).tolist()


@pytest.mark.parametrize("features", [True, False])
@torch.no_grad()
def test_each_chain_is_the_official_drafting_forward(llama, features):
    """Brute force against pard2_infer.py's inputs (TargetFeatEmbedWarp): at every step the chain equals one cacheless
    forward of the transformers drafter over every committed token and the masks; the states change the drafts."""
    hf, proj, raw = random_drafter(llama)
    k = 5
    made = drafter(owned(llama, hf, proj, raw), k, features=features)
    layers = pard2.our_layers(OFFICIAL, LAYERS, "test")
    target = CachedLM(llama)
    target.reset()
    tokens = list(PROMPTS[2][:6])
    prompt_states = target.run(tokens[:-1], layers=layers).features
    made.start([0], [Turn(tokens, 0.0, None, prompt_states if features else None)])
    rest, differ = PROMPTS[2][6:], 0
    for accepted in (2, 0, 3):
        drafted = list(propose_one(made, tokens, k).tree.tokens)
        states = target_pass(llama, torch.tensor([tokens]), layers)[0][0, :-1]
        assert drafted == official_drafts(hf, proj, 1.0, tokens, states if features else None, k)
        differ += drafted != official_drafts(hf, proj, 1.0, tokens, None if features else states, k)
        committed, rest = rest[: accepted + 1], rest[accepted + 1 :]
        n = len(tokens) - 1
        tokens = tokens + committed
        fed = target_pass(llama, torch.tensor([tokens]), layers)[0][0, n : n + len(committed)]  # root's, accepted's
        made.update([0], [tokens], [], [Feedback(None, fed if features else None)])  # type: ignore[arg-type]
    assert differ  # (the drafts read the states: a drafter ignoring them would fail one of the two)


def test_slots_draft_together_and_keep_their_batch_of_one_tokens(llama):
    draft = owned(llama, *random_drafter(llama))
    alone = [greedy(llama, drafter(draft, 4), p, n=24) for p in PROMPTS]
    conftest.same_tokens_in_slots(llama, drafter(draft, 4, slots=2), alone, PROMPTS, 24)


class ClaimsUniform(conftest.ClaimsUniform, Pard2):
    pass


def small_sampling_test(cls, samples: int, batch: int = 1):
    model = random_llama(8, layers=3, hidden=32, seed=0, init=0.5)
    hf = random_llama(8, layers=1, hidden=32, seed=4, init=0.5)
    proj = torch.nn.Linear(64, 32)
    torch.nn.init.normal_(proj.weight, 0, 0.3)
    raw = pard2.config_of(hf.config.to_dict(), 7, 1.0, True, OFFICIAL, 32)
    draft = pard2.Pard2Draft(Decoder.adopt(hf), proj, 1.0, raw, pard2.our_layers(OFFICIAL, 3, "test")).eval()
    made = cls(draft, Lanes(BatchedLM(draft, batch, capture=False)), 8, 2)
    return conftest.audited(made, model, [1, 2, 3], samples, batch)


def test_pard2_passes_the_sampling_test_and_the_planted_mistake_fails():
    """Each row drawn from the drafter's law and verified against it, at B = 1 and with four slots together."""
    assert small_sampling_test(Pard2, 600).passed
    assert small_sampling_test(Pard2, 600, batch=4).passed
    assert not small_sampling_test(ClaimsUniform, 400, batch=4).passed  # (p ~ 1e-40 and below at 400)


def test_official_and_compact_layouts_load_the_same_drafter(tmp_path, llama):
    """The official layout (config.json's pard2_* keys, model.safetensors, warp_model.bin with target_proj) loads to
    the drafter it was written from; a compact one leaves out the embedding, which is then the target's."""
    hf, proj, raw = random_drafter(llama)
    pard2.save(hf, proj, raw, tmp_path / "official")
    config = json.loads((tmp_path / "official" / "config.json").read_text())
    assert config["pard2"] is True and config["spd_type"] == "pard2" and config["pard2_target_dim"] == 128
    warp = torch.load(tmp_path / "official" / "warp_model.bin", weights_only=True)
    assert set(warp) == {"target_proj.weight", "target_proj.bias"}
    reference = greedy(llama, drafter(owned(llama, hf, proj, raw), 4), PROMPTS[0]).tokens
    loaded = pard2.load(tmp_path / "official", llama)
    assert loaded.feature_layers == (-1, 2) and loaded.pard_token == MASK
    assert greedy(llama, drafter(loaded, 4), PROMPTS[0]).tokens == reference
    same = random_llama(VOCAB, layers=2, hidden=64, seed=5, init=0.3)  # the target's width: its embedding fits
    same.model.embed_tokens.weight.data.copy_(llama.get_input_embeddings().weight)
    wide = torch.nn.Linear(128, 64)
    compact_raw = pard2.config_of(same.config.to_dict(), MASK, 0.5, True, OFFICIAL, 64)
    pard2.save(same, wide, compact_raw, tmp_path / "compact", compact=True)
    assert "model.embed_tokens.weight" not in __import__("safetensors.torch").torch.load_file(
        tmp_path / "compact" / "model.safetensors"
    )
    back = pard2.load(tmp_path / "compact", llama)
    assert torch.equal(back.get_input_embeddings().weight, llama.get_input_embeddings().weight)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw.pop("pard2"), "neither pard2: true nor spd_type: pard2"),
        (lambda raw: raw.pop("pard_token"), "no pard_token"),
        (lambda raw: raw.pop("pard2_target_layers"), "no pard2_target_layers"),
        (lambda raw: raw.update(pard2_target_layers=[-1, 9]), "reads target layer 9, the target's hidden states"),
        (lambda raw: raw.update(pard2_target_dim=100), "reads 100 target features"),
    ],
)
def test_bad_drafters_are_one_line_errors(tmp_path, llama, edit, message):
    hf, proj, raw = random_drafter(llama)
    raw.pop("spd_type")
    edit(raw)
    pard2.save(hf, proj, raw, tmp_path)
    with pytest.raises(SpecbenchError, match=message) as err:
        pard2.load(tmp_path, llama)
    assert "\n" not in str(err.value)


@torch.no_grad()
def test_training_rows_equal_the_drafting_forward(llama):
    """A chain's rows in the training layout (`pard2_rows`: the real rows, then COD's mask blocks, each reading the
    states its drafting reads) give the logits of pard2_infer.py's forward after the same tokens."""
    hf, proj, raw = random_drafter(llama)
    ids = torch.tensor([PROMPTS[2][:12]])
    layers = pard2.our_layers(OFFICIAL, LAYERS, "test")
    states, _ = target_pass(llama, ids, layers)
    from specbench.heads import pard

    kept = pard.drop_rows(ids.shape[1], 4, 1.0, 1.0, torch.Generator())
    logits, block, position = pard2_rows(hf, proj, 1.0, ids, states, kept, MASK)
    anchor = 6  # the chain after real token 6: rows (b, 6 + b)
    rows = [int(((block == b) & (position == anchor + b)).nonzero()) for b in range(4)]
    want = official_drafts(hf, proj, 1.0, ids[0, : anchor + 1].tolist(), states[0, :anchor], 4)
    assert logits[0, rows].argmax(-1).tolist() == want


def test_train_pard2_writes_a_drafter_that_verify_passes(capsys, tiny_models, quick_text, tmp_path):
    target_dir, draft_dir = tiny_models
    data = quick_text
    out = tmp_path / "pard2"
    argv = ["train", "pard2", "--target", str(target_dir), "--draft", str(draft_dir), "--data", str(data)]
    assert main([*argv, "--out", str(out), "--smoke", "--device", "cpu"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["spd_type"] == "pard2" and config["pard2_target_layers"] == [-1]
    accuracy = json.loads((out / "accuracy.json").read_text())["top1_accuracy_by_depth"]
    assert len(accuracy) == 4 and all(0 <= a <= 1 for a in accuracy)
    capsys.readouterr()
    verify = f"verify --method pard2 --mode greedy --limit 1 --max-new-tokens 8 --device cpu --head pard2={out}"
    code = main([*verify.split(), "--model", str(target_dir)])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 0 and "greedy: 6/6 questions token-identical" in text and "real mismatches -> pass" in text, text


def test_preset_and_engines():
    spec = methods.preset("pard2")
    assert spec.lossless and spec.params["num_draft_tokens"] == 8 and spec.params["target_features"] is True
    assert methods.registered("pard2").batched
    assert "no PARD-2" in why_not("pard2", "llamacpp") and why_not("pard2", "vllm")
