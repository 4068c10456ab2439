"""DDTree's tree builder (`core.best_tree`) against brute force: every path from the root enumerated and scored."""

import itertools

import torch

from specbench.core.best_tree import best_trees


def brute_force(logp: torch.Tensor, depth: int, top_k: int) -> list[tuple[float, tuple[int, ...]]]:
    """Every path of at most `depth` choices, each among its parent's `top_k` likeliest under the law of row d
    given the parent's choice (`logp` [rows, parent choice, C]; the root's choice is 0), with its score."""
    paths = []
    for n in range(1, depth + 1):
        for path in itertools.product(range(logp.shape[-1]), repeat=n):
            before, score, allowed = 0, 0.0, True
            for d, c in enumerate(path):
                law = logp[d, before]
                allowed &= c in law.topk(top_k).indices.tolist()
                score, before = score + float(law[c]), c
            if allowed:
                paths.append((score, path))
    return sorted(paths, reverse=True)


def test_the_tree_holds_the_best_scoring_paths_when_a_rows_law_depends_on_the_path():
    """Two slots of different depths, each row's law conditioned on the choice before it (distinct random
    log-probabilities, so no ties): for every budget and top_k, each slot's tree holds exactly its `budget` best
    paths (all of them when there are fewer), its parents precede its children, and choices are named."""
    rng = torch.Generator().manual_seed(3)
    for _ in range(6):
        laws = torch.randn(2, 3, 3, 3, generator=rng).log_softmax(-1)  # [slot, row, parent choice, C]
        depths = [3, 2]

        def children(d, before, parent, laws=laws):
            return torch.stack([laws[i, d][before[i]] for i in range(2)])  # [m, F, C]

        for top_k in (1, 2, 3):
            ranked = [brute_force(laws[i], depths[i], top_k) for i in range(2)]
            for budget in range(1, 16):
                trees = best_trees(
                    children, torch.zeros(2, dtype=torch.long), depths, budget, top_k, lambda d, c: c + 10 * (d + 1)
                )
                for i, tree in enumerate(trees):
                    assert all(p < j for j, p in enumerate(tree.parents))
                    got = {tuple(tree.tokens[r - 1] % 10 for r in tree.path(j + 1)) for j in range(len(tree))}
                    want = {path for _, path in ranked[i][:budget]}
                    assert got == want, (top_k, budget, i)
                    depth = tree.depths()
                    assert all(token // 10 == d for token, d in zip(tree.tokens, depth, strict=True))


def test_ties_go_to_the_shallower_node_so_the_tree_stays_closed_under_parents():
    """Rows of certainty (log-probability 0: a child scores its parent's) and nothing to draft."""
    certain = torch.full((4, 2), -torch.inf)
    certain[:, 0] = 0.0

    def children(d, before, parent):
        return certain[d].expand(1, before.shape[1], -1)

    (tree,) = best_trees(children, torch.zeros(1, dtype=torch.long), [4], 3, 2)
    assert tree.parents == [-1, 0, 1] and tree.tokens == [0, 0, 0]
    assert best_trees(children, torch.zeros(0, dtype=torch.long), [], 3, 2) == []
    assert [len(t) for t in best_trees(children, torch.zeros(1, dtype=torch.long), [4], 0, 2)] == [0]
