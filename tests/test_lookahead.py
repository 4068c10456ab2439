import pytest
import torch

from specbench import methods
from specbench.cached_lm import CachedLM
from specbench.decode import decode
from specbench.errors import SpecbenchError
from specbench.losslessness import sampling_test
from specbench.methods.jacobi import JacobiWindow, lookahead_mask, lookahead_offsets
from specbench.methods.lookahead import Lookahead
from specbench.methods.ngram_pool import NgramPool
from specbench.methods.vanilla import Vanilla
from specbench.tree import Tree, trie

from .conftest import random_llama, random_qwen2

# repeated phrases, so that the prompt seeds the pool and the target's greedy output tends to loop
PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 5, 7, 9, 3], [1, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21], [1, 40]]


def window_context(level: int, column: int) -> list[tuple[int, int]]:
    """Brute force: the (level, column) cells a window token reads, in sequence order, ending with itself."""
    return [(0, j) for j in range(column + 1)] + [(lv, column) for lv in range(1, level + 1)]


@pytest.mark.parametrize("levels,width", [(1, 1), (1, 4), (2, 3), (3, 2), (4, 5)])
def test_lookahead_mask_matches_brute_force(levels, width):
    cells = [(lv, j) for lv in range(levels) for j in range(width)]
    expected = torch.tensor([[c in window_context(*r) for c in cells] for r in cells])
    assert torch.equal(lookahead_mask(levels, width), expected)
    offsets = lookahead_offsets(levels, width)
    for r, cell in enumerate(cells):  # every context reads as consecutive positions right after the root
        assert [offsets[cells.index(c)] for c in window_context(*cell)] == list(range(1, offsets[r] + 1))


def test_window_rows_see_exactly_their_column_sequence():
    """The side logits of every window token equal a plain forward of the prefix, the root and its context."""
    model = random_llama(64, seed=3)
    prompt = [1, 5, 7, 9, 11]
    window = JacobiWindow(levels=3, width=4)
    window.rows = [[30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]]
    tree = trie([[6, 8], [6, 9], [12]])
    side = window.side(len(tree))
    target = CachedLM(model)
    target.forward(prompt[:-1])
    past = target.cached
    alone = target.forward([prompt[-1], *tree.tokens], tree)
    target.crop(past)
    out = target.run([prompt[-1], *tree.tokens, *side.tokens], tree, side=side).logits
    torch.testing.assert_close(out[: len(tree) + 1], alone, atol=1e-5, rtol=1e-5)
    for r, (level, column) in enumerate((lv, j) for lv in range(3) for j in range(4)):
        context = [window.rows[lv][j] for lv, j in window_context(level, column)]
        brute = model(torch.tensor([prompt + context])).logits[0, -1]
        torch.testing.assert_close(out[len(tree) + 1 + r], brute, atol=1e-4, rtol=1e-4)


def test_window_warms_up_then_harvests_one_ngram_per_column():
    window = JacobiWindow(levels=2, width=3)
    window.reset([4, 5, 6, 7])
    assert window.rows == [[5, 6, 7]]
    assert window.side(2).allowed.shape == (3, 1 + 2 + 3)

    def logits(rows: int, outputs: list[int]) -> torch.Tensor:
        out = torch.zeros(rows, 16)
        out[range(rows - 3, rows), outputs] = 1.0
        return out

    assert window.advance(logits(3, [8, 9, 10])) == []  # warm-up: a second level, nothing harvested
    assert window.rows == [[5, 6, 7], [8, 9, 10]]
    assert window.advance(logits(6, [11, 12, 13])) == [[5, 8, 11], [6, 9, 12], [7, 10, 13]]
    assert window.rows == [[8, 9, 10], [11, 12, 13]]
    window.reset([3])
    assert window.rows == [[3, 3, 3]]  # a prompt shorter than the window is cycled


