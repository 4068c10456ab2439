import numpy as np
import torch
from scipy import stats

from specbench.acceptance import greedy, speculative_sampling
from specbench.tree import Tree, chain


def one_hot_logits(rows: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        logits[i, t] = 5.0
    return logits


def test_greedy_chain_hand_worked():
    # draft 3, 4, 5; the target's argmax after root, 3, 4, 5 is 3, 4, 1, 2 -> accept 3, 4 then correct to 1
    out = greedy(chain([3, 4, 5]), one_hot_logits([3, 4, 1, 2]))
    assert out.rows == [1, 2] and out.token == 1 and out.tested == 3


def test_greedy_all_accepted_gives_bonus():
    out = greedy(chain([3, 4]), one_hot_logits([3, 4, 5]))
    assert out.rows == [1, 2] and out.token == 5 and out.tested == 2


def test_greedy_empty_tree_is_vanilla():
    out = greedy(chain([]), one_hot_logits([4]))
    assert out.rows == [] and out.token == 4 and out.tested == 0


def test_greedy_tree_follows_matching_branch():
    # root -> 1 (row1) -> 2 (row2); root -> 3 (row3) -> 4 (row4). Target argmax: root 3, row3 4, row4 0.
    tree = Tree([1, 2, 3, 4], [-1, 0, -1, 2])
    out = greedy(tree, one_hot_logits([3, 0, 0, 4, 0]))
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
