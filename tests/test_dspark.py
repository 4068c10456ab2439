"""DSpark: DFlash's block drafting with every row a draft, corrected left to right by a Markov head (vanilla, gated,
rnn), and the confidence head's cut; DeepSpec's checkpoint layout."""

import json

import pytest
import torch

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Turn
from specbench.engines.translate import server_flags, speculative_config, why_not
from specbench.errors import SpecbenchError
from specbench.heads import dflash, dspark
from specbench.heads.checkpoint import save_safetensors
from specbench.heads.train import target_pass
from specbench.methods.dspark import DSpark
from specbench.methods.vanilla import Vanilla

from . import conftest
from .conftest import propose_one, random_llama

VOCAB, MASK = 48, 47
PROMPTS = [[3, 5, 7, 9, 11, 3, 5], [1, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]]


@pytest.fixture(scope="module")
def target():
    return random_llama(VOCAB, layers=6, hidden=64, seed=0)


def config(target, kind="vanilla", rank=8, confidence=True, block=4) -> dict:
    """DeepSpec's config.json keys (`qwen3/config.py` build_draft_config) over the target's shape."""
    raw = dflash.config_for(target.config, 2, block, mask_token_id=MASK)
    settings = raw.pop("dflash_config")
    raw.pop("block_size")
    return {
        **raw,
        "architectures": ["Qwen3DSparkModel"],
        "block_size": block,
        "mask_token_id": MASK,
        "target_layer_ids": settings["target_layer_ids"],
        "num_anchors": 512,
        "markov_rank": rank,
        "markov_head_type": kind,
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": confidence and rank > 0,
    }


def random_draft(target, seed=1, std=0.3, **keys) -> dspark.DSparkDraft:
    torch.manual_seed(seed)
    draft = dspark.build(config(target, **keys)).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith(("markov_head", "confidence_head")):
                p.normal_(0, std)
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return draft


def greedy(target, proposer, prompt, n=24):
    return decode(CachedLM(target), proposer, prompt, max_new_tokens=n, temperature=0.0, stop_ids=set())


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn", "none"])
def test_greedy_decoding_equals_vanilla(target, kind):
    draft = random_draft(target, kind="vanilla" if kind == "none" else kind, rank=0 if kind == "none" else 8)
    for prompt in PROMPTS:
        reference = greedy(target, Vanilla(), prompt).tokens
        for k in (4, 2):
            ours = greedy(target, DSpark(draft, k), prompt)
            assert ours.tokens == reference
            assert max(s.tree_size for s in ours.steps) == k + 1  # (every row drafts: the anchor's too)


def markov_reference(draft, base, hidden, anchor):
    """DeepSpec's `markov_head.py` sample_block_tokens at T = 0, written out: row k's logits plus W2 W1[prev]
    (vanilla), W2(sigmoid(gate_proj([h; W1[prev]])) * W1[prev]) (gated), or the RNN's bias from its state."""
    head, prev, state, out = draft.markov_head, torch.tensor([anchor]), torch.zeros(1, draft.config.markov_rank), []
    for k in range(base.shape[1]):
        e = head.markov_w1.weight[prev]
        if head.kind == "vanilla":
            bias = e @ head.markov_w2.weight.T
        elif head.kind == "gated":
            gate = torch.sigmoid(torch.cat([hidden[:, k], e], -1) @ head.gate_proj.weight.T + head.gate_proj.bias)
            bias = (gate * e) @ head.markov_w2.weight.T
        else:
            g, c, o = (torch.cat([state, e, hidden[:, k]], -1) @ head.joint_proj.weight.T + head.joint_proj.bias).chunk(
                3, -1
            )
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            bias = torch.tanh(o) @ head.markov_w2.weight.T
        prev = (base[:, k] + bias).argmax(-1)
        out.append(int(prev))
    return out


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@torch.no_grad()
def test_each_block_is_the_markov_corrected_argmax_of_one_cacheless_forward(target, kind):
    """Brute force at every step: the block over every committed token's target states, its rows read out by the
    drafter's lm_head and corrected row by row from the anchor (`markov_reference`)."""
    draft = random_draft(target, kind=kind, std=0.6)
    made = DSpark(draft, 4)
    prompt = PROMPTS[2]
    features, _ = target_pass(target, torch.tensor([prompt]), made.feature_layers)
    tokens = prompt[:5]
    made.start([0], [Turn(tokens, 0.0, None, features[0, : len(tokens) - 1])])
    drafted = list(propose_one(made, tokens, 4).tree.tokens)
    block = torch.full((1, 4), MASK)
    block[0, 0] = tokens[-1]
    hidden, _ = draft(draft.embed_tokens(block), features[:, : len(tokens) - 1], torch.arange(len(tokens) + 3)[None])
    assert drafted == markov_reference(draft, draft.lm_head(hidden), hidden, tokens[-1])


