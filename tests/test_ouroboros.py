import pytest
import torch

from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.losslessness import sampling_test
from specbench.core.proposer import Turn
from specbench.methods.ouroboros import Ouroboros
from specbench.methods.vanilla import Vanilla

from .conftest import random_llama, random_qwen2

PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 5, 7, 9, 3], [1, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21], [1, 40]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    make = random_llama if request.param == "llama" else random_qwen2
    return make(64, seed=0, init=0.3), make(64, layers=1, seed=1, init=0.3)


def greedy(target, proposer, prompt, n=40):
    return decode(CachedLM(target), proposer, prompt, max_new_tokens=n, temperature=0, stop_ids=set())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ouroboros_matches_vanilla_token_for_token(pair, prompt):
    target, draft = pair
    reference = greedy(target, Vanilla(), prompt).tokens
    proposers = (
        Ouroboros(draft, 4, ngram_size=3, window_size=4, guess_set_size=4, topk=2, pool_from_prompt=True),
        Ouroboros(draft, 1, ngram_size=2, window_size=2, guess_set_size=2, topk=0, layout="shifted"),
        Ouroboros(target, 3, ngram_size=4, window_size=3, guess_set_size=3, topk=3),
    )
    for proposer in proposers:
        gen = greedy(target, proposer, prompt)
        assert gen.tokens == reference, proposer.__dict__
        assert sum(gen.accept_lengths) == 40


def test_self_draft_is_accepted_and_phrases_add_tokens(pair):
    """With the target as its own draft the whole draft is accepted; pooled phrases (in the draft's lookahead
    or after its last token) make some steps longer than gamma + 1."""
    target, _ = pair
    gamma = 3
    longest = 0
    for prompt in PROMPTS[:2]:
        proposer = Ouroboros(target, gamma, ngram_size=4, window_size=4, guess_set_size=4, topk=3)
        gen = greedy(target, proposer, prompt, n=60)
        assert all(n >= gamma + 1 for n in gen.accept_lengths[:-1])
        longest = max(longest, *gen.accept_lengths)
    assert longest > gamma + 1


@pytest.fixture(scope="module")
def small_vocab():
    """8-token target and draft (cheap exact law) and a prompt of the target's own greedy text, so that pooled
    phrases hit and the target's tree mixes sampled draft nodes with point-mass phrase nodes."""
    target = random_llama(8, layers=1, hidden=32, seed=0, init=0.5)
    draft = random_llama(8, layers=1, hidden=32, seed=1, init=0.5)
    text = greedy(target, Vanilla(), [1, 2], n=8).tokens
    return target, draft, [1, 2, *text]


@pytest.mark.parametrize(
    "use_target_as_draft", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["draft", "self"]
)
def test_ouroboros_passes_the_sampling_test(small_vocab, use_target_as_draft):
    target, draft, prompt = small_vocab
    drafter = target if use_target_as_draft else draft
    proposer = Ouroboros(
        drafter, 1, ngram_size=2, window_size=2, guess_set_size=2, topk=2, pool_from_prompt=True, layout="shifted"
    )
    result = sampling_test(
        CachedLM(target), proposer, prompt, horizon=3, samples=1500, temperature=1.0, stop_ids=set(), seed=0
    )
    assert result.passed, result


def test_draft_probs_are_the_draft_law_then_point_masses(small_vocab):
    """Sampling: rows of the drafted chain are the draft's distribution at their prefix, phrase rows one-hot."""
    target, draft, prompt = small_vocab
    proposer = Ouroboros(draft, 2, ngram_size=3, window_size=2, guess_set_size=2, topk=2, pool_from_prompt=True)
    proposer.start(Turn(prompt, 1.0, torch.Generator().manual_seed(0)))
    proposal = proposer.propose(prompt, 2)
    tree, q = proposal.tree, proposal.draft_probs
    assert q.shape == (len(tree), 8)
    kinds = []
    for i in range(len(tree)):
        path = [tree.tokens[r - 1] for r in tree.path(i + 1)]
        law = torch.softmax(draft(torch.tensor([prompt + path[:-1]])).logits[0, -1], dim=-1)
        if torch.allclose(q[i], law, atol=1e-5):
            kinds.append("draft")
        else:
            torch.testing.assert_close(q[i], torch.nn.functional.one_hot(torch.tensor(tree.tokens[i]), 8).float())
            kinds.append("phrase")
    drafted = kinds.count("draft")
    assert drafted >= 2 and kinds == ["draft"] * drafted + ["phrase"] * (len(tree) - drafted)
    assert tree.parents[:drafted] == list(range(-1, drafted - 1))


def test_bad_parameters_are_refused(pair):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Ouroboros(pair[1], 0)
    with pytest.raises(ValueError, match="window_size"):
        Ouroboros(pair[1], 4, window_size=0)


def test_verify_command_passes_with_the_preset(capsys, tiny_models):
    """The registry builds the preset (reference defaults) with the model's draft; greedy output is vanilla's."""
    from specbench.cli.main import main

    target, draft = tiny_models
    args = ["--model", str(target), "--draft", str(draft), "--limit", "1", "--max-new-tokens", "12"]
    code = main(["verify", "--method", "ouroboros", *args, "--mode", "greedy"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "greedy: 6/6 questions token-identical" in out
