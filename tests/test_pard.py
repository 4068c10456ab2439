import json

import pytest
import torch

from specbench.cli.main import main
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.losslessness import sampling_test
from specbench.core.proposer import Turn
from specbench.engines.translate import speculative_config
from specbench.errors import SpecbenchError
from specbench.heads import pard
from specbench.methods.pard import Pard
from specbench.methods.vanilla import Vanilla

from . import conftest
from .conftest import propose_one, random_llama


def test_dropped_rows_keep_whole_chains():
    kept = pard.drop_rows(40, 6, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert kept[0] == list(range(40))
    for b in range(1, 6):
        assert len(kept[b]) == min(int(40 * max(0.7**b, 0.2)), 40 - b)
        assert all(p - 1 in kept[b - 1] and p >= b for p in kept[b])


def test_each_row_sees_what_its_mask_sees_at_inference():
    """Brute force: row (b, p) sees the real tokens 0..p-b and the masks (j, p-b+j) for j = 1..b, and learns x_{p+1}."""
    ids = list(range(10, 22))
    kept = pard.drop_rows(len(ids), 4, 0.8, 0.3, torch.Generator().manual_seed(1))
    tokens, positions, allowed, labels = pard.pard_example(ids, kept, 99)
    rows = [(b, p) for b, ps in enumerate(kept) for p in ps]
    for i, (b, p) in enumerate(rows):
        want = {(0, q) for q in range(p - b + 1)} | {(j, p - b + j) for j in range(1, b + 1)}
        assert {rows[j] for j in allowed[i].nonzero().flatten().tolist()} == want
        assert int(positions[i]) == p and int(tokens[i]) == (ids[p] if b == 0 else 99)
        assert int(labels[i]) == (ids[p + 1] if p + 1 < len(ids) else -100)


@pytest.fixture(scope="module")
def target():
    return random_llama(48, layers=2, hidden=64, seed=0)


@pytest.fixture(scope="module")
def drafter():
    return random_llama(48, layers=1, hidden=32, seed=5)


@torch.no_grad()
def test_training_rows_equal_the_inference_forward(drafter):
    """The rows of one chain in the training layout give the logits the drafter gives at inference after x_0..x_r."""
    ids = list(range(1, 13))
    kept = pard.drop_rows(len(ids), 4, 1.0, 1.0, torch.Generator())
    example = pard.pard_example(ids, kept, 47)
    trained = pard.forward_rows(drafter, example)
    rows = [(b, p) for b, ps in enumerate(kept) for p in ps]
    r = 6
    chain_rows = [rows.index((b, r + b)) for b in range(4)]
    live = drafter(torch.tensor([ids[: r + 1] + [47] * 3])).logits[0, -4:]
    torch.testing.assert_close(trained[chain_rows], live, atol=1e-5, rtol=1e-4)


def test_greedy_decoding_equals_vanilla_and_the_masks_leave_the_cache(target, drafter):
    prompt = [3, 5, 7, 9, 11, 3, 5]
    reference = decode(CachedLM(target), Vanilla(), prompt, max_new_tokens=24, temperature=0.0, stop_ids=set())
    for k in (1, 4):
        made = Pard(CachedLM(drafter), 47, 48, k)
        ours = decode(CachedLM(target), made, prompt, max_new_tokens=24, temperature=0.0, stop_ids=set())
        assert ours.tokens == reference.tokens
        assert max(s.tree_size for s in ours.steps) == k + 1
    made.start([0], [Turn(prompt, 0.0)])
    propose_one(made, prompt, 8)
    assert made.drafter.cached(0) == len(prompt)  # the prompt's rows only: the three masks' are gone


class ClaimsUniform(conftest.ClaimsUniform, Pard):
    pass


def small_sampling_test(make, samples):
    target = random_llama(8, layers=1, hidden=32, seed=0, init=0.5)
    draft = random_llama(8, layers=1, hidden=32, seed=1, init=0.5)
    return sampling_test(
        CachedLM(target),
        make(CachedLM(draft), 7, 8, 2),
        [1, 2, 3, 1, 2],
        horizon=3,
        samples=samples,
        temperature=1.0,
        stop_ids=set(),
        seed=0,
    )


def test_pard_passes_the_sampling_test_and_the_planted_mistake_fails():
    assert small_sampling_test(Pard, 1500).passed
    assert not small_sampling_test(ClaimsUniform, 1500).passed  # (p ~ 1e-164 at 1,000 already)


def test_a_smaller_drafter_vocabulary_is_padded_to_the_targets():
    drafter = random_llama(6, layers=1, hidden=32, seed=1, init=0.5)
    made = Pard(CachedLM(drafter), 5, 8, 2)
    made.start([0], [Turn([1, 2, 3], 1.0)])
    assert propose_one(made, [1, 2, 3], 4).draft_probs.shape == (2, 8)


def drafter_folder(tmp_path, drafter, **config) -> str:
    folder = tmp_path / "pard"
    drafter.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **config}))
    return str(folder)


