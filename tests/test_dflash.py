import copy
import json

import pytest
import torch

from specbench.cli.main import main
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.losslessness import sampling_test
from specbench.core.proposer import Feedback, Turn
from specbench.engines.translate import speculative_config
from specbench.errors import SpecbenchError
from specbench.heads import dflash
from specbench.heads.checkpoint import save_safetensors
from specbench.heads.train import dflash_anchors, dflash_blocks, target_pass
from specbench.heads.train_config import TrainConfig, train_config
from specbench.methods.dflash import DFlash
from specbench.methods.vanilla import Vanilla

from . import conftest
from .conftest import CUDA, propose_one, random_llama


@pytest.fixture(scope="module")
def target():
    return random_llama(48, layers=6, hidden=64, seed=0)


def random_draft(target, layers=2, block=4, seed=1) -> dflash.DFlashDraft:
    torch.manual_seed(seed)
    return dflash.build(dflash.config_for(target.config, layers, block, mask_token_id=47)).eval()


def proposer(target, draft, k=None) -> DFlash:
    return DFlash(draft, target.get_input_embeddings(), target.get_output_embeddings(), k or draft.block_size - 1)


def test_default_target_layers_follow_the_official_rule():
    assert dflash.target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-4B-DFlash-b16's config
    assert dflash.target_layer_ids(12, 1) == [6]


@torch.no_grad()
def test_cached_context_in_chunks_equals_the_training_forward(target):
    """The proposer's path (context rows fed in chunks, their keys kept) and the training path (every block in one
    masked forward, seeing the context strictly before its anchor) give the same block states."""
    draft = random_draft(target)
    ids = torch.randint(0, 47, (1, 20), generator=torch.Generator().manual_seed(0))
    features, _ = target_pass(target, ids, draft.feature_layers)
    embed = target.get_input_embeddings()
    trained = dflash_blocks(draft, embed, ids, features, torch.tensor([[6, 11]]))  # [1, 2, bs, H]
    past, read = None, 0
    for root, want in ((6, trained[0, 0]), (11, trained[0, 1])):
        block = torch.full((1, draft.block_size), 47)
        block[0, 0] = ids[0, root]
        out, past = draft(embed(block), features[:, read:root], torch.arange(read, root + 4)[None], None, past)
        read = root
        torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-4)


def test_training_anchors_are_distinct_and_leave_room_for_a_block():
    cfg = TrainConfig(block_size=4, blocks=5)
    anchors = dflash_anchors(3, 12, cfg, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 5)
    assert all(len(set(row)) == 5 and max(row) <= 8 and row == sorted(row) for row in anchors.tolist())


def test_greedy_decoding_equals_vanilla_for_any_block_and_draft_count(target):
    prompt = [3, 5, 7, 9, 11, 3, 5]
    reference = decode(CachedLM(target), Vanilla(), prompt, max_new_tokens=24, temperature=0.0, stop_ids=set()).tokens
    for block, k in ((4, 3), (4, 1), (6, 5)):
        made = proposer(target, random_draft(target, block=block), k)
        ours = decode(CachedLM(target), made, prompt, max_new_tokens=24, temperature=0.0, stop_ids=set())
        assert ours.tokens == reference
        assert max(s.tree_size for s in ours.steps) == k + 1


class ClaimsUniform(conftest.ClaimsUniform, DFlash):
    pass


@pytest.fixture(scope="module")
def small_vocab():
    return random_llama(8, layers=1, hidden=32, seed=0, init=0.5)


def small_sampling_test(model, make, samples):
    torch.manual_seed(3)
    raw = dflash.config_for(model.config, 1, 3, mask_token_id=7)
    draft = dflash.build(raw).eval()
    with torch.no_grad():  # larger weights: peaked drafts that the target often rejects
        for p in draft.parameters():
            p.mul_(4)
    made = make(draft, model.get_input_embeddings(), model.get_output_embeddings(), 2)
    return sampling_test(
        CachedLM(model), made, [1, 2, 3, 1, 2], horizon=3, samples=samples, temperature=1.0, stop_ids=set(), seed=0
    )