def test_slots_draft_together_and_keep_their_batch_of_one_tokens(target):
    draft = random_draft(target, kind="rnn")
    alone = [greedy(target, DSpark(draft, 4), p) for p in PROMPTS]
    made, widths = DSpark(draft, 4, slots=2), []
    blocks = made.blocks
    assert blocks is not None
    together = blocks._together
    blocks._together = lambda members: widths.append(len(members)) or together(members)
    conftest.same_tokens_in_slots(target, made, alone, PROMPTS, 24)
    assert max(widths) == 2


class ClaimsUniform(conftest.ClaimsUniform, DSpark):
    pass


def small_sampling_test(cls, samples: int, batch: int = 1, **options):
    model = random_llama(8, layers=5, hidden=32, seed=0, init=0.5)
    torch.manual_seed(2)
    raw = {**config(model, kind="gated", rank=4, block=3), "mask_token_id": 7}
    draft = dspark.build(raw).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(4) if p.dim() > 1 else None  # peaked drafts that the target often rejects
    return conftest.audited(cls(draft, 2, slots=batch, **options), model, [1, 2, 3], samples, batch)


def test_dspark_passes_the_sampling_test_and_the_planted_mistake_fails():
    """Each row drawn from its Markov-corrected law (which depends on the row drawn before it) and verified against
    it: exact at B = 1 and with four slots drafting together; rows claimed uniform fail."""
    assert small_sampling_test(DSpark, 600).passed
    assert small_sampling_test(DSpark, 600, batch=4).passed
    assert not small_sampling_test(ClaimsUniform, 1500, batch=4).passed


class ClaimsUniformTree(conftest.ClaimsUniformTree, DSpark):
    pass


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_ddtree_of_one_candidate_a_row_is_the_chain_and_its_trees_keep_vanillas_tokens(target, kind):
    draft = random_draft(target, kind=kind)
    for prompt in PROMPTS[:2]:
        reference = greedy(target, Vanilla(), prompt).tokens
        chain = greedy(target, DSpark(draft, 4), prompt)
        one = greedy(target, DSpark(draft, 4, tree=4, tree_top_k=1), prompt)
        wide = greedy(target, DSpark(draft, 4, tree=12, tree_top_k=3), prompt)
        assert one.tokens == chain.tokens == wide.tokens == reference
        assert one.accept_lengths == chain.accept_lengths
        assert max(s.tree_size for s in wide.steps) == 13
    alone = [greedy(target, DSpark(draft, 4, tree=12, tree_top_k=3), p) for p in PROMPTS]
    conftest.same_tokens_in_slots(target, DSpark(draft, 4, tree=12, tree_top_k=3, slots=2), alone, PROMPTS, 24)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
@torch.no_grad()
def test_the_tree_holds_the_best_paths_under_the_markov_corrected_laws(target, kind):
    """Brute force over one cacheless block: every path whose tokens are each among the 3 likeliest of their row's
    law given the path above them (the Markov head stepped along the path), scored by summed log-probabilities;
    the tree of 10 is the best 10."""
    draft = random_draft(target, kind=kind, std=0.6)
    made = DSpark(draft, 3, tree=10, tree_top_k=3)
    prompt = PROMPTS[2]
    features, _ = target_pass(target, torch.tensor([prompt]), made.feature_layers)
    tokens = prompt[:5]
    made.start([0], [Turn(tokens, 0.0, None, features[0, : len(tokens) - 1])])
    tree = propose_one(made, tokens, 3).tree
    block = torch.full((1, 4), MASK)
    block[0, 0] = tokens[-1]
    hidden, _ = draft(draft.embed_tokens(block), features[:, : len(tokens) - 1], torch.arange(len(tokens) + 3)[None])
    base, paths = draft.lm_head(hidden)[0], []

    def walk(d, before, state, score, path):
        if d == 3:
            return
        bias, after = draft.markov_head.step(torch.tensor([before]), hidden[:, d], state)
        law = (base[d] + bias[0]).log_softmax(-1)
        for c in law.topk(3).indices.tolist():
            paths.append((score + float(law[c]), (*path, c)))
            walk(d + 1, c, after, score + float(law[c]), (*path, c))

    walk(0, tokens[-1], None, 0.0, ())
    assert len(tree) == 10
    got = {tuple(tree.tokens[r - 1] for r in tree.path(j + 1)) for j in range(len(tree))}
    assert got == {path for _, path in sorted(paths, reverse=True)[:10]}


