import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from specbench.core.acceptance import exact_chains, exact_trees, greedy, greedy_batch, speculative_sampling
from specbench.core.sampling import SparseLaws, draw_distinct, draw_distinct_padded, drawn, inverse_cdf
from specbench.core.tree import Tree, chain, new_rows_allowed


def test_greedy_chain_hand_worked():
    # draft 3, 4, 5; the target's argmax after root, 3, 4, 5 is 3, 4, 1, 2 -> accept 3, 4 then correct to 1
    out = greedy(chain([3, 4, 5]), [3, 4, 1, 2])
    assert out.rows == [1, 2] and out.token == 1 and out.tested == 3


def test_greedy_all_accepted_gives_bonus():
    out = greedy(chain([3, 4]), [3, 4, 5])
    assert out.rows == [1, 2] and out.token == 5 and out.tested == 2


def test_greedy_empty_tree_is_vanilla():
    out = greedy(chain([]), [4])
    assert out.rows == [] and out.token == 4 and out.tested == 0


def test_greedy_tree_follows_matching_branch():
    # root -> 1 (row1) -> 2 (row2); root -> 3 (row3) -> 4 (row4). Target argmax: root 3, row3 4, row4 0.
    tree = Tree([1, 2, 3, 4], [-1, 0, -1, 2])
    out = greedy(tree, [3, 0, 0, 4, 0])
    assert out.rows == [3, 4] and out.token == 0 and out.tested == 2


def _random_dist(gen: torch.Generator, vocab: int, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(vocab, generator=gen) * sharp, dim=0)


def _chi_square_joint(rule_draft, trials: int = 12000, vocab: int = 4, seed: int = 0) -> float:
    """p-value of the joint law of the first two emitted tokens against the target's P1[y] * P2[y, z].

    rule_draft(gen, q1, q2) -> (tree, draft_probs or None, drafted rows used to look up target rows).
    When a step emits a single token, the second one comes from the next (vanilla) step: P2[first].
    """
    gen = torch.Generator().manual_seed(seed)
    p1 = _random_dist(gen, vocab)
    p2 = torch.stack([_random_dist(gen, vocab) for _ in range(vocab)])
    bonus = torch.stack([_random_dist(gen, vocab) for _ in range(vocab)])
    q1 = _random_dist(gen, vocab)
    q2 = torch.stack([_random_dist(gen, vocab) for _ in range(vocab)])
    counts = np.zeros((vocab, vocab))
    for _ in range(trials):
        tree, draft_probs = rule_draft(gen, q1, q2)
        rows = [p1]
        for i, token in enumerate(tree.tokens):
            depth = tree.depths()[i]
            rows.append(p2[token] if depth == 1 else bonus[token])
        out = speculative_sampling(tree, torch.stack(rows), draft_probs, gen)
        emitted = [tree.tokens[r - 1] for r in out.rows] + [out.token]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p2[emitted[0]], 1, generator=gen)))
        counts[emitted[0], emitted[1]] += 1
    expected = (p1[:, None] * p2).double().numpy().ravel()
    expected *= trials / expected.sum()
    return stats.chisquare(counts.ravel(), expected).pvalue


def _sampled_chain(gen, q1, q2):
    x1 = int(torch.multinomial(q1, 1, generator=gen))
    x2 = int(torch.multinomial(q2[x1], 1, generator=gen))
    return chain([x1, x2]), torch.stack([q1, q2[x1]])