def test_dflash_passes_the_sampling_test_and_the_planted_mistake_fails(small_vocab):
    assert small_sampling_test(small_vocab, DFlash, 1500).passed
    assert not small_sampling_test(small_vocab, ClaimsUniform, 1500).passed  # (p below 1e-300 at 1,000 already)


def published(tmp_path, target, **changes) -> str:
    """A scaled-down checkpoint with the released drafters' config keys and weight names (z-lab/Qwen3-4B-DFlash-b16:
    block_size at the top level, dflash_config with mask_token_id and target_layer_ids, num_target_layers)."""
    draft = random_draft(target, layers=2)
    text = target.config
    raw = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 4,
        "dflash_config": {"mask_token_id": 47, "target_layer_ids": [1, 3]},
        "dtype": "bfloat16",
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 1024,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": 6,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 48,
    }
    raw.update(changes)
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary.")}
    folder = tmp_path / "drafter"
    folder.mkdir(exist_ok=True)
    save_safetensors(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def test_the_published_layout_loads_and_drafts(tmp_path, target):
    draft = dflash.load(published(tmp_path, target), target)
    assert (draft.block_size, draft.mask_token_id, draft.feature_layers) == (4, 47, (2, 4))
    assert draft.config.rope_parameters["rope_theta"] == 1000000
    prompt = [3, 5, 7, 9, 11]
    reference = decode(CachedLM(target), Vanilla(), prompt, max_new_tokens=12, temperature=0.0, stop_ids=set()).tokens
    ours = decode(CachedLM(target), proposer(target, draft), prompt, max_new_tokens=12, temperature=0.0, stop_ids=set())
    assert ours.tokens == reference


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
        ({"num_target_layers": 36}, "reads target layers [1, 3] of 36, the target has 6"),
        ({"dflash_config": {"mask_token_id": 47, "target_layer_ids": [1, 7]}}, "target has 6"),
        ({"dflash_config": {"target_layer_ids": [1, 3]}}, "mask_token_id"),
        ({"hidden_size": 128}, "hidden size 128"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer 0 is sliding_attention"),
        ({"num_hidden_layers": 3, "layer_types": None}, "key 'layers.2.input_layernorm.weight' is missing"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(tmp_path, target, changes, message):
    with pytest.raises(SpecbenchError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        dflash.load(published(tmp_path, target, **changes), target)
    assert "\n" not in str(err.value)


def test_bad_draft_counts_are_refused(target):
    draft = random_draft(target, block=4)
    with pytest.raises(ValueError, match="1 to 3 tokens per block of 4"):
        proposer(target, draft, 4)
    assert DFlash(draft, None, None, 7, block_size=8).block == 8


def test_engine_mode_maps_to_vllms_dflash(tmp_path):
    assert speculative_config("dflash", {"dflash head": tmp_path}) == {
        "method": "dflash",
        "model": str(tmp_path),
        "num_speculative_tokens": 15,
    }


def test_train_dflash_writes_the_official_layout_that_verify_passes(capsys, tiny_models, quick_text, tmp_path):
    target_dir, _ = tiny_models
    data = quick_text
    out = tmp_path / "dflash"
    argv = ["train", "dflash", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--smoke"]
    assert main([*argv, "--device", "cpu", "--compact"]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["block_size"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [1, 1, 1]  # a 2-layer target: as far as it goes
    assert len(json.loads((out / "accuracy.json").read_text())["top1_accuracy_by_depth"]) == 7
    verify = "verify --method dflash[num_draft_tokens=7] --limit 1 --max-new-tokens 8 --samples 300 --horizon 2"
    code = main([*verify.split(), "--prompts", "1", "--model", str(target_dir), "--head", f"dflash={out}"])
    text = capsys.readouterr().out
    assert code == 0 and "greedy: 6/6 questions token-identical" in text and "verdict: pass" in text, text


def test_the_block_must_fit_the_training_window():
    with pytest.raises(SpecbenchError, match="--block-size must be from 2 to half of --seq-len"):
        train_config("dflash", seq_len=16, block_size=16)
    assert train_config("eagle", seq_len=16, block_size=16).seq_len == 16  # other kinds ignore the block


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_static_context_drafts_what_the_cached_one_does(target, device):
    """--graphs' block forward on preallocated slots (the new context rows padded to the most a step commits, the
    prompt's rows and a step past the padding run at their own count; captured on a GPU) gives the eager proposer's
    drafts and laws, step by step, for steps committing 1 to 4 rows."""
    model, draft = copy.deepcopy(target).to(device), random_draft(target).to(device)
    features = torch.randn(40, draft.feature_size, generator=torch.Generator().manual_seed(5)).to(device)
    tokens = torch.randint(0, 47, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    made = []
    for graphs in (False, True):
        made.append(DFlash(draft, model.get_input_embeddings(), model.get_output_embeddings(), 3, static=graphs))
        made[-1].start([0], [Turn(tokens[:9], 1.0, torch.Generator(device).manual_seed(0), features[:8])])
    end = 9
    for step in [1, 4, 2, 3, 1, 1, 4, 7, 2]:  # rows committed (7: past the padding of 4)
        drafts = [propose_one(p, tokens[:end], 10) for p in made]
        assert drafts[1].tree == drafts[0].tree
        torch.testing.assert_close(drafts[1].draft_probs, drafts[0].draft_probs, rtol=1e-4, atol=1e-5)
        for p in made:
            p.update([0], [tokens[: end + step]], drafts[:1], [Feedback(None, features[end - 1 : end - 1 + step])])
        end += step
    assert made[1].blocks.inputs and made[1].blocks.slots is not None


def test_ddtree_of_one_candidate_a_row_is_the_chain_and_its_trees_keep_vanillas_tokens(target):
    """tree=k with one candidate a row drafts the chain's tokens and accepts what it accepts; a wider tree keeps
    vanilla's greedy tokens (and here accepts at least as much a step, on average, as the chain of the same block)."""
    prompt = [3, 5, 7, 9, 11, 3, 5]
    reference = decode(CachedLM(target), Vanilla(), prompt, max_new_tokens=24, temperature=0.0, stop_ids=set())
    draft = random_draft(target, block=4)
    embed, readout = target.get_input_embeddings(), target.get_output_embeddings()
    runs = {
        name: decode(
            CachedLM(target),
            DFlash(draft, embed, readout, 3, **options),
            prompt,
            max_new_tokens=24,
            temperature=0.0,
            stop_ids=set(),
        )
        for name, options in (
            ("chain", {}),
            ("one", {"tree": 3, "tree_top_k": 1}),
            ("tree", {"tree": 12, "tree_top_k": 4}),
        )
    }
    assert runs["one"].tokens == runs["chain"].tokens == runs["tree"].tokens == reference.tokens
    assert runs["one"].accept_lengths == runs["chain"].accept_lengths
    assert max(s.tree_size for s in runs["tree"].steps) == 13
    mean = {name: sum(g.accept_lengths) / len(g.accept_lengths) for name, g in runs.items()}
    assert mean["tree"] >= mean["chain"]


def test_ddtree_passes_the_sampling_test_and_engines_refuse_it(small_vocab):
    """Its nodes are point masses, verified by the shared tree rule: exact at T = 1, and a tree whose nodes claim
    to be uniform draws (the planted mistake) fails. No engine builds its trees, so engine mode skips it with the
    reason rather than running the chain."""

    class ClaimsUniformTree(conftest.ClaimsUniformTree, DFlash):
        pass

    made = lambda *a: DFlash(*a, tree=5, tree_top_k=2)  # noqa: E731
    assert small_sampling_test(small_vocab, made, 1000).passed
    wrong = lambda *a: ClaimsUniformTree(*a, tree=5, tree_top_k=2)  # noqa: E731
    result = small_sampling_test(small_vocab, wrong, 800)
    assert not result.passed, result
    from specbench.engines import translate

    assert translate.why_not("dflash[tree=16]") == "its tree=16 has no setting in vllm's mapping"
    assert translate.why_not("dflash[tree=16]", "llamacpp") == "its tree=16 has no setting in llamacpp's mapping"
    assert translate.why_not("dflash[num_draft_tokens=7]") is None
