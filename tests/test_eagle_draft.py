"""EAGLE's tensor drafting loop: a smaller dynamic tree is the select of a larger draft's first levels (what
`specbench tune` relies on), the per-level attention mask is exactly the fed ancestors of each node, and drafting on
--graphs' static cache proposes the eager cache's trees."""

import copy

import pytest
import torch

from specbench.core import choices
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Turn
from specbench.heads.eagle import build, config_from_target
from specbench.methods.eagle import DYNAMIC, Eagle
from specbench.methods.eagle_trees import Draft, DynamicTree, StaticTree

from .conftest import CUDA, propose_one, random_llama, recording

PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 3], [1, 40, 41, 7], [7, 8]]


@pytest.fixture(scope="module")
def model():
    return random_llama(64, seed=0, init=0.3)


@pytest.fixture(scope="module")
def head(model):
    torch.manual_seed(2)
    head = build(config_from_target(model.config))
    head.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    return head.eval()


def started(model, head, expansion, prompt, sampled=False, seed=None):
    proposer = Eagle(head, model.get_output_embeddings(), expansion, sampled=sampled)
    target = CachedLM(model)
    target.reset()
    features = target.run(prompt[:-1], layers=proposer.feature_layers).features
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    proposer.start([0], [Turn(prompt, 1.0 if sampled else 0.0, generator, features)])
    return proposer


@pytest.mark.parametrize("top_k", [1, 3])
def test_a_smaller_dynamic_tree_is_the_select_of_a_larger_drafts_first_levels(model, head, top_k):
    """(T, d): fewer drafts than candidates, and more (T = 500: every candidate of d + 1 levels is verified)."""
    for prompt in PROMPTS:
        large = started(model, head, DynamicTree(60, 5, top_k), prompt)
        propose_one(large, prompt, 20)
        drafted = large.lanes[0].draft()
        assert drafted.depths.tolist() == sorted(drafted.depths.tolist())  # level by level
        assert len(drafted) == top_k + 5 * top_k * top_k
        for total, depth in [(2, 0), (5, 1), (8, 2), (12, 3), (30, 4), (60, 5), (500, 1), (500, 3)]:
            policy = DynamicTree(total, depth, top_k)
            nested = drafted.tree(policy.select(drafted.upto(depth + 1)))
            direct = propose_one(started(model, head, DynamicTree(total, depth, top_k), prompt), prompt, 20).tree
            assert nested == direct, (prompt, total, depth)
            registered = DYNAMIC.subtree(DYNAMIC.snapshot(large, 0, None), {"total_tokens": total, "depth": depth})
            assert registered == direct  # what eagle2 and eagle3 register for `specbench tune`


def test_a_sampled_smaller_tree_is_the_prefix_of_the_same_draws(model, head):
    """Sampled: the first levels consume the same random numbers, and the tree is the first T - 1 candidates."""
    prompt = PROMPTS[0]
    large = started(model, head, DynamicTree(60, 4, 3), prompt, sampled=True, seed=5)
    propose_one(large, prompt, 20)
    drafted = large.lanes[0].draft()
    for total, depth in [(6, 1), (20, 2), (500, 2)]:
        keep = DynamicTree(total, depth, 3).select(drafted.upto(depth + 1))
        proposal = propose_one(
            started(model, head, DynamicTree(total, depth, 3), prompt, sampled=True, seed=5), prompt, 20
        )
        assert drafted.tree(keep) == proposal.tree
        assert torch.equal(drafted.laws[keep], proposal.draft_probs)


class FeedRecorder:
    """Records the tokens and the allowed keys (mask == 0) of every head forward."""

    def __init__(self, head):
        self.calls = []
        self.handle = head.register_forward_pre_hook(self.record)

    def record(self, module, args):
        tokens, mask = args[1], args[3]
        self.calls.append((tokens[0].tolist(), (mask[0, 0] == 0)))


