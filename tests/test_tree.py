import torch

from specbench.core.tree import Tree, ancestor_matrix, attention_mask, chain, position_ids

# root -> a(0) -> b(1); root -> c(2) -> d(3); a -> e(4)
TREE = Tree([10, 11, 12, 13, 14], [-1, 0, -1, 2, 0])


def brute_force_allowed(tree: Tree) -> torch.Tensor:
    n = len(tree) + 1
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            out[i, j] = j == 0 or j == i or j in tree.path(i)
    return out


def test_depths_children_paths():
    assert TREE.depths() == [1, 2, 1, 2, 2]
    assert TREE.children() == [[1, 3], [2, 5], [], [4], [], []]
    assert TREE.path(5) == [1, 5]
    assert TREE.path(4) == [3, 4]
    assert TREE.path(0) == []
    assert not TREE.is_chain and chain([1, 2, 3]).is_chain


def test_ancestor_matrix_hand_worked():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [1, 0, 0, 1, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_matrix(TREE), expected)


def test_ancestor_matrix_brute_force_random_trees():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(0, 12, (), generator=gen))
        parents = [int(torch.randint(-1, i, (), generator=gen)) if i else -1 for i in range(n)]
        tree = Tree(list(range(n)), parents)
        assert torch.equal(ancestor_matrix(tree), brute_force_allowed(tree))


def test_mask_and_positions():
    mask = attention_mask(TREE, past_len=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 6, 9)
    assert (mask[0, 0, :, :3] == 0).all()  # the cached prefix is visible to every row
    assert mask[0, 0, 2, 3 + 3] < -1e30  # b does not see c
    assert mask[0, 0, 2, 3 + 1] == 0  # b sees a
    assert position_ids(TREE, 3).tolist() == [[3, 4, 5, 4, 5, 5]]


def test_subtree_reindexes():
    sub = TREE.subtree([0, 2, 4])
    assert sub.tokens == [10, 12, 14]
    assert sub.parents == [-1, -1, 0]


def test_parents_must_precede_children():
    import pytest

    with pytest.raises(ValueError):
        Tree([1, 2], [1, -1])