def test_ddtree_passes_the_sampling_test_and_the_planted_mistake_fails():
    """Point-mass nodes verified by the shared tree rule: exact at T = 1 with four slots; nodes claimed uniform fail.
    A tree is verified whole, so the confidence cut is refused with it."""
    assert small_sampling_test(DSpark, 600, batch=4, tree=5, tree_top_k=2).passed
    assert not small_sampling_test(ClaimsUniformTree, 800, batch=4, tree=5, tree_top_k=2).passed
    with pytest.raises(ValueError, match="dspark's tree is verified whole"):
        DSpark(random_draft(random_llama(VOCAB, layers=2, hidden=64)), 3, confidence_threshold=0.5, tree=4)


def test_the_confidence_threshold_cuts_the_chain_before_its_first_unconfident_row(target):
    """DeepSpec's `_confident_prefix_length`: the rows before the first with sigmoid(conf) < threshold (per row, not
    cumulative); none confident: nothing is verified. Greedy tokens stay vanilla's either way."""
    draft = random_draft(target, kind="vanilla")
    prompt = PROMPTS[0]
    reference = greedy(target, Vanilla(), prompt).tokens
    for bias, longest in ((-20.0, 0), (20.0, 4)):
        with torch.no_grad():
            draft.confidence_head.proj.weight.zero_()
            draft.confidence_head.proj.bias.fill_(bias)
        ours = greedy(target, DSpark(draft, 4, confidence_threshold=0.5), prompt)
        assert ours.tokens == reference and max(s.tree_size for s in ours.steps) == longest + 1
    with torch.no_grad():  # a row's confidence is sigmoid of its state's first entry: rows 0, 1 and 3 confident
        draft.confidence_head.proj.weight.zero_()
        draft.confidence_head.proj.weight[0, 0] = 1.0
        draft.confidence_head.proj.bias.zero_()
    hidden = torch.zeros(4, draft.config.hidden_size)
    hidden[:, 0] = torch.tensor([5.0, 5.0, -5.0, 5.0])
    made = DSpark(draft, 4, confidence_threshold=0.5)
    (proposal,) = made._proposals([4], [hidden], [Turn(prompt, 0.0)], [prompt[-1]])
    assert len(proposal.tree) == 2


def write(folder, draft, raw) -> str:
    folder.mkdir()
    save_safetensors(dflash.saved_state(draft), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def test_deepspec_layout_loads(tmp_path, target):
    """DeepSpec's `Qwen3DSparkModel` tensors (`qwen3/modeling.py`, `markov_head.py`, `common.py`): DFlash's plus
    embed_tokens, lm_head, markov_head.markov_w{1,2}, gate_proj (gated) and confidence_head.proj."""
    draft = random_draft(target, kind="gated")
    keys = set(dflash.saved_state(draft))
    assert {"embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    assert {"markov_head.gate_proj.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"} <= keys
    assert draft.markov_head.markov_w2.weight.shape == (VOCAB, 8)  # nn.Linear(R -> V): [V, R]
    loaded = dspark.load(write(tmp_path / "d", draft, config(target, kind="gated")), target)
    prompt = PROMPTS[0]
    assert greedy(target, DSpark(loaded, 4), prompt).tokens == greedy(target, DSpark(draft, 4), prompt).tokens


def test_speculators_dspark_converts_both_ways_byte_identically_and_loads(tmp_path, target):
    """speculators' `models/dspark/config.py` (DSparkSpeculatorConfig: DFlash's fields, `sample_from_anchor` true,
    `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`) and DeepSpec's layout
    hold the same tensors; the speculators one drafts what DeepSpec's does."""
    from safetensors.torch import load_file

    from specbench.heads.convert import convert

    draft = random_draft(target, kind="rnn")
    raw = config(target, kind="rnn")
    official = write(tmp_path / "official", draft, raw)
    convert(tmp_path / "official", "speculators", tmp_path / "spec")
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_model_type"] == "dspark" and spec["architectures"] == ["DSparkSpeculator"]
    assert spec["sample_from_anchor"] is True and spec["markov_head_type"] == "rnn" and spec["markov_rank"] == 8
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in raw["target_layer_ids"]]
    assert spec["speculators_config"]["algorithm"] == "dspark"
    convert(tmp_path / "spec", "official", tmp_path / "back")
    before, after = (load_file(tmp_path / f / "model.safetensors") for f in ("official", "back"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["Qwen3DSparkModel"] and back["target_layer_ids"] == raw["target_layer_ids"]
    prompt = PROMPTS[0]
    reference = greedy(target, DSpark(dspark.load(official, target), 4), prompt).tokens
    assert greedy(target, DSpark(dspark.load(tmp_path / "spec", target), 4), prompt).tokens == reference
    spec["sample_from_anchor"] = False
    (tmp_path / "spec" / "config.json").write_text(json.dumps(spec))
    with pytest.raises(SpecbenchError, match="sets sample_from_anchor False: a dspark variant"):
        dspark.load(tmp_path / "spec", target)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"markov_head_type": "lstm"}, "markov_head_type 'lstm' is none of vanilla, gated, rnn"),
        ({"markov_rank": -1}, "markov_rank must be"),
        ({"num_target_layers": 9}, "reads target layers"),
    ],
)
def test_bad_drafters_are_one_line_errors(tmp_path, target, edit, message):
    draft = random_draft(target)
    with pytest.raises(SpecbenchError, match=message) as err:
        dspark.load(write(tmp_path / "d", draft, {**config(target), **edit}), target)
    assert "\n" not in str(err.value)