def brute_force_masks(proposer, committed: int) -> list[torch.Tensor]:
    """Each feed's allowed keys from the drafted parents in plain Python: the committed prefix, the node's fed
    ancestors and itself."""
    drafted = proposer.lanes[0].draft()
    parents, depths = drafted.parents.tolist(), drafted.depths.tolist()
    fed, masks = [], []
    for depth in range(1, max(depths)):  # every level but the last grows and is fed
        level = torch.tensor([i for i, d in enumerate(depths) if d == depth])
        nodes = level[proposer.expansion.grow(drafted._map(lambda t, level=level: t[level]))].tolist()
        rows = []
        for row, node in enumerate(nodes):
            above, j = set(), node
            while (j := parents[j]) >= 0:
                above.add(j)
            rows.append([True] * committed + [j in above for j in fed] + [r == row for r in range(len(nodes))])
        masks.append(torch.tensor(rows))
        fed += nodes
    return masks


HAND = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_the_feed_mask_is_the_fed_ancestors_by_hand(model, head):
    """Level 1: nodes 0, 1, 2 ([0], [1], [2]); 0 and 1 grow. Level 2: 3 [0,0], 4 [0,1] under 0, 5 [1,0] under 1;
    3 and 5 grow. Level 3: 6 under 3, 7 under 5, both grow; level 4: 8 under 6, 9 under 7."""
    prompt = PROMPTS[0]
    proposer = started(model, head, StaticTree(HAND), prompt)
    committed = proposer.lanes[0].cache.get_seq_length()
    recorder = FeedRecorder(head)
    try:
        tree = propose_one(proposer, prompt, 20).tree
    finally:
        recorder.handle.remove()
    assert tree.parents == [-1, -1, -1, 0, 0, 1, 3, 5, 6, 7]
    assert proposer.lanes[0].draft().depths.tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    tails = [allowed[:, committed:].int().tolist() for _, allowed in recorder.calls]
    assert tails == [
        [[1, 0], [0, 1]],  # fed: 0, 1
        [[1, 0, 1, 0], [0, 1, 0, 1]],  # fed: 3 (sees 0), 5 (sees 1)
        [[1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1]],  # fed: 6 (sees 0, 3), 7 (sees 1, 5)
    ]
    assert all(allowed[:, :committed].all() for _, allowed in recorder.calls)
    tokens = proposer.lanes[0].draft().tokens.tolist()
    assert [t for t, _ in recorder.calls] == [tokens[0:2], [tokens[3], tokens[5]], tokens[6:8]]


@pytest.mark.parametrize(
    "expansion, sampled",
    [(DynamicTree(40, 4, 3), False), (DynamicTree(60, 5, 10), False), (StaticTree(HAND), True)],
    ids=["dynamic", "dynamic_wide", "static_sampled"],
)
def test_the_feed_mask_equals_a_brute_force_one(model, head, expansion, sampled):
    for prompt in PROMPTS:
        proposer = started(model, head, expansion, prompt, sampled=sampled, seed=3)
        committed = proposer.lanes[0].cache.get_seq_length()
        recorder = FeedRecorder(head)
        try:
            propose_one(proposer, prompt, 20)
        finally:
            recorder.handle.remove()
        assert proposer.lanes[0].cache.get_seq_length() == committed  # the tree keys are cropped
        expected = brute_force_masks(proposer, committed)
        assert len(recorder.calls) == len(expected) > 1
        for (_, allowed), want in zip(recorder.calls, expected, strict=True):
            assert torch.equal(allowed, want)


