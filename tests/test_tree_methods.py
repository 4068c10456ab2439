"""Medusa, EAGLE-1 and EAGLE-2 through the shared loop: trees from choices, typical acceptance, greedy
equality with vanilla, acceptance of briefly trained heads, and the sampling test."""

import copy

import pytest
import torch

from specbench import methods, presets
from specbench.core import acceptance
from specbench.core.cached_lm import CachedLM
from specbench.core.choices import EAGLE_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63
from specbench.core.decode import decode
from specbench.core.losslessness import sampling_test
from specbench.core.tree import Tree, from_choices
from specbench.errors import SpecbenchError
from specbench.heads.eagle import build, config_from_target
from specbench.heads.medusa import MedusaHeads
from specbench.heads.train import train_eagle, train_medusa
from specbench.heads.train_config import TrainConfig
from specbench.methods.eagle import Eagle
from specbench.methods.eagle_trees import DynamicTree, StaticTree
from specbench.methods.medusa import Medusa
from specbench.methods.vanilla import Vanilla

from .conftest import CUDA, random_llama, random_qwen2, recording

PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 3], [1, 20, 21, 22, 23, 20, 21], [1, 40], [7]]


def test_trees_from_choices():
    medusa = from_choices(MEDUSA_MC_SIM_7B_63)
    depths = medusa.depths()
    assert len(medusa) == 63 and [depths.count(d) for d in (1, 2, 3, 4)] == [10, 28, 23, 2]
    assert sum(not kids for kids in medusa.children()[1:]) == 42  # leaves
    eagle = from_choices(EAGLE_MC_SIM_7B_63)
    assert len(eagle) == 25 and eagle.max_depth() == 5 and len(eagle.children()[0]) == 4
    small = from_choices([[0], [1], [2], [0, 2], [2, 0]], max_rank=2)
    assert small.tokens == [0, 1] and small.parents == [-1, -1]
    with pytest.raises(ValueError, match="no parent"):
        from_choices([[0], [1, 0]])