def test_greedy_batch_hand_worked():
    """Two slots side by side: a chain [3, 4, 5] whose target picks 3, 4, 1 (two accepted, bonus 1) and the tree of
    `test_greedy_tree_follows_matching_branch`; a third slot with no tree takes its pick."""
    ids = torch.tensor([[9, 3, 4, 5, 0], [9, 1, 2, 3, 4], [7, 0, 0, 0, 0]])
    seen = torch.ones(3, 5, 5, dtype=torch.bool).tril()
    seen[1] = new_rows_allowed(Tree([1, 2, 3, 4], [-1, 0, -1, 2]))
    depth = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 1, 2], [0, 1, 2, 3, 4]])
    picks = torch.tensor([[3, 4, 1, 2, 8], [3, 0, 0, 4, 0], [6, 0, 0, 0, 0]])
    v = greedy_batch(ids, seen, depth, torch.tensor([3, 4, 0]), picks)
    assert v.length.tolist() == [2, 2, 0] and v.tested.tolist() == [3, 2, 0]
    assert v.kept[0, :3].tolist() == [0, 1, 2] and v.new[0, :3].tolist() == [3, 4, 1]
    assert v.kept[1, :3].tolist() == [0, 3, 4] and v.new[1, :3].tolist() == [3, 4, 0]
    assert v.new[2, :1].tolist() == [6]


