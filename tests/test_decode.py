import pytest
import torch

from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.tree import Tree
from specbench.errors import SpecbenchError
from specbench.methods.pld import PromptLookup, find_continuation
from specbench.methods.sps import DraftModel
from specbench.methods.vanilla import Vanilla

from .conftest import random_llama, random_qwen2

PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 3], [1, 20, 21, 22, 23, 20, 21], [1, 40]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    make = random_llama if request.param == "llama" else random_qwen2
    return make(64, seed=0, init=0.3), make(64, layers=1, seed=1, init=0.3)


def greedy_tokens(target, proposer, prompt, n=40, stop=frozenset()):
    return decode(CachedLM(target), proposer, prompt, max_new_tokens=n, temperature=0, stop_ids=set(stop))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sps_and_pld_match_vanilla_token_for_token(pair, prompt):
    target, draft = pair
    reference = greedy_tokens(target, Vanilla(), prompt).tokens
    for proposer in (PromptLookup(), PromptLookup(2, 3), DraftModel(draft, 4), DraftModel(draft, 1)):
        assert greedy_tokens(target, proposer, prompt).tokens == reference, proposer.name


def test_self_draft_is_fully_accepted(pair):
    target, _ = pair
    gen = greedy_tokens(target, DraftModel(target, 4), PROMPTS[0], n=40)
    assert gen.accept_lengths == [5] * 8
    assert [s.tested for s in gen.steps] == [4] * 8


def test_vanilla_records_one_token_per_step(pair):
    target, _ = pair
    gen = greedy_tokens(target, Vanilla(), PROMPTS[0], n=17)
    assert len(gen.tokens) == 17 and gen.accept_lengths == [1] * 17
    assert all(s.tree_size == 1 for s in gen.steps)


def test_stop_token_and_budget_cut_the_last_step(pair):
    target, _ = pair
    full = greedy_tokens(target, Vanilla(), PROMPTS[0], n=30).tokens
    stop = full[12]
    first = full.index(stop)
    gen = greedy_tokens(target, DraftModel(target, 4), PROMPTS[0], n=30, stop={stop})
    assert gen.tokens == full[: first + 1]
    assert sum(gen.accept_lengths) == len(gen.tokens)
    gen = greedy_tokens(target, DraftModel(target, 4), PROMPTS[0], n=7)
    assert gen.tokens == full[:7] and sum(gen.accept_lengths) == 7


def test_draft_near_the_token_budget(pair, monkeypatch):
    """With 2 tokens left the verdict tests 1 draft: the root's token plus 1 drafted fill the budget. At T = 0 the
    draft still drafts all 4, as a batch's other slots would (the loop cuts the chain without reading it); at T > 0
    it drafts no more than the budget has room for."""
    target, _ = pair
    proposer = DraftModel(target, 4)
    calls = []
    lane = proposer.draft.lane(0)
    run = lane.run
    monkeypatch.setattr(lane, "run", lambda ids, *args, **kw: calls.append(len(ids)) or run(ids, *args, **kw))
    gen = greedy_tokens(target, proposer, PROMPTS[0], n=7)
    assert gen.accept_lengths == [5, 2] and [s.tested for s in gen.steps] == [4, 1]
    assert len(calls) == 1 + 4 + 4  # the prompt's prefill, then one forward per drafted token
    assert [s.drafted for s in gen.steps] == [4, 4]
    sampled = DraftModel(target, 4)
    proposed = []
    propose = sampled.propose
    monkeypatch.setattr(
        sampled,
        "propose",
        lambda s, t, depths: [proposed.append((len(p.tree), *depths)) or p for p in propose(s, t, depths)],
    )
    gen = decode(CachedLM(target), sampled, PROMPTS[0], max_new_tokens=7, temperature=1.0, stop_ids=set())
    assert len(gen.tokens) == 7 and any(depth < 4 for _, depth in proposed)
    assert all(n == min(4, depth) for n, depth in proposed)


