import pytest
import torch

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.losslessness import sampling_test
from specbench.core.tree import Tree, trie
from specbench.errors import SpecbenchError
from specbench.methods.jacobi import JacobiWindow, lookahead_mask, lookahead_offsets, window_cells
from specbench.methods.lookahead import Lookahead
from specbench.methods.ngram_pool import NgramPool
from specbench.methods.vanilla import Vanilla

from .conftest import random_llama, random_qwen2

# repeated phrases, so that the prompt seeds the pool and the target's greedy output tends to loop
PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 5, 7, 9, 3], [1, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21], [1, 40]]


def window_context(level: int, column: int) -> list[tuple[int, int]]:
    """Brute force: the (level, column) cells a window token reads, in sequence order, ending with itself."""
    return [(0, j) for j in range(column + 1)] + [(lv, column) for lv in range(1, level + 1)]


@pytest.mark.parametrize("root_column", [True, False])
@pytest.mark.parametrize("levels,width", [(1, 1), (1, 4), (2, 3), (3, 2), (4, 5)])
def test_lookahead_mask_matches_brute_force(levels, width, root_column):
    cells = window_cells(levels, width, root_column)
    expected = torch.tensor([[c in window_context(*r) for c in cells] for r in cells]).reshape(len(cells), len(cells))
    assert torch.equal(lookahead_mask(levels, width, root_column), expected)
    offsets = lookahead_offsets(levels, width, root_column)
    for r, cell in enumerate(cells):  # every context reads as consecutive positions right after the root
        context = [offsets[cells.index(c)] for c in window_context(*cell) if c in cells]
        assert context == list(range(1, offsets[r] + 1))


def test_reference_layout_matches_a_hand_built_example():
    """N=3, W=3 as hao-ai-lab/LookaheadDecoding lays it out: level 0 = [root r, a1, a2], level 1 = [b0, b1, b2];
    its mask is the causal triangle over level 0 plus, per level-1 row, its own column (positions p + l + j)."""
    window = JacobiWindow(levels=2, width=3)
    window.rows = [[11, 12], [20, 21, 22]]  # a1 a2 | b0 b1 b2
    side = window.side(tree_size=0)
    assert side.tokens == [11, 12, 20, 21, 22]
    assert side.positions == [1, 2, 1, 2, 3]
    #        r  a1 a2 b0 b1 b2
    sees = [
        [1, 1, 0, 0, 0, 0],  # a1
        [1, 1, 1, 0, 0, 0],  # a2
        [1, 0, 0, 1, 0, 0],  # b0: the root's column
        [1, 1, 0, 0, 1, 0],  # b1
        [1, 1, 1, 0, 0, 1],
    ]  # b2
    assert torch.equal(side.allowed, torch.tensor(sees, dtype=torch.bool))
    picks = [0, 0, 30, 31, 32]  # the target's argmax at a1, a2, b0, b1, b2
    assert window.advance(picks, root=10) == [[10, 20, 30], [11, 21, 31], [12, 22, 32]]  # column 0 keyed on r
    assert window.rows == [[21, 22], [30, 31, 32]]  # level 0 <- level 1 minus the next root's column


@pytest.mark.parametrize("layout", ["reference", "shifted"])
def test_window_rows_see_exactly_their_column_sequence(layout):
    """The side logits of every window token equal a plain forward of the prefix, the root and its context."""
    model = random_llama(64, seed=3)
    prompt = [1, 5, 7, 9, 11]
    window = JacobiWindow(levels=3, width=4, layout=layout)
    window.rows = [[30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]]
    if layout == "reference":
        window.rows[0] = window.rows[0][1:]
    cells = window_cells(3, 4, window.root_column)
    tree = trie([[6, 8], [6, 9], [12]])
    side = window.side(len(tree))
    target = CachedLM(model)
    target.forward(prompt[:-1])
    past = target.cached
    alone = target.forward([prompt[-1], *tree.tokens], tree)
    target.crop(past)
    out = target.run([prompt[-1], *tree.tokens, *side.tokens], tree, side=side).logits
    torch.testing.assert_close(out[: len(tree) + 1], alone, atol=1e-5, rtol=1e-5)
    grid = [[prompt[-1], 31, 32, 33] if layout == "reference" else [30, 31, 32, 33], *window.rows[1:]]
    for r, (level, column) in enumerate(cells):
        context = [grid[lv][j] for lv, j in window_context(level, column)]
        if layout == "reference":
            context = context[1:]  # (0, 0) is the root, already the prompt's last token
        brute = model(torch.tensor([prompt + context])).logits[0, -1]
        torch.testing.assert_close(out[len(tree) + 1 + r], brute, atol=1e-4, rtol=1e-4)