def test_greedy_batch_is_greedy_slot_by_slot():
    """Random trees (siblings sharing tokens, chains, empty trees) in batches whose unused rows hold garbage: every
    slot's accepted rows, appended tokens and tested depth are `greedy`'s on its tree alone."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        batch, b = int(rng.integers(1, 5)), 12
        ids = torch.from_numpy(rng.integers(0, 3, (batch, b)))
        seen = torch.from_numpy(rng.random((batch, b, b)) < 0.5)
        depth = torch.from_numpy(rng.integers(0, 9, (batch, b)))
        picks = torch.from_numpy(rng.integers(0, 3, (batch, b)))
        trees = []
        for slot in range(batch):
            n = int(rng.integers(0, b))
            parents = list(range(-1, n - 1)) if rng.random() < 0.3 else [int(rng.integers(-1, i)) for i in range(n)]
            tree = Tree(ids[slot, 1 : n + 1].tolist(), parents)
            seen[slot, : n + 1, : n + 1] = new_rows_allowed(tree)
            depth[slot, : n + 1] = torch.tensor([0, *tree.depths()])
            trees.append(tree)
        v = greedy_batch(ids, seen, depth, torch.tensor([len(t) for t in trees]), picks)
        for slot, tree in enumerate(trees):
            expected = greedy(tree, picks[slot, : len(tree) + 1].tolist())
            n = int(v.length[slot])
            assert v.kept[slot, : n + 1].tolist() == [0, *expected.rows]
            assert v.new[slot, : n + 1].tolist() == [tree.tokens[r - 1] for r in expected.rows] + [expected.token]
            assert int(v.tested[slot]) == expected.tested


def test_a_depth_limit_judges_as_the_tree_cut_to_it():
    """A tree cut to a depth without reading it (`DeviceTree.limited`: its deeper nodes stay rows) is judged as the
    subtree of the nodes that deep, by `greedy` on the host and by `greedy_batch` for every slot at once: the same
    rows (the full tree's), tokens and tested depth, on random trees whose deeper nodes come anywhere in the order."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        batch, b = int(rng.integers(1, 5)), 12
        ids = torch.from_numpy(rng.integers(0, 3, (batch, b)))
        seen = torch.zeros(batch, b, b, dtype=torch.bool)
        depth = torch.zeros(batch, b, dtype=torch.long)
        picks = torch.from_numpy(rng.integers(0, 3, (batch, b)))
        limit = torch.from_numpy(rng.integers(0, 5, (batch,)))
        trees = []
        for slot in range(batch):
            n = int(rng.integers(0, b))
            tree = Tree(ids[slot, 1 : n + 1].tolist(), [int(rng.integers(-1, i)) for i in range(n)])
            seen[slot, : n + 1, : n + 1] = new_rows_allowed(tree)
            depth[slot, : n + 1] = torch.tensor([0, *tree.depths()])
            trees.append(tree)
        v = greedy_batch(ids, seen, depth, torch.tensor([len(t) for t in trees]), picks, limit)
        for slot, tree in enumerate(trees):
            best, cap = picks[slot, : len(tree) + 1].tolist(), int(limit[slot])
            keep = [i for i, d in enumerate(tree.depths()) if d <= cap]
            cut = greedy(tree.subtree(keep), [best[0], *(best[i + 1] for i in keep)])
            rows = [keep[r - 1] + 1 for r in cut.rows]  # the subtree's rows as the full tree's
            limited = greedy(tree, best, cap)
            assert (limited.rows, limited.token, limited.tested) == (rows, cut.token, cut.tested)
            n = int(v.length[slot])
            assert v.kept[slot, : n + 1].tolist() == [0, *rows] and int(v.tested[slot]) == cut.tested
            assert v.new[slot, : n + 1].tolist() == [tree.tokens[r - 1] for r in rows] + [cut.token]


def test_chain_speculative_sampling_is_lossless():
    assert _chi_square_joint(_sampled_chain) > 1e-3


def test_point_mass_chain_is_lossless():
    def fixed_chain(gen, q1, q2):
        return chain([2, 1]), None

    assert _chi_square_joint(fixed_chain) > 1e-3


def test_sibling_tree_sampling_is_lossless():
    def two_siblings(gen, q1, q2):
        a, b = (int(torch.multinomial(q1, 1, generator=gen)) for _ in range(2))
        c = int(torch.multinomial(q2[a], 1, generator=gen))
        return Tree([a, b, c], [-1, -1, 0]), torch.stack([q1, q1, q2[a]])

    assert _chi_square_joint(two_siblings) > 1e-3


def test_wrong_draft_distribution_is_detected():
    """Claiming uniform draft probabilities while drafting from q1 biases the output: the check must fail."""

    def lying_chain(gen, q1, q2):
        tree, _ = _sampled_chain(gen, q1, q2)
        return tree, torch.full((2, q1.numel()), 1.0 / q1.numel())

    assert _chi_square_joint(lying_chain) < 1e-6


def _exact_law(p: torch.Tensor, draws: list[int], laws: list[torch.Tensor]) -> torch.Tensor:
    """The exact law of the token speculative_sampling emits at the root for sibling drafts `draws`, each
    tested against its row of `laws`: accepted with min(1, p(x)/q(x)), else p <- norm(max(0, p - q))."""
    out, reach, cur = torch.zeros_like(p), 1.0, p.clone()
    for x, q in zip(draws, laws, strict=True):
        accept = min(1.0, float(cur[x] / q[x])) if q[x] > 0 else 0.0
        out[x] += reach * accept
        reach *= 1 - accept
        residual = torch.clamp(cur - q, min=0.0)
        cur = residual / residual.sum() if residual.sum() > 0 else cur
    return out + reach * cur


def _law_over_all_draws(p: torch.Tensor, q: torch.Tensor, k: int, honest: bool) -> torch.Tensor:
    """Brute force over every ordered draw of k distinct tokens from q: the emitted token's law. honest: each
    sibling is tested against the law it was drawn from (q without the earlier draws); else against q."""
    law = torch.zeros_like(p)
    for draws in itertools.permutations(range(len(p)), k):
        weight, rest, laws = 1.0, q.clone(), []
        for x in draws:
            conditional = rest / rest.sum()
            weight *= float(conditional[x])
            laws.append(conditional if honest else q)
            rest = rest.clone()
            rest[x] = 0.0
        law += weight * _exact_law(p, list(draws), laws)
    return law


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(5))
def test_siblings_drawn_without_replacement_keep_the_target_law(k, seed):
    gen = torch.Generator().manual_seed(seed)
    p, q = (d / d.sum() for d in (_random_dist(gen, 4).double(), _random_dist(gen, 4).double()))
    torch.testing.assert_close(_law_over_all_draws(p, q, k, honest=True), p, atol=1e-12, rtol=0)


def test_siblings_tested_against_the_unconditioned_law_are_biased():
    """The planted mistake: later siblings tested against q itself, not q without the earlier draws."""
    biases = []
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        p, q = (d / d.sum() for d in (_random_dist(gen, 4).double(), _random_dist(gen, 4).double()))
        biases += [float((_law_over_all_draws(p, q, k, honest=False) - p).abs().max()) for k in (2, 3)]
    assert max(biases) > 0.05 and sum(b > 1e-3 for b in biases) >= len(biases) // 2, biases