def test_tree_commit_keeps_non_contiguous_rows(pair):
    """Verify a tree whose accepted path skips rows; later logits must equal a fresh forward's."""
    target, _ = pair
    t = CachedLM(target)
    prompt = PROMPTS[0]
    t.forward(prompt[:-1])
    full = target(torch.tensor([prompt])).logits[0, -1]
    a = int(full.argmax())
    after_a = target(torch.tensor([prompt + [a]])).logits[0, -1]
    b = int(after_a.argmax())
    tree = Tree([(a + 1) % 64, a, 3, b], [-1, -1, 0, 1])  # rows: 1 wrong, 2 = a, 3 under wrong, 4 = b under a
    past = t.cached
    t.forward([prompt[-1], *tree.tokens], tree)
    t.commit(past, [0, 2, 4])
    assert t.cached == len(prompt) + 2
    nxt = t.forward([int(after_a.argmax())])
    expected = target(torch.tensor([prompt + [a, b, int(after_a.argmax())]])).logits[0, -1]
    torch.testing.assert_close(nxt[-1], expected, atol=1e-4, rtol=1e-4)


def test_prompt_longer_than_context_is_refused():
    target = random_llama(32, context=16)
    with pytest.raises(SpecbenchError, match="context"):
        decode(CachedLM(target), Vanilla(), list(range(1, 20)), max_new_tokens=4, temperature=0, stop_ids=set())


def test_nonpositive_budget_is_refused(pair):
    with pytest.raises(SpecbenchError, match="positive"):
        greedy_tokens(pair[0], Vanilla(), PROMPTS[0], n=0)


def test_find_continuation_hand_worked():
    assert find_continuation([1, 2, 3, 4, 1, 2], 3, 10) == [3, 4, 1, 2]
    assert find_continuation([1, 2, 3, 4, 5], 3, 10) == []
    assert find_continuation([5, 1, 2, 9, 1, 2], 2, 1) == [9]
    assert find_continuation([9, 7, 8, 7], 3, 2) == [8, 7]  # n = 1 fallback: first 7 from the left
    assert find_continuation([7], 3, 5) == []


def test_features_come_with_the_same_logits(pair):
    target, _ = pair
    t = CachedLM(target)
    prompt = PROMPTS[0]
    plain = t.run(prompt).logits
    t.reset()
    out = t.run(prompt, layers=(1, -1))
    torch.testing.assert_close(out.logits, plain, atol=1e-5, rtol=1e-5)
    states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    hidden = target.config.hidden_size
    torch.testing.assert_close(out.features[:, :hidden], states[1][0], atol=1e-5, rtol=1e-5)
    final = target.get_decoder()(torch.tensor([prompt])).last_hidden_state[0]
    torch.testing.assert_close(out.features[:, hidden:], final, atol=1e-5, rtol=1e-5)


def test_side_branch_leaves_tree_logits_alone(pair):
    from specbench.core.cached_lm import SideBranch

    target, _ = pair
    prompt = PROMPTS[0]
    tree = Tree([4, 5], [-1, 0])
    t = CachedLM(target)
    t.forward(prompt[:-1])
    past = t.cached
    alone = t.forward([prompt[-1], *tree.tokens], tree)
    t.crop(past)
    # two side tokens at offsets 1 and 2 that see the root and each other causally, not the tree
    allowed = torch.tensor([[1, 0, 0, 1, 0], [1, 0, 0, 1, 1]], dtype=torch.bool)
    side = SideBranch([7, 8], [1, 2], allowed)
    out = t.run([prompt[-1], 4, 5, 7, 8], tree, side=side)
    torch.testing.assert_close(out.logits[:3], alone, atol=1e-5, rtol=1e-5)
    brute = target(torch.tensor([prompt + [7, 8]])).logits[0, -2:]
    torch.testing.assert_close(out.logits[3:], brute, atol=1e-4, rtol=1e-4)
