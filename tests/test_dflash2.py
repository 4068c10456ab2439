"""DFlash2: DFlash's block drafter with grouped causal convolutions around every sublayer and a candidate selector
walking each row's top-K (vLLM `qwen3_dflash2.py`, `spec_decode/dflash2/speculator.py`); its laws over K candidates
verified exactly; its layout and training."""

import json

import pytest
import torch

from specbench import methods
from specbench.cli.main import main
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Turn
from specbench.engines.translate import server_flags, speculative_config
from specbench.errors import SpecbenchError
from specbench.heads import dflash, dflash2
from specbench.heads.train import dflash_blocks, target_pass
from specbench.methods.dflash2 import DFlash2
from specbench.methods.vanilla import Vanilla

from . import conftest
from .conftest import propose_one, random_llama

VOCAB, MASK = 48, 47
PROMPTS = [[3, 5, 7, 9, 11, 3, 5], [1, 40], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def target():
    return random_llama(VOCAB, layers=6, hidden=64, seed=0, init=0.1)


def random_draft(model, block=5, taps=2, top=6, seed=1, std=0.3) -> dflash2.DFlash2Draft:
    """A DFlash2 drafter whose convolutions and selector are far from the identity and from zero."""
    torch.manual_seed(seed)
    raw = dflash2.config_for(model.config, 2, block, MASK, taps=taps, group=16, rank=4, top=top)
    draft = dflash2.build(raw).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.normal_(0, std)
    return draft


def made(model, draft, k=None, slots=1, cls=DFlash2, **options) -> DFlash2:
    embedding, readout = model.get_input_embeddings(), model.get_output_embeddings()
    return cls(draft, embedding, readout, k or draft.block_size - 1, slots=slots, **options)


def greedy(model, proposer, prompt, n=24):
    return decode(CachedLM(model), proposer, prompt, max_new_tokens=n, temperature=0.0, stop_ids=set())


@torch.no_grad()
def test_the_convolution_is_vllms_grouped_causal_one_written_out():
    """Row i of block b: sum over taps t <= i's place in its block of (base[side, t, ch] + delta[i, t, ch's group])
    * x[i - t, ch]; the rows of the block before never reach it."""
    conv = dflash2.GroupedConv(hidden=8, taps=3, group=4, block=4)
    torch.manual_seed(0)
    for p in conv.parameters():
        p.normal_()
    x = torch.randn(2, 8, 8)  # two blocks of 4 rows
    for side in (0, 1):
        delta = torch.randn(2, 8, 3, 2)
        out = conv.convolve(x, delta, side)
        for b, i, ch in ((0, 0, 1), (1, 3, 5), (0, 5, 7), (1, 4, 2), (0, 6, 0)):
            want = sum(
                (conv.base_kernel[side, t, ch] + delta[b, i, t, ch // 4]) * x[b, i - t, ch]
                for t in range(3)
                if i % 4 >= t
            )
            torch.testing.assert_close(out[b, i, ch], want)
    fresh = dflash2.GroupedConv(hidden=8, taps=2, group=4, block=4)
    normed, after = fresh.prepare(x)
    assert torch.equal(normed, x) and torch.equal(fresh.finish(x, after), x)  # the identity at initialisation


@torch.no_grad()
def test_with_identity_convolutions_the_backbone_is_dflashs(target):
    """A fresh DFlash2 drafter (convolutions the identity) on DFlash's weights gives DFlash's states."""
    draft = dflash2.build(dflash2.config_for(target.config, 2, 5, MASK, taps=2, group=16, rank=4, top=6)).eval()
    plain = dflash.build(dflash.config_for(target.config, 2, 5, MASK)).eval()
    state = dflash.saved_state(plain)
    draft.load_state_dict(state, strict=False)
    ids = torch.randint(0, MASK, (1, 16), generator=torch.Generator().manual_seed(0))
    features, _ = target_pass(target, ids, draft.feature_layers)
    embed = target.get_input_embeddings()
    anchors = torch.tensor([[4, 9]])
    torch.testing.assert_close(
        dflash_blocks(draft, embed, ids, features, anchors), dflash_blocks(plain, embed, ids, features, anchors)
    )


def walk(scores: torch.Tensor, ids: torch.Tensor) -> list[int]:
    """The speculator's greedy walk written out: row j's best candidate after the one chosen at row j - 1."""
    chosen, out = 0, []
    for j in range(scores.shape[0]):
        row = scores[j, chosen]
        chosen = int(row.argmax())
        out.append(int(ids[j, chosen]))
    return out


@torch.no_grad()
def cacheless_scores(target, draft, proposer):
    """One proposal of 4 after a prompt's first 6 tokens, and brute force's edge scores [4, 6, 6] and candidates
    [4, 6] for it: the block's rows over every committed token's states, each row's top-6 under the target's
    readout, edges scored from the codebooks by loops."""
    prompt = PROMPTS[2]
    features, _ = target_pass(target, torch.tensor([prompt]), draft.feature_layers)
    tokens = prompt[:6]
    proposer.start([0], [Turn(tokens, 0.0, None, features[0, : len(tokens) - 1])])
    drafted = propose_one(proposer, tokens, 4)
    block = torch.full((1, 5), MASK)
    block[0, 0] = tokens[-1]
    hidden, _ = draft(draft.embed(block, target.get_input_embeddings()), features[:, :5], torch.arange(10)[None])
    rows = hidden[0, 1:]  # [4, H]: the mask rows
    values, ids = target.get_output_embeddings()(rows).topk(6, dim=-1)
    selector = draft.candidate_selector
    scores = torch.zeros(4, 6, 6)
    for j in range(4):
        gate = selector.hidden_projection(rows[j])
        for p in range(6):
            before = tokens[-1] if j == 0 else int(ids[j - 1, p])
            for c in range(6):
                edge = (selector.predecessor_codebook[before] * gate * selector.successor_codebook[ids[j, c]]).sum()
                scores[j, p, c] = values[j, c] + edge
    return drafted, (scores, ids)


def test_each_chain_is_the_selectors_walk_over_one_cacheless_block(target):
    draft = random_draft(target)
    drafted, (scores, ids) = cacheless_scores(target, draft, made(target, draft))
    assert list(drafted.tree.tokens) == walk(scores, ids)


def test_greedy_decoding_equals_vanilla(target):
    for prompt in PROMPTS:
        reference = greedy(target, Vanilla(), prompt).tokens
        for k in (4, 2):
            ours = greedy(target, made(target, random_draft(target), k), prompt)
            assert ours.tokens == reference and max(s.tree_size for s in ours.steps) == k + 1


def test_slots_draft_together_and_keep_their_batch_of_one_tokens(target):
    draft = random_draft(target)
    alone = [greedy(target, made(target, draft, 4), p) for p in PROMPTS]
    conftest.same_tokens_in_slots(target, made(target, draft, 4, slots=2), alone, PROMPTS, 24)


class ClaimsUniform(conftest.ClaimsUniform, DFlash2):
    pass


def small_sampling_test(cls, samples: int, batch: int = 1, top: int = 3, **options):
    """Eight tokens, three candidates a row: the proposal's law is zero on five of them."""
    model = random_llama(8, layers=5, hidden=32, seed=0, init=0.5)
    torch.manual_seed(2)
    draft = dflash2.build(dflash2.config_for(model.config, 1, 3, 7, taps=2, group=8, rank=4, top=top)).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.normal_(0, 1.0)
    return conftest.audited(made(model, draft, 2, slots=batch, cls=cls, **options), model, [1, 2, 3], samples, batch)


def test_dflash2_passes_the_sampling_test_over_its_candidates_and_the_planted_mistake_fails():
    """Each row drawn from softmax(score / T) over its candidates and verified against that law, zero elsewhere:
    exact at B = 1 and with four slots drafting together (its laws kept sparse: `SparseLaws`); rows claimed uniform
    over their candidates fail."""
    assert small_sampling_test(DFlash2, 600).passed
    assert small_sampling_test(DFlash2, 600, batch=4).passed
    assert not small_sampling_test(ClaimsUniform, 400, batch=4).passed  # (p ~ 1e-40 and below at 400)


def test_the_layout_loads_and_the_families_refuse_each_other(tmp_path, target):
    draft = random_draft(target)
    raw = dflash2.config_for(target.config, 2, 5, MASK, taps=2, group=16, rank=4, top=6)
    dflash.save(draft, raw, tmp_path / "two")
    loaded = dflash2.load(tmp_path / "two", target)
    reference = greedy(target, made(target, draft, 4), PROMPTS[0]).tokens
    assert greedy(target, made(target, loaded, 4), PROMPTS[0]).tokens == reference
    with pytest.raises(SpecbenchError, match="is a DFlash2DraftModel .* run it as dflash2") as err:
        dflash.load(tmp_path / "two", target)
    assert "\n" not in str(err.value)
    dflash.save(
        dflash.build(dflash.config_for(target.config, 2, 5, MASK)),
        dflash.config_for(target.config, 2, 5, MASK),
        tmp_path / "one",
    )
    with pytest.raises(SpecbenchError, match="do not name DFlash2DraftModel: run it as dflash"):
        dflash2.load(tmp_path / "one", target)
    bad = {**raw, "dflash_config": {**raw["dflash_config"], "selector_top_k": 0}}
    (tmp_path / "two" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(SpecbenchError, match="dflash_config.selector_top_k, a whole number >= 1"):
        dflash2.load(tmp_path / "two", target)


class ClaimsUniformTree(conftest.ClaimsUniformTree, DFlash2):
    pass


def test_ddtree_of_one_candidate_a_row_is_the_chain_and_its_trees_keep_vanillas_tokens(target):
    draft = random_draft(target)
    for prompt in PROMPTS[:2]:
        reference = greedy(target, Vanilla(), prompt).tokens
        chain = greedy(target, made(target, draft, 4), prompt)
        one = greedy(target, made(target, draft, 4, tree=4, tree_top_k=1), prompt)
        wide = greedy(target, made(target, draft, 4, tree=12, tree_top_k=3), prompt)
        assert one.tokens == chain.tokens == wide.tokens == reference
        assert one.accept_lengths == chain.accept_lengths
        assert max(s.tree_size for s in wide.steps) == 13
    alone = [greedy(target, made(target, draft, 4, tree=12, tree_top_k=3), p) for p in PROMPTS]
    conftest.same_tokens_in_slots(target, made(target, draft, 4, slots=2, tree=12, tree_top_k=3), alone, PROMPTS, 24)


@torch.no_grad()
def test_the_tree_holds_the_best_paths_through_the_selectors_candidates(target):
    """Brute force over one cacheless block (`cacheless_scores`): every path of candidates, each among the 3 best of
    its row's log-softmax of the edge scores from the candidate before it, scored by their sum; the tree of 10 is
    the best 10."""
    draft = random_draft(target)
    proposer = made(target, draft, tree=10, tree_top_k=3)
    drafted, (scores, ids) = cacheless_scores(target, draft, proposer)
    paths = []

    def walk(d, before, score, path):
        if d == 4:
            return
        law = scores[d, before].log_softmax(-1)
        for c in law.topk(3).indices.tolist():
            paths.append((score + float(law[c]), (*path, int(ids[d, c]))))
            walk(d + 1, c, score + float(law[c]), (*path, int(ids[d, c])))

    walk(0, 0, 0.0, ())
    tree = drafted.tree
    got = {tuple(tree.tokens[r - 1] for r in tree.path(j + 1)) for j in range(len(tree))}
    assert len(tree) == 10 and got == {path for _, path in sorted(paths, reverse=True)[:10]}


def test_ddtree_passes_the_sampling_test_and_the_planted_mistake_fails():
    assert small_sampling_test(DFlash2, 600, batch=4, tree=5, tree_top_k=2).passed
    assert not small_sampling_test(ClaimsUniformTree, 800, batch=4, tree=5, tree_top_k=2).passed


def test_train_dflash2_writes_a_drafter_that_verify_passes(capsys, tiny_models, quick_text, tmp_path):
    target_dir, _ = tiny_models
    out = tmp_path / "dflash2"
    argv = ["train", "dflash2", "--target", str(target_dir), "--data", str(quick_text), "--out", str(out)]
    assert main([*argv, "--smoke", "--device", "cpu"]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 16
    verify = "verify --method dflash2[num_draft_tokens=7] --limit 1 --max-new-tokens 8 --samples 300 --horizon 2"
    code = main([*verify.split(), "--prompts", "1", "--model", str(target_dir), "--head", f"dflash2={out}"])
    text = capsys.readouterr().out
    assert code == 0 and "greedy: 6/6 questions token-identical" in text and "verdict: pass" in text, text
    there = tmp_path / "speculators"  # (vLLM's speculators format, as `--format speculators` writes it)
    assert main([*argv[:-1], str(there), "--smoke", "--device", "cpu", "--format", "speculators"]) == 0
    config = json.loads((there / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["selector_top_k"] == 16
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)


def test_preset_and_engines():
    spec = methods.preset("dflash2")
    assert spec.lossless and spec.params["num_draft_tokens"] == 15
    assert methods.registered("dflash2").batched
    assert server_flags("dflash2", {"dflash2 head": "D"})[:4] == [
        "--spec-type",
        "draft-dflash",
        "--spec-draft-model",
        "D",
    ]
    assert speculative_config("dflash2", {"dflash2 head": "D"}) == {
        "method": "dflash",
        "model": "D",
        "num_speculative_tokens": 15,
    }


def test_the_speculators_dflash2_type_loads_and_round_trips(tmp_path, target):
    """speculators' `dflash2` type (`models/dflash2/config.py`: dflash's keys plus the convolution's and selector's
    at the top level, `speculators_model_type` "dflash2", architectures DFlash2DraftModel; the tensors by z-lab's
    names, `model_definitions.py`): converted both ways, byte-identical tensors and the same config; loaded, it
    drafts as the official layout does."""
    from safetensors.torch import load_file

    draft = random_draft(target)
    raw = dflash2.config_for(target.config, 2, 5, MASK, taps=2, group=16, rank=4, top=6)
    dflash.save(draft, raw, tmp_path / "official")
    there, back = tmp_path / "speculators", tmp_path / "back"
    assert main(["convert", str(tmp_path / "official"), "--to", "speculators", "--out", str(there)]) == 0
    config = json.loads((there / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert {config[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        2,
        16,
        4,
        6,
    }
    assert config["sample_from_anchor"] is False and "selector_top_k" not in config.get("dflash_config", {})
    assert config["speculators_config"]["algorithm"] == "dflash2"
    assert main(["convert", str(there), "--to", "official", "--out", str(back)]) == 0
    tensors = [load_file(str(folder / "model.safetensors")) for folder in (tmp_path / "official", there, back)]
    assert tensors[0].keys() == tensors[1].keys() == tensors[2].keys()
    assert all(torch.equal(tensors[0][k], t[k]) for t in tensors[1:] for k in tensors[0])
    official = json.loads((tmp_path / "official" / "config.json").read_text())
    assert json.loads((back / "config.json").read_text())["dflash_config"] == official["dflash_config"]
    reference = greedy(target, made(target, draft, 4), PROMPTS[0]).tokens
    assert greedy(target, made(target, dflash2.load(there, target), 4), PROMPTS[0]).tokens == reference
    config["speculators_model_type"] = "dflash"
    (there / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecbenchError, match="speculators 'dflash' checkpoint: only dflash2 ones load as DFlash2"):
        dflash2.load(there, target)