def test_draw_distinct_returns_each_draws_law():
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    (first, second), laws = draw_distinct(q, 5, gen)
    assert sorted(first) == [0, 1, 2] and sorted(second) == [0, 1, 2, 3]  # distinct, within the support
    for row, tokens, law in zip(q, (first, second), laws, strict=True):
        for i in range(len(tokens)):
            rest = row.clone()
            rest[tokens[:i]] = 0.0
            torch.testing.assert_close(law[i], rest / rest.sum())


def test_draw_distinct_is_successive_sampling_without_replacement():
    """Ordered pairs (a, b) come with probability q(a) q(b) / (1 - q(a))."""
    gen = torch.Generator().manual_seed(1)
    q = torch.tensor([0.5, 0.25, 0.15, 0.1])
    trials = 20000
    tokens, _ = draw_distinct(q.expand(trials, -1), 2, gen)
    counts = np.zeros((4, 4))
    for a, b in tokens:
        counts[a, b] += 1
    pairs = [(a, b) for a, b in itertools.permutations(range(4), 2)]
    exact = np.array([float(q[a]) * float(q[b]) / (1 - float(q[a])) for a, b in pairs])
    expected = exact / exact.sum() * trials
    assert stats.chisquare([counts[a, b] for a, b in pairs], expected).pvalue > 1e-3


def test_sampled_siblings_pass_and_the_planted_mistake_fails_the_chi_square():
    def siblings(honest: bool):
        def draft(gen, q1, q2):
            ((a, b),), (laws,) = draw_distinct(q1[None], 2, gen)
            ((c,),), (child,) = draw_distinct(q2[a][None], 1, gen)
            rows = [laws[0], laws[1] if honest else q1, child[0]]
            return Tree([a, b, c], [-1, -1, 0]), torch.stack(rows)

        return draft

    assert _chi_square_joint(siblings(True)) > 1e-3
    assert _chi_square_joint(siblings(False), trials=30000) < 1e-6


def test_exact_chains_hand_worked():
    """Chain 0 drafts token 1 as a point mass where the target gives tokens 0 and 1 half each: draw 0.7 rejects it
    (0.7 >= 0.5) and the token comes from p without 1, token 0. Chain 1 is the same chain with draw 0.3: kept, and
    the bonus draw 0.9 falls in the last token of p1's cumulative sum (0.1, 0.3, 0.6, 1). Chain 2 drafted nothing:
    its one draw 0.05 picks p0's first token."""
    p0, p1 = [0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]
    probs = torch.tensor([[p0, p1]] * 3)
    tokens = torch.tensor([[1], [1], [0]])
    q = torch.nn.functional.one_hot(tokens, 4).float()
    draws = torch.tensor([[0.7, 0.2], [0.3, 0.9], [0.05, 1.0]])
    v = exact_chains(probs, tokens, q, torch.tensor([1, 1, 0]), draws)
    assert (v.length.tolist(), v.token.tolist(), v.tested.tolist()) == ([0, 1, 0], [0, 3, 0], [1, 1, 0])