def test_typical_acceptance_hand_worked():
    # Root row p0 = [.6, .3, .1, 0]: H = 0.898, .3 exp(-H) = 0.122, bar min(.09, .122) = .09: tokens 0, 1 pass.
    # Row 1 (after 0) uniform: bar min(.09, .3/4) = .075 < .25: token 3 passes.
    # Row 2 (after 1) [.05, .05, .85, .05]: bar .09 < .85: token 2 passes. Both paths are 2 deep; the tie goes
    # to the larger log-likelihood: log .3 + log .85 = -1.37 > log .6 + log .25 = -1.90.
    tree = Tree([0, 1, 3, 2], [-1, -1, 0, 1])
    probs = torch.tensor(
        [[0.6, 0.3, 0.1, 0.0], [0.25] * 4, [0.05, 0.05, 0.85, 0.05], [0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    )
    assert acceptance.typical(tree, probs) == acceptance.Accepted([2, 4], 1, 2)
    probs[2] = torch.tensor([0.95, 0.02, 0.01, 0.02])  # bar .09 > .01: token 2 fails, the other path wins
    assert acceptance.typical(tree, probs) == acceptance.Accepted([1, 3], 2, 2)
    probs[0] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # no child of the root passes: nothing accepted
    assert acceptance.typical(tree, probs) == acceptance.Accepted([], 2, 1)


def random_medusa(model, num_heads=5, seed=1, **kw):
    torch.manual_seed(seed)
    vocab, hidden = model.get_output_embeddings().weight.shape
    heads = MedusaHeads(num_heads, 1, hidden, vocab)
    for head in heads:
        torch.nn.init.normal_(head[0].linear.weight, std=0.05)
    heads.to(model.get_output_embeddings().weight.device)
    tree = kw.pop("tree", MEDUSA_MC_SIM_7B_63)
    return Medusa(heads, model.get_output_embeddings(), tree, **kw)


def random_eagle_head(model, seed=2):
    torch.manual_seed(seed)
    head = build(config_from_target(model.config))
    head.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    return head.eval()


def proposers(model, head):
    lm_head = model.get_output_embeddings()
    return {
        "medusa": random_medusa(model),
        "medusa_sampled": random_medusa(model, sampled=True),  # T = 0: the same as medusa
        "eagle": Eagle(head, lm_head, StaticTree(EAGLE_MC_SIM_7B_63)),
        "eagle2": Eagle(head, lm_head, DynamicTree(60, 5, 10)),
        "eagle2_small": Eagle(head, lm_head, DynamicTree(8, 3, 2)),
        "eagle2_sampled": Eagle(head, lm_head, DynamicTree(8, 3, 2), sampled=True),  # T = 0: the same as eagle2
    }


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return (random_llama if request.param == "llama" else random_qwen2)(64, seed=0, init=0.3)


def greedy(model, proposer, prompt, n=40):
    return decode(CachedLM(model), proposer, prompt, max_new_tokens=n, temperature=0, stop_ids=set())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tree_methods_match_vanilla_token_for_token(target, prompt):
    reference = greedy(target, Vanilla(), prompt).tokens
    for name, proposer in proposers(target, random_eagle_head(target)).items():
        gen = greedy(target, proposer, prompt)
        assert gen.tokens == reference, name
        assert sum(gen.accept_lengths) == len(reference)


def test_stop_token_and_budget_cut_tree_steps(target):
    reference = greedy(target, Vanilla(), PROMPTS[0], n=30).tokens
    for name, proposer in proposers(target, random_eagle_head(target)).items():
        gen = decode(CachedLM(target), proposer, PROMPTS[0], max_new_tokens=30, temperature=0, stop_ids={reference[9]})
        assert gen.tokens == reference[: reference.index(reference[9]) + 1], name
        assert greedy(target, proposer, PROMPTS[0], n=7).tokens == reference[:7], name


def bigram_target():
    """A one-layer random Llama whose attention output is zero: each next token depends on the current one only,
    so a head can learn (or be built to compute) the target's guesses several tokens ahead."""
    model = random_llama(64, layers=1, seed=3, init=0.3)
    model.model.layers[0].self_attn.o_proj.weight.data.zero_()
    return model


def test_a_head_that_copies_the_target_is_always_accepted():
    """fc passes the embedding through and the draft layer is the target's own (attention off, same MLP and norm):
    the draft feature is the target's up to the final RMSNorm's positive scale, so every greedy guess is right."""
    model = bigram_target()
    head = build(config_from_target(model.config))
    with torch.no_grad():
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        head.fc.weight.zero_()
        head.fc.weight[:, :64] = torch.eye(64)
        head.fc.bias.zero_()
        head.layers[0].self_attn.out.weight.zero_()  # (o_proj in the checkpoint: `Joined`)
        head.layers[0].mlp.load_state_dict(model.model.layers[0].mlp.state_dict())
        head.layers[0].post_attention_layernorm.load_state_dict(
            model.model.layers[0].post_attention_layernorm.state_dict()
        )
    lm_head = model.get_output_embeddings()
    reference = greedy(model, Vanilla(), [1, 50], n=60).tokens
    for proposer in (Eagle(head, lm_head, StaticTree(EAGLE_MC_SIM_7B_63)), Eagle(head, lm_head, DynamicTree(20, 4, 4))):
        gen = greedy(model, proposer, [1, 50], n=60)
        assert gen.tokens == reference and gen.accept_lengths == [6] * 10  # depth 5 + the target's own token


@pytest.fixture(scope="module")
def self_trained():
    """The bigram target, its own greedy text, and Medusa/EAGLE heads trained on that text for a second or two."""
    model = bigram_target()
    text = [greedy(model, Vanilla(), [1, s], n=40).tokens for s in range(3, 64, 2)]
    stream = torch.tensor([t for doc in text for t in doc])
    cfg = TrainConfig(steps=150, lr=3e-3, seq_len=32, batch_size=8, eval_batches=2, medusa_heads=4)
    heads, medusa_accuracy = train_medusa(model, stream, stream, cfg)
    head, _, eagle_accuracy = train_eagle(model, stream, stream, cfg, depths=4)
    return model, heads, head, medusa_accuracy, eagle_accuracy


def test_heads_trained_on_the_targets_own_text_are_accepted(self_trained):
    model, heads, head, medusa_accuracy, eagle_accuracy = self_trained
    assert len(medusa_accuracy) == 4 and len(eagle_accuracy) == 4
    assert min(medusa_accuracy) > 0.5 and min(eagle_accuracy) > 0.5, (medusa_accuracy, eagle_accuracy)
    lm_head = model.get_output_embeddings()
    prompt = [1, 50]
    reference = greedy(model, Vanilla(), prompt, n=60).tokens
    for proposer in (
        Medusa(heads, lm_head, [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]),
        Eagle(head, lm_head, StaticTree(EAGLE_MC_SIM_7B_63)),
        Eagle(head, lm_head, DynamicTree(20, 4, 4)),
    ):
        gen = greedy(model, proposer, prompt, n=60)
        tau = sum(gen.accept_lengths) / len(gen.steps)
        assert gen.tokens == reference
        assert tau > 2, (type(proposer).__name__, tau)


@pytest.fixture(scope="module")
def small_vocab():
    """An 8-token vocabulary makes the exact law of a few sampled tokens cheap to enumerate."""
    return random_llama(8, layers=1, hidden=32, seed=0, init=0.5)


class UnconditionedSiblings(Eagle):
    """The planted mistake: siblings drawn without replacement but verified against the draft's whole law."""

    def _children(self, logits, lane):
        children = super()._children(logits, lane)
        return children._replace(laws=torch.softmax(logits.float(), dim=-1).unsqueeze(-2).expand_as(children.laws))


SMALL_STATIC = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]  # two deep: a horizon of 3 verifies two drafted levels


def shortlisted(head, lm_head, ids: torch.Tensor) -> Eagle:
    """A sampled EAGLE-2 reading out the target ids `ids` only (draft_vocab)."""
    readout = torch.nn.Linear(lm_head.in_features, len(ids), bias=False)
    readout.weight.data.copy_(lm_head.weight[ids])
    vocab = lm_head.out_features
    return Eagle(head, readout, DynamicTree(10, 1, 3), target_ids=lambda d: ids[d], target_vocab=vocab, sampled=True)


def small_proposer(name: str, model) -> object:
    head, lm_head = random_eagle_head(model), model.get_output_embeddings()
    return {
        "medusa": lambda: random_medusa(model),
        "medusa-sampled": lambda: random_medusa(model, sampled=True, tree=SMALL_STATIC),
        "eagle": lambda: Eagle(head, lm_head, StaticTree(SMALL_STATIC)),
        "eagle2": lambda: Eagle(head, lm_head, DynamicTree(10, 1, 3)),
        "eagle-sampled": lambda: Eagle(head, lm_head, StaticTree(SMALL_STATIC), sampled=True),
        "eagle2-sampled": lambda: Eagle(head, lm_head, DynamicTree(10, 1, 3), sampled=True),
        "eagle2-sampled-shortlist": lambda: shortlisted(head, lm_head, torch.arange(0, lm_head.out_features, 2)),
        "eagle2-sampled-bfloat16": lambda: Eagle(  # draft_dtype: the laws drawn from are bfloat16 logits' softmax
            copy.deepcopy(head).bfloat16(), copy.deepcopy(lm_head).bfloat16(), DynamicTree(10, 1, 3), sampled=True
        ),
        "planted": lambda: UnconditionedSiblings(head, lm_head, StaticTree(SMALL_STATIC), sampled=True),
    }[name]()


def small_sampling_test(model, proposer, samples=1000):
    return sampling_test(
        CachedLM(model), proposer, [1, 2, 3, 1, 2], horizon=3, samples=samples, temperature=1.0, stop_ids=set()
    )


SAMPLED = [
    "medusa",
    "medusa-sampled",
    "eagle",
    "eagle2",
    "eagle-sampled",
    "eagle2-sampled",
    "eagle2-sampled-bfloat16",
    "eagle2-sampled-shortlist",
]


@pytest.mark.parametrize("name", SAMPLED)
def test_tree_methods_pass_the_sampling_test(small_vocab, name):
    result = small_sampling_test(small_vocab, small_proposer(name, small_vocab))
    assert result.passed, result


def test_sampled_siblings_verified_against_the_wrong_law_fail_the_audit(small_vocab):
    result = small_sampling_test(small_vocab, small_proposer("planted", small_vocab), samples=2500)  # (p ~ 5e-10)
    assert not result.passed, result


def test_typical_acceptance_is_labelled_lossy(small_vocab, tmp_path, monkeypatch):
    assert methods.preset("medusa-typical").lossless is False
    assert methods.preset("medusa").lossless is True
    rule = methods.rule("medusa-typical")
    assert rule.lossless is False and rule.params == {"posterior_threshold": 0.09, "posterior_alpha": 0.3}
    lying = tmp_path / "presets"
    lying.mkdir()
    (lying / "medusa-lying.yaml").write_text("implementation: medusa\nlossless: true\nacceptance: typical\n")
    monkeypatch.setattr(presets, "_EXTRA", {})  # the extra preset folder is this test's alone
    presets.add_dir("methods", lying)
    with pytest.raises(SpecbenchError, match="must say lossless: false"):
        methods.rule("medusa-lying")  # a lossy rule under a lossless label
    proposer = random_medusa(small_vocab)
    gen = decode(
        CachedLM(small_vocab),
        proposer,
        [1, 2, 3],
        max_new_tokens=12,
        temperature=1.0,
        stop_ids=set(),
        generator=torch.Generator().manual_seed(0),
        rule=rule,
    )
    assert len(gen.tokens) == 12


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_medusa_under_graphs_proposes_the_eager_trees(device):
    """The heads' forward and the pick of each node's candidate as one function (captured on a GPU) give the eager
    proposer's trees, step by step."""
    model = random_llama(64, seed=0).to(device)
    runs = []
    for graphs in (False, True):
        medusa = random_medusa(model, graphs=graphs)
        propose = medusa.propose
        trees = recording(medusa)
        gen = decode(CachedLM(model), medusa, PROMPTS[0], max_new_tokens=20, temperature=0.0, stop_ids=set())
        runs.append((gen.tokens, trees))
        top = medusa._logits(medusa.hidden[0]).topk(10, dim=-1).indices.tolist()  # the last state's, by hand:
        tree = propose([0], [gen.tokens], [20])[
            0
        ].tree  # node i is the rank-r guess of head d, r and d from its template path
        assert tree.tokens == [
            top[d - 1][r] for d, r in zip(medusa.template.depths(), medusa.template.tokens, strict=True)
        ]
    assert runs[1] == runs[0] and len(runs[0][1]) > 1