def test_ties_go_to_the_earlier_node():
    """grow and select keep the k best, an equal score going to the earlier node (a parent before its child when
    a draw has probability 1), returned ascending: the reference's sorted((-score, index))[:k]."""
    generator = torch.Generator().manual_seed(0)
    for n, k in [(12, 3), (40, 10), (7, 7), (5, 9)]:
        for _ in range(20):
            scores = -torch.randint(0, 4, (n,), generator=generator).double()  # many ties
            draft = Draft(
                torch.zeros(n, dtype=torch.long), torch.full((n,), -1), scores, torch.ones(n, dtype=torch.long)
            )
            expected = sorted(sorted(range(n), key=lambda i: (-scores[i].item(), i))[:k])
            assert DynamicTree(k + 1, 3, k).select(draft).tolist() == expected
            expected = sorted(sorted(range(n - 2), key=lambda i: (-scores[2 + i].item(), i))[:k])
            assert DynamicTree(50, 3, k).grow(draft._map(lambda t: t[2:])).tolist() == expected  # positions in it


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(
    "expansion",
    [DynamicTree(60, 5, 3), DynamicTree(8, 2, 2), StaticTree(HAND), StaticTree(choices.resolve("eagle_mc_sim_7b_63"))],
    ids=["deep", "shallow", "static", "static_eagle1"],
)
def test_static_drafting_proposes_the_eager_trees_step_by_step(model, head, expansion, device):
    """--graphs' drafting (the pairs padded to the most a step commits, captured on a GPU per key span and tree
    depth, the budget's shallow last steps too at T = 1; the prompt's pairs off those shapes) proposes the eager
    cache's tree at every step, greedy and at T = 1 (top-k candidates, point masses), as the loop verifies it (at
    T = 0 the budget's last steps draft the whole depth, cut to the budget's in the verdict); sampled children at
    T = 1 keep the eager cache."""
    if device != "cpu":
        model, head = copy.deepcopy(model).to(device), copy.deepcopy(head).to(device)
    accepted, depths = [], set()
    for temperature, sampled in [(0.0, False), (1.0, False), (1.0, True)]:
        for prompt in PROMPTS:
            runs = []
            for graphs in (False, True):
                proposer = Eagle(head, model.get_output_embeddings(), expansion, sampled=sampled, static=graphs)
                trees = recording(proposer, pruned=True)
                gen = decode(
                    CachedLM(model),
                    proposer,
                    prompt,
                    max_new_tokens=30,
                    temperature=temperature,
                    stop_ids=set(),
                    generator=torch.Generator(device).manual_seed(1),
                )
                runs.append((gen.tokens, gen.accept_lengths, trees))
                assert (proposer.lanes[0].cache is None) == (graphs and not sampled)
                assert bool(graphs and not sampled and proposer.static.inputs) == (graphs and not sampled)
                if graphs and not sampled:
                    replays = proposer.static.replays
                    depths |= {depth for _, depth in (replays.graphs if replays.capture else replays.uncaptured)}
            assert runs[1] == runs[0], (temperature, sampled, prompt)
            assert len(runs[0][2]) > 1 and any(len(tree) for tree in runs[0][2])
            accepted += runs[0][1]
    assert max(accepted) > 2  # steps commit several pairs (the padded rows are real rows there)
    assert expansion.max_depth in depths and min(depths) < expansion.max_depth  # shallow last steps replayed too


def test_a_static_trees_fixed_levels_are_what_its_template_admits_and_grows(model, head):
    """The levels `StaticTree.fixed` reads from the template are those the host-synced path finds in a draft."""
    tree = StaticTree(HAND)
    proposer = started(model, head, tree, PROMPTS[0])
    propose_one(proposer, PROMPTS[0], 20)
    depths = proposer.lanes[0].draft().depths
    levels = [tree.fixed(d, tree.branch, torch.device("cpu")) for d in range(1, 5)]
    assert [len(admitted) for admitted, _ in levels] == [int((depths == d).sum()) for d in range(1, 5)]
    assert [grown.tolist() for _, grown in levels] == [[0, 1], [0, 2], [0, 1], []]
    assert tree.fed == 6 and tree.fixed(1, 2, torch.device("cpu"))[0].tolist() == [0, 1]  # top-2 of 3 ranks
