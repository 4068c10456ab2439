import pytest
import torch

from specbench.core.tree import DeviceTree, Tree, additive, ancestor_matrix, attention_mask, chain, position_ids

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_additive_mask_is_zero_where_allowed_and_the_dtypes_min_elsewhere(dtype):
    allowed = torch.tensor([[True, False, True], [False, False, True]])
    mask = additive(allowed, dtype)
    assert mask.dtype == dtype
    assert mask.tolist() == [[0, torch.finfo(dtype).min, 0], [torch.finfo(dtype).min] * 2 + [0]]


def test_subtree_reindexes():
    sub = TREE.subtree([0, 2, 4])
    assert sub.tokens == [10, 12, 14]
    assert sub.parents == [-1, -1, 0]


def test_parents_must_precede_children():
    with pytest.raises(ValueError):
        Tree([1, 2], [1, -1])


class CountsReads(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__bool__", "__index__")
        return func(*args, **(kwargs or {}))


def on_device(tree: Tree, host_parents: bool = False) -> DeviceTree:
    parents = tree.parents if host_parents else torch.tensor(tree.parents)
    return DeviceTree(torch.tensor(tree.tokens), parents, max(tree.max_depth(), 1) + 1)  # a loose bound


def test_a_device_tree_is_read_once_with_the_targets_picks():
    tree = on_device(TREE)
    with CountsReads() as counter:
        assert len(tree) == 5 and not tree.is_chain and tree.depth_bound() == 3  # known without reading
        assert torch.equal(tree.rows(7), torch.tensor([7, 10, 11, 12, 13, 14]))
        assert tree.read_along(torch.tensor([4, 5, 6])) == [4, 5, 6]
        assert tree == TREE and TREE == tree and tree.depth_bound() == 2  # noqa: SIM300 (read: exact now)
        assert tree.read_along(torch.tensor([1])) == [1] and tree.rows(7) == [7, *TREE.tokens]
    assert counter.reads == 2  # the tree with the picks, then the second picks alone
    chain_tree = chain(torch.tensor([3, 4, 5]))  # drafted on the device, its shape known on the host
    assert isinstance(chain_tree, DeviceTree) and chain_tree.is_chain and chain_tree.depth_bound() == 3
    assert chain_tree.read is None and chain_tree == chain([3, 4, 5])


def test_masks_and_positions_of_a_device_tree_match_the_hosts():
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        n = int(torch.randint(1, 12, (), generator=gen))
        tree = Tree(list(range(n)), [int(torch.randint(-1, i, (), generator=gen)) if i else -1 for i in range(n)])
        device_tree = on_device(tree)
        assert torch.equal(ancestor_matrix(device_tree), brute_force_allowed(tree))
        assert torch.equal(attention_mask(device_tree, 4, torch.float32), attention_mask(tree, 4, torch.float32))
        assert torch.equal(position_ids(device_tree, 4, side=[1, 2]), position_ids(tree, 4, side=[1, 2]))
        assert device_tree.read is None  # none of it read the tree


def test_pruning_a_device_tree_whose_shape_is_on_the_host_keeps_it_there():
    tree = on_device(TREE, host_parents=True)
    sub = tree.subtree([0, 2, 4])
    assert isinstance(sub, DeviceTree) and tree.read is None and sub.read is None
    assert sub == TREE.subtree([0, 2, 4])
    assert not isinstance(on_device(TREE).subtree([0, 2, 4]), DeviceTree)  # a drafted shape: read to prune