@pytest.mark.parametrize("point_mass", [False, True], ids=["drawn", "point-mass"])
def test_exact_chains_emit_the_target_law_over_every_draw(point_mass):
    """Quadrature over the drafted token x ~ q (or a fixed point mass), both uniforms on a 300 x 300 grid of
    midpoints: the first emitted token follows p0, and after an accepted x the bonus token follows p1, within the
    grid's resolution; a chain of length 0 emits p0 itself. Claiming the uniform law instead of q biases it (the
    planted mistake)."""
    gen = torch.Generator().manual_seed(3)
    p0, p1, q = (_random_dist(gen, 4).double() for _ in range(3))
    p0, p1, q = p0 / p0.sum(), p1 / p1.sum(), q / q.sum()
    grid = (torch.arange(300, dtype=torch.float64) + 0.5) / 300
    u = torch.cartesian_prod(grid, grid)  # [G^2, 2]

    def law(claimed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        for x in [2] if point_mass else range(4):
            weight = 1.0 if point_mass else float(q[x])
            n = len(u)
            tokens = torch.full((n, 1), x)
            rows = None if point_mass else claimed.expand(n, 1, 4)  # (None: point masses, no laws built)
            v = exact_chains(
                torch.stack([p0, p1])[None].expand(n, 2, 4), tokens, rows, torch.ones(n, dtype=torch.long), u
            )
            kept = v.length == 1
            first += weight * torch.bincount(torch.where(kept, x, v.token), minlength=4) / n
            second += weight * torch.bincount(v.token[kept], minlength=4) / n
        return first, second / second.sum()

    first, second = law(q)
    assert torch.allclose(first, p0, atol=0.01) and torch.allclose(second, p1, atol=0.01)
    v = exact_chains(
        p0[None, None].expand(len(u), 1, 4),
        torch.zeros(len(u), 0, dtype=torch.long),
        torch.zeros(len(u), 0, 4, dtype=torch.float64),
        torch.zeros(len(u), dtype=torch.long),
        u,
    )
    assert torch.allclose(torch.bincount(v.token, minlength=4).double() / len(u), p0, atol=0.01)
    if not point_mass:
        wrong, _ = law(torch.full((4,), 0.25, dtype=torch.float64))
        assert (wrong - p0).abs().max() > 0.03


def test_inverse_cdf_hand_worked_and_exact_over_a_grid_of_draws():
    """Weights (0.2, 0, 0.3, 0.5): draws 0.1, 0.2, 0.49 and 0.99 give tokens 0, 2, 2 and 3 (the first cumulative sum
    above draw × total; the massless token 1 never); over 1,000 evenly spread draws each token's share is its law's."""
    weights = torch.tensor([[0.2, 0.0, 0.3, 0.5]] * 4) * 2  # (unnormalised: the total scales the draw)
    assert inverse_cdf(weights, torch.tensor([0.1, 0.2, 0.49, 0.99])).tolist() == [0, 2, 2, 3]
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    law = torch.tensor([0.2, 0.0, 0.3, 0.5], dtype=torch.float64)
    shares = torch.bincount(inverse_cdf(law.expand(1000, 4), grid), minlength=4).double() / 1000
    assert torch.allclose(shares, law, atol=2e-3)


def test_drawn_takes_each_rows_own_generator_and_the_argmax_at_zero():
    """Row 0 at T = 1 draws what its generator alone gives (its batch-mates change nothing), row 1 at T = 0 is its
    argmax and draws nothing."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5], [3.0, 0.0, 1.0, 0.0]])
    alone, _ = drawn(logits[:1], [1.0], [torch.Generator().manual_seed(7)])
    spare = torch.Generator().manual_seed(11)
    together, laws = drawn(logits, [1.0, 0.0], [torch.Generator().manual_seed(7), spare])
    assert together.tolist() == [int(alone[0]), 0]
    assert torch.equal(spare.get_state(), torch.Generator().manual_seed(11).get_state())
    torch.testing.assert_close(laws[0], torch.softmax(logits[0], -1))


def test_exact_trees_on_chains_are_exact_chains():
    """A chain is a tree: the same draws give the same verdicts, the path being rows 1 .. length. Point masses
    judged from one-hot laws or without laws (None) give the same verdicts too."""
    gen = torch.Generator().manual_seed(4)
    b, k, vocab = 64, 5, 6
    probs = torch.softmax(torch.randn(b, k + 1, vocab, generator=gen) * 2, -1)
    tokens = torch.randint(0, vocab, (b, k), generator=gen)
    q = torch.softmax(torch.randn(b, k, vocab, generator=gen) * 2, -1)
    q[::2] = torch.nn.functional.one_hot(tokens[::2], vocab).float()  # (half of them point masses)
    lengths = torch.randint(0, k + 1, (b,), generator=gen)
    draws = torch.rand(b, k + 1, generator=gen)
    parents = torch.arange(-1, k - 1).expand(b, k)
    masses = torch.nn.functional.one_hot(tokens, vocab).float()
    for laws, given in ((q, q), (masses, None)):  # (drawn nodes, and point masses: `exact_trees`' two passes)
        chains = exact_chains(probs, tokens, laws, lengths, draws)
        unbuilt = exact_chains(probs, tokens, given, lengths, draws)  # (point masses without their laws: the same)
        assert all(torch.equal(getattr(unbuilt, n), getattr(chains, n)) for n in ("length", "token", "tested"))
        trees = exact_trees(probs, tokens, given, parents, lengths, draws, k)
        for name in ("length", "token", "tested"):
            assert torch.equal(getattr(trees, name), getattr(chains, name)), name
        steps = torch.arange(1, k + 1)
        on_path = steps <= trees.length[:, None]
        assert torch.equal(torch.where(on_path, trees.path, 0), torch.where(on_path, steps, 0))


def _tree_joint(honest: bool, trials: int, seed: int = 0) -> float:
    """p-value of the first two tokens `exact_trees` emits, each of `trials` rows one tree (two siblings drawn from
    q1 without replacement, the first with a child drawn from q2 of it), against the target's P1[y] P2[y, z] (a
    single emitted token continues by a draw from P2 of it). `honest`: the second sibling tested against its own
    law (q1 without the first); else against q1 (the planted mistake)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 4
    p1 = _random_dist(gen, vocab)
    p2 = torch.stack([_random_dist(gen, vocab) for _ in range(vocab)])
    bonus = torch.stack([_random_dist(gen, vocab) for _ in range(vocab)])
    q1 = _random_dist(gen, vocab)
    q2 = torch.stack([_random_dist(gen, vocab) for _ in range(vocab)])
    order, laws, _ = draw_distinct_padded(q1.expand(trials, -1), 2, gen)
    a, b = order[:, 0], order[:, 1]
    c = inverse_cdf(q2[a], torch.rand(trials, generator=gen))
    tokens = torch.stack([a, b, c], 1)
    second = laws[:, 1] if honest else q1.expand(trials, -1)
    q = torch.stack([laws[:, 0], second, q2[a]], 1)
    probs = torch.stack([p1.expand(trials, -1), p2[a], p2[b], bonus[c]], 1)
    parents = torch.tensor([-1, -1, 0]).expand(trials, -1)
    v = exact_trees(probs, tokens, q, parents, torch.full((trials,), 3), torch.rand(trials, 4, generator=gen), 2)
    drafted = tokens.gather(1, (v.path - 1).clamp(min=0))
    first = torch.where(v.length >= 1, drafted[:, 0], v.token)
    follow = torch.multinomial(p2[first], 1, generator=gen).squeeze(1)
    after = torch.where(v.length >= 2, drafted[:, 1], torch.where(v.length == 1, v.token, follow))
    counts = torch.bincount(first * vocab + after, minlength=vocab * vocab).double().numpy()
    expected = (p1[:, None] * p2).double().numpy().ravel() * trials
    return stats.chisquare(counts, expected / expected.sum() * trials).pvalue