def side_picks(rows: int, outputs: list[int]) -> list[int]:
    """The target's argmax at `rows` side tokens, the last len(outputs) of them `outputs`."""
    return [0] * (rows - len(outputs)) + outputs


def test_reference_window_warms_up_from_seeded_prompt_tokens():
    """W + N - 3 tokens drawn from the prompt with the turn's generator; each warm-up step shifts every level one
    column and adds one, until N - 1 levels by W columns (level 0's column 0 being the root)."""
    prompt = [4, 5, 6, 7, 8]
    window = JacobiWindow(levels=3, width=3)  # N = 4
    window.reset(prompt, torch.Generator().manual_seed(7))
    first = window.rows
    assert len(first) == 1 and len(first[0]) == 4 and set(first[0]) <= set(prompt)
    window.reset(prompt, torch.Generator().manual_seed(7))
    assert window.rows == first  # seeded: runs repeat
    assert window.side(0).positions == [1, 2, 3, 4]  # one causal run after the root
    assert not window.ready and window.reach == 4
    assert window.advance(side_picks(4, [40, 41, 42, 43]), root=9) == []
    assert window.rows == [first[0][1:], [40, 41, 42, 43]]
    assert window.side(0).positions == [1, 2, 3, 1, 2, 3, 4]
    assert window.advance(side_picks(7, [50, 51, 52, 53]), root=9) == []
    assert window.rows == [first[0][2:], [41, 42, 43], [51, 52, 53]] and window.ready
    ngrams = window.advance(side_picks(8, [60, 61, 62]), root=9)
    assert ngrams == [[9, 41, 51, 60], [first[0][2], 42, 52, 61], [first[0][3], 43, 53, 62]]
    assert window.rows == [[42, 43], [51, 52, 53], [60, 61, 62]]


def test_shifted_window_warms_up_then_harvests_one_ngram_per_column():
    window = JacobiWindow(levels=2, width=3, layout="shifted")
    window.reset([4, 5, 6, 7])
    assert window.rows == [[5, 6, 7]]
    assert window.side(2).allowed.shape == (3, 1 + 2 + 3)
    assert window.advance(side_picks(3, [8, 9, 10]), root=0) == []  # warm-up: a second level, nothing harvested
    assert window.rows == [[5, 6, 7], [8, 9, 10]]
    assert window.advance(side_picks(6, [11, 12, 13]), root=0) == [[5, 8, 11], [6, 9, 12], [7, 10, 13]]
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
    proposers = (
        Lookahead(),
        Lookahead(layout="shifted"),
        Lookahead(3, 4, 3, pool_from_prompt=True),
        Lookahead(3, 1, 1),
        Lookahead(2, 1, 1, layout="shifted"),
    )
    for proposer in proposers:
        gen = decode(CachedLM(target), proposer, prompt, max_new_tokens=40, temperature=0, stop_ids=set())
        assert gen.tokens == reference, proposer.__dict__
        assert sum(gen.accept_lengths) == 40


def test_lookahead_pool_gets_hits(target):
    """Across the repetitive prompts, verified n-grams (from the window or the prompt) add tokens."""
    best = 0
    for prompt in PROMPTS[:2]:
        for proposer in (Lookahead(), Lookahead(layout="shifted"), Lookahead(4, 5, 5, pool_from_prompt=True)):
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
        decode(
            CachedLM(model), proposer, prompt, max_new_tokens=3, temperature=1.0, stop_ids=set(), generator=generator
        )
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
    with pytest.raises(SpecbenchError, match="ngram_size >= 3"):
        methods.build("lookahead", None, {"ngram_size": 2})
    with pytest.raises(SpecbenchError, match="layout must be one of reference, shifted"):
        methods.build("lookahead", None, {"layout": "diagonal"})
    assert methods.build("lookahead-shifted", None).window.root_column is False