def test_preset_engines_and_what_it_refuses(target):
    spec = methods.preset("dspark")
    assert spec.lossless and spec.params["num_draft_tokens"] == 7
    assert speculative_config("dspark", {"dspark head": "D"}) == {
        "method": "dspark",
        "model": "D",
        "num_speculative_tokens": 7,
    }
    adaptive = speculative_config("dspark[verify=adaptive]", {"dspark head": "D"})
    assert why_not("dspark[verify=adaptive]") is None and adaptive["enable_adaptive_verification"] is True
    assert (
        why_not("dspark[confidence_threshold=0.5]") == "its confidence_threshold=0.5 has no setting in vllm's mapping"
    )
    with pytest.raises(SpecbenchError, match="verify=sometimes has no vllm setting; its vllm.enable_adaptive_verifica"):
        speculative_config("dspark[verify=sometimes]", {"dspark head": "D"})
    flags = server_flags("dspark[confidence_threshold=0.5]", {"dspark head": "D"})
    assert flags[:2] == ["--spec-type", "draft-dspark"] and flags[flags.index("--spec-draft-p-min") + 1] == "0.5"
    assert why_not("dspark[verify=adaptive]", "llamacpp") == "its verify=adaptive has no setting in llamacpp's mapping"
    with pytest.raises(ValueError, match="need a drafter with a confidence head"):
        DSpark(random_draft(target, confidence=False), 4, confidence_threshold=0.5)
    with pytest.raises(ValueError, match="drafts 1 to 4 tokens per block of 4"):
        DSpark(random_draft(target), 5)


def test_train_dspark_writes_deepspecs_layout_that_the_method_runs(capsys, tiny_models, quick_text, tmp_path):
    """`specbench train dspark` (DeepSpec's loss) writes a Qwen3DSparkModel the loader reads back and the greedy audit
    passes with, for each Markov head."""
    from specbench.cli.main import main

    target_dir, _ = tiny_models
    data = quick_text
    for kind in ("vanilla", "rnn"):
        out = tmp_path / kind
        argv = ["train", "dspark", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--smoke"]
        argv += ["--device", "cpu", "--block-size", "7", "--markov-rank", "8", "--markov-head", kind]
        assert main(argv) == 0, capsys.readouterr().err
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_head_type"] == kind
        assert len(json.loads((out / "accuracy.json").read_text())["top1_accuracy_by_depth"]) == 7
        verify = f"verify --method dspark --mode greedy --limit 1 --max-new-tokens 8 --device cpu --head dspark={out}"
        code = main([*verify.split(), "--model", str(target_dir)])
        captured = capsys.readouterr()
        assert code == 0 and "real mismatches -> pass" in captured.out, captured.out + captured.err
    assert (
        main(["train", "dspark", "--target", str(target_dir), "--out", str(tmp_path / "x"), "--markov-head", "lstm"])
        == 2
    )