def test_exact_trees_keep_the_target_law_and_the_planted_mistake_fails():
    """Siblings drawn without replacement, each tested against its own law, a child under the first: exact; the
    second sibling tested against the unconditioned law: biased."""
    assert _tree_joint(True, 40000) > 1e-3
    assert _tree_joint(False, 40000) < 1e-6


def test_point_mass_trees_take_their_one_pass_and_match_the_walk_node_by_node():
    """Trees of point masses (three distinct siblings, two with children): the one-pass verdicts equal the
    node-by-node walk's (the same function given the one-hot laws) for every draw."""
    gen = torch.Generator().manual_seed(5)
    b, vocab = 500, 5
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:3] for _ in range(b)])
    tokens = torch.cat([tokens, torch.stack([torch.randperm(vocab, generator=gen)[:3] for _ in range(b)])], 1)
    parents = torch.tensor([-1, -1, -1, 0, 0, 2]).expand(b, -1)  # [a, b, c, a1, a2, c1]
    probs = torch.softmax(torch.randn(b, 7, vocab, generator=gen) * 2, -1)
    counts = torch.randint(3, 7, (b,), generator=gen)
    draws = torch.rand(b, 7, generator=gen)
    one = exact_trees(probs, tokens, None, parents, counts, draws, 2)
    walked = exact_trees(probs, tokens, torch.nn.functional.one_hot(tokens, vocab).float(), parents, counts, draws, 2)
    for name in ("length", "token", "tested"):
        assert torch.equal(getattr(one, name), getattr(walked, name)), name
    on_path = torch.arange(1, 3) <= one.length[:, None]
    assert torch.equal(torch.where(on_path, one.path, 0), torch.where(on_path, walked.path, 0))
    assert set(one.length.tolist()) == {0, 1, 2}