def test_pool_keeps_newest_per_key():
    pool = NgramPool(length=2, capacity=2)
    pool.add_sequence([1, 2, 3, 1, 4, 5, 1, 2, 3])
    assert pool.candidates(1, 5) == [[2, 3], [4, 5]]  # [2, 3] re-added last: newest
    pool.add([1, 6, 7])
    assert pool.candidates(1, 5) == [[6, 7], [2, 3]]  # [4, 5] was the oldest: evicted
    assert pool.candidates(1, 1) == [[6, 7]] and pool.candidates(9, 3) == []
    with pytest.raises(ValueError):
        pool.add([1, 2])


def test_trie_shares_prefixes():
    tree = trie([[5, 6, 7], [5, 6, 8], [9], [5, 6, 7]])
    assert tree == Tree([5, 6, 7, 8, 9], [-1, 0, 1, 1, -1])
    assert trie([]) == Tree([], [])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return (random_llama if request.param == "llama" else random_qwen2)(64, seed=0, init=0.3)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_lookahead_matches_vanilla_token_for_token(target, prompt):
    reference = decode(CachedLM(target), Vanilla(), prompt, max_new_tokens=40, temperature=0, stop_ids=set()).tokens
    for proposer in (Lookahead(), Lookahead(3, 4, 3, pool_from_prompt=True), Lookahead(2, 1, 1)):
        gen = decode(CachedLM(target), proposer, prompt, max_new_tokens=40, temperature=0, stop_ids=set())
        assert gen.tokens == reference, proposer.__dict__
        assert sum(gen.accept_lengths) == 40


def test_lookahead_pool_gets_hits(target):
    """Across the repetitive prompts, verified n-grams (from the window or the prompt) add tokens."""
    best = 0
    for prompt in PROMPTS[:2]:
        for proposer in (Lookahead(), Lookahead(4, 5, 5, pool_from_prompt=True)):
            gen = decode(CachedLM(target), proposer, prompt, max_new_tokens=40, temperature=0, stop_ids=set())
            best = max(best, *gen.accept_lengths)
            assert max(s.tree_size for s in gen.steps) > 1
    assert best > 1


@pytest.fixture(scope="module")
def small_vocab():
    """An 8-token target (cheap exact law) and a prompt of its own greedy text, so that pooled n-grams hit."""
    model = random_llama(8, layers=1, hidden=32, seed=0, init=0.5)
    text = decode(CachedLM(model), Vanilla(), [1, 2], max_new_tokens=8, temperature=0, stop_ids=set()).tokens
    return model, [1, 2, *text]


def test_lookahead_passes_the_sampling_test(small_vocab):
    model, prompt = small_vocab
    proposer = Lookahead(3, 3, 4, pool_from_prompt=True)
    generator = torch.Generator().manual_seed(1)
    runs = [
        decode(CachedLM(model), proposer, prompt, max_new_tokens=3, temperature=1.0, stop_ids=set(),
               generator=generator)
        for _ in range(40)
    ]
    assert max(n for run in runs for n in run.accept_lengths) > 1  # the tree is exercised while sampling
    result = sampling_test(
        CachedLM(model), proposer, prompt, horizon=3, samples=1500, temperature=1.0, stop_ids=set(), seed=0
    )
    assert result.passed, result


def test_bad_parameters_are_user_errors():
    assert isinstance(methods.build("lookahead", None), Lookahead)  # the preset's defaults build
    with pytest.raises(SpecbenchError, match="ngram_size"):
        methods.build("lookahead", None, {"ngram_size": 1})
    with pytest.raises(SpecbenchError, match="window_size"):
        methods.build("lookahead", None, {"window_size": 0})


def test_verify_command_passes_with_the_preset(capsys, tiny_models):
    from specbench.cli import main

    target, _ = tiny_models
    args = ["--model", str(target), "--limit", "1", "--max-new-tokens", "12"]
    code = main(["verify", "--method", "lookahead", *args, "--samples", "300", "--horizon", "2", "--prompts", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "greedy: 6/6 questions token-identical" in out and "verdict: pass" in out