def test_the_published_layout_loads(tmp_path, target, drafter):
    """amd/PARD-* are plain causal LMs whose config.json names the mask token (pard_token; TensorRT-LLM's
    mask_token_id)."""
    loaded = pard.load(drafter_folder(tmp_path, drafter, pard_token=47, spd_type="pard"), target)
    assert loaded.pard_token == 47
    assert pard.load(drafter_folder(tmp_path, drafter, mask_token_id=46), target).pard_token == 46


@pytest.mark.parametrize(
    ("config", "message"),
    [({}, "has no pard_token"), ({"pard_token": 48}, "mask 48"), ({"pard_token": True}, "has no pard_token")],
)
def test_bad_drafters_are_one_line_errors(tmp_path, target, drafter, config, message):
    with pytest.raises(SpecbenchError, match=message) as err:
        pard.load(drafter_folder(tmp_path, drafter, **config), target)
    assert "\n" not in str(err.value)


def test_a_larger_drafter_vocabulary_is_refused(tmp_path, target):
    big = random_llama(64, layers=1, hidden=32, seed=1)
    with pytest.raises(SpecbenchError, match="reads out 64 tokens"):
        pard.load(drafter_folder(tmp_path, big, pard_token=60), target)


def test_engine_mode_maps_to_vllms_parallel_drafting(tmp_path):
    assert speculative_config("pard", {"pard head": tmp_path}) == {
        "method": "draft_model",
        "model": str(tmp_path),
        "num_speculative_tokens": 8,
        "parallel_drafting": True,
        "draft_sample_method": "probabilistic",
    }


def test_train_pard_makes_a_drafter_that_verify_passes(capsys, tiny_models, quick_text, tmp_path):
    """`specbench train pard` adapts the draft into a PARD checkpoint (pard_token, spd_type, tokenizer), and the
    audit passes with it."""
    target_dir, draft_dir = tiny_models
    data = quick_text
    out = tmp_path / "pard"
    argv = ["train", "pard", "--target", str(target_dir), "--draft", str(draft_dir), "--data", str(data)]
    assert main([*argv, "--out", str(out), "--smoke", "--device", "cpu"]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["spd_type"] == "pard" and isinstance(config["pard_token"], int)
    assert (out / "tokenizer.json").is_file()
    assert len(json.loads((out / "accuracy.json").read_text())["top1_accuracy_by_depth"]) == 4
    verify = "verify --method pard --limit 1 --max-new-tokens 8 --samples 300 --horizon 2 --prompts 1 --device cpu"
    code = main([*verify.split(), "--model", str(target_dir), "--head", f"pard={out}"])
    text = capsys.readouterr().out
    assert code == 0 and "greedy: 6/6 questions token-identical" in text and "verdict: pass" in text, text