def test_typical_trees_take_typicals_paths_for_every_slot_at_once():
    """Random trees (distinct siblings) and peaked target laws: every slot's accepted rows and tested depth are the
    host rule's (`typical`), and its token comes from the law at the path's end by the tree's last draw."""
    from specbench.core.acceptance import typical, typical_trees

    gen = torch.Generator().manual_seed(6)
    b, n, vocab = 200, 6, 8
    parents = torch.tensor([-1, -1, 0, 0, 2, 1]).expand(b, -1)
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:n] for _ in range(b)])
    probs = torch.softmax(torch.randn(b, n + 1, vocab, generator=gen) * 3, -1)
    counts = torch.randint(0, n + 1, (b,), generator=gen)
    draws = torch.rand(b, n + 1, generator=gen)
    v = typical_trees(probs, tokens, None, parents, counts, draws, 3, 0.09, 0.3)
    lengths = set()
    for i in range(b):
        c = int(counts[i])
        tree = Tree(tokens[i, :c].tolist(), parents[i, :c].tolist())
        host = typical(tree, probs[i, : c + 1], 0.09, 0.3, torch.Generator().manual_seed(i))
        assert v.path[i, : int(v.length[i])].tolist() == host.rows and int(v.tested[i]) == host.tested, i
        end = host.rows[-1] if host.rows else 0
        assert int(v.token[i]) == int(inverse_cdf(probs[i, end][None], draws[i, c][None]))
        lengths.add(len(host.rows))
    assert lengths >= {0, 1, 2}


def test_exact_chains_of_sparse_laws_are_the_dense_ones():
    """Laws over three candidates a row (`SparseLaws`, DFlash2's kind) give the verdicts of the same laws written
    over the vocabulary, drafted tokens inside and outside the candidates alike (outside: no mass, never kept)."""
    gen = torch.Generator().manual_seed(5)
    b, k, vocab, width = 64, 5, 12, 3
    probs = torch.softmax(torch.randn(b, k + 1, vocab, generator=gen) * 2, -1)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:width] for _ in range(b * k)]).view(b, k, width)
    laws = SparseLaws(ids, torch.softmax(torch.randn(b, k, width, generator=gen), -1))
    picked = ids.gather(2, torch.randint(0, width, (b, k, 1), generator=gen)).squeeze(-1)
    tokens = torch.where(torch.rand(b, k, generator=gen) < 0.8, picked, torch.randint(0, vocab, (b, k), generator=gen))
    lengths = torch.randint(0, k + 1, (b,), generator=gen)
    draws = torch.rand(b, k + 1, generator=gen)
    sparse = exact_chains(probs, tokens, laws, lengths, draws)
    whole = exact_chains(probs, tokens, laws.dense(vocab), lengths, draws)
    for name in ("length", "token", "tested"):
        assert torch.equal(getattr(sparse, name), getattr(whole, name)), name
    assert 0 < int(sparse.length.sum()) < int(lengths.sum())  # (some kept, some rejected)
