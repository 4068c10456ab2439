import heapq
import random

import pytest
import torch

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.losslessness import sampling_test
from specbench.core.proposer import Turn
from specbench.errors import SpecbenchError
from specbench.methods.suffix import SuffixDecoding
from specbench.methods.suffix_index import SuffixIndex, speculate
from specbench.methods.vanilla import Vanilla

from .conftest import random_llama

PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 11, 5, 7, 9, 3], [1, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21], [1, 40]]


def index_of(*seqs: list[int]) -> SuffixIndex:
    index = SuffixIndex()
    for sid, seq in enumerate(seqs):
        index.extend(sid, seq)
    return index


def test_hand_worked_draft():
    """Context ...5 7. In [5 7 1 2, 5 7 1 3, 5 7 1 2, 9 7 4]: "7" occurs 4 times (followed by 1, 1, 1, 4) and
    "5 7" 3 times (followed by 1 2 / 1 3 / 1 2). Match 1: one token, 1 at 3/4. Match 2: two tokens, 1 at 3/3
    then 2 at 2/3 (and 3 at 1/3 in a tree): score 1 + 2/3 (+ 1/3), the best."""
    index = index_of([5, 7, 1, 2, 5, 7, 1, 3, 5, 7, 1, 2, 9, 7, 4])
    path = speculate(index, [8, 5, 7], max_tokens=8, depth=24, tree=False)
    assert (path.tokens, path.parents, path.match_len) == ([1, 2], [-1, 0], 2)
    assert path.probs == pytest.approx([1.0, 2 / 3]) and path.score == pytest.approx(5 / 3)
    tree = speculate(index, [8, 5, 7], max_tokens=8, depth=24, min_prob=0.3)
    assert (tree.tokens, tree.parents) == ([1, 2], [-1, 0])  # the 1/3 branch is under a cap of 2 tokens (m=2)
    tree = speculate(index, [8, 5, 7], max_tokens=3, depth=24, factor=2.0, min_prob=0.3)
    assert (tree.tokens, tree.parents) == ([1, 2, 3], [-1, 0, 0]) and tree.score == pytest.approx(2.0)
    assert speculate(index, [8, 5, 7], max_tokens=8, depth=24, factor=2.0, min_prob=0.5).tokens == [1, 2]
    assert speculate(index, [8, 5, 7], max_tokens=1, depth=24).tokens == [1]
    assert speculate(index, [6], max_tokens=8, depth=24).tokens == []  # a single token: nothing to match
    assert speculate(index, [8, 6], max_tokens=8, depth=24).tokens == []  # 6 never occurred


def test_depth_caps_match_plus_draft():
    """A suffix of the reference's tree holds at most `depth` tokens: a 1-token match drafts at most depth - 1,
    which here beats the 2-token match (at most depth - 2)."""
    index = index_of(list(range(10, 30)))
    draft = speculate(index, [10, 11], max_tokens=30, depth=5, factor=10.0)
    assert draft.tokens == [12, 13, 14, 15] and draft.match_len == 1


def test_occurrence_at_the_end_counts_without_continuation():
    """The context itself ends the local sequence: its occurrence there lowers every probability, as in the
    reference's suffix tree (an endpoint at the node)."""
    index = index_of([3, 4, 9, 3, 4])
    draft = speculate(index, [3, 4], max_tokens=4, depth=24, min_prob=0.0)
    assert draft.tokens == [9] and draft.probs == pytest.approx([0.5])


def brute_force(seqs: list[list[int]], context: list[int], max_tokens: int, depth: int, factor: float, min_prob: float):
    """The reference's semantics from scratch: an uncompressed trie of every suffix cut at `depth` tokens,
    node count = suffixes through it; for each match length, the heap-grown tree. Returns the best
    (score, sorted probabilities)."""
    root: dict = {"count": 0, "kids": {}}
    for seq in seqs:
        for start in range(len(seq)):
            node = root
            node["count"] += 1
            for token in seq[start : start + depth]:
                node = node["kids"].setdefault(token, {"count": 0, "kids": {}})
                node["count"] += 1
    pattern = context[-depth:]
    best = (0.0, [])
    for m in range(1, len(pattern)):
        node = root
        for token in pattern[-m:]:
            node = node["kids"].get(token) if node else None
        if node is None:
            break
        limit = min(max_tokens, int(m * factor), depth - m)
        heap, probs, tie = [], [], 0
        for kid in node["kids"].values():
            if kid["count"] / node["count"] >= min_prob:
                heapq.heappush(heap, (-kid["count"] / node["count"], (tie := tie + 1), kid))
        while heap and len(probs) < limit:
            neg, _, kid = heapq.heappop(heap)
            probs.append(-neg)
            for grand in kid["kids"].values():
                p = -neg * grand["count"] / kid["count"]
                if p >= min_prob:
                    heapq.heappush(heap, (-p, (tie := tie + 1), grand))
        if sum(probs) >= best[0]:
            best = (sum(probs), sorted(probs))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_speculate_matches_a_brute_force_suffix_trie(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 3))]
    context = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    depth, max_tokens, min_prob = rng.choice([3, 6, 24]), rng.choice([1, 4, 32]), rng.choice([0.0, 0.1, 0.4])
    factor = rng.choice([1.0, 4.0])
    index = index_of(*seqs)
    draft = speculate(index, context, max_tokens=max_tokens, depth=depth, factor=factor, min_prob=min_prob)
    score, probs = brute_force(seqs, context, max_tokens, depth, factor, min_prob)
    assert draft.score == pytest.approx(score) and sorted(draft.probs) == pytest.approx(probs)


def test_removal_forgets_a_sequence():
    index = index_of([1, 2, 3], [1, 2, 4])
    index.remove(0)
    assert speculate(index, [1, 2], max_tokens=4, depth=24).tokens == [4]
    assert 3 not in index.where


def turn(prompt: list[int], request=None) -> Turn:
    return Turn(prompt, 0.0, request=request)


def test_global_index_holds_earlier_answers_but_never_a_prompts_own():
    proposer = SuffixDecoding()
    proposer.start(turn([1, 2]))
    proposer.update([1, 2, 30, 31, 32, 33, 34], None, None)  # answered 30..34
    proposer.start(turn([5, 6, 30, 31]))  # another request whose context reaches 30 31
    assert proposer.propose([5, 6, 30, 31], 8).tree.tokens[:2] == [32, 33]  # from the earlier answer
    proposer.start(turn([1, 2]))  # the first prompt again (a warm-up or a repeat): its old answer is evicted
    assert proposer.propose([1, 2, 30, 31], 8).tree.tokens == []  # 30 31 32 came from that answer only
    off = SuffixDecoding(max_cached_requests=0)
    off.start(turn([1, 2]))
    off.update([1, 2, 30, 31, 32, 33, 34], None, None)
    off.start(turn([5, 6, 30, 31]))
    assert off.propose([5, 6, 30, 31], 8).tree.tokens == []  # the prompt alone has no continuation of 30 31


def test_requests_are_keyed_by_the_callers_name_when_given():
    """Two questions with one prompt feed each other; a question answered again restarts its conversation."""
    proposer = SuffixDecoding()
    proposer.start(turn([1, 2], request=("q1", 0)))
    proposer.update([1, 2, 30, 31, 32], None, None)
    proposer.start(turn([1, 2], request=("q2", 0)))
    assert proposer.propose([1, 2, 30, 31], 8).tree.tokens == [32]
    proposer.start(turn([1, 2, 30, 31, 32, 7], request=("q1", 1)))  # q1's second turn still sees its first
    proposer.update([1, 2, 30, 31, 32, 7, 50, 51, 52], None, None)
    proposer.start(turn([8], request=("q3", 0)))
    assert proposer.propose([8, 50, 51], 8).tree.tokens == [52]
    proposer.start(turn([1, 2], request=("q1", 0)))  # q1 answered again: both its turns' answers are gone
    assert proposer.propose([1, 2, 30, 31], 8).tree.tokens == []
    assert proposer.propose([1, 2, 50, 51], 8).tree.tokens == []


def test_global_index_evicts_oldest_first():
    proposer = SuffixDecoding(max_cached_requests=2)
    for prompt, answer in (([1], [40, 41, 42]), ([2], [50, 51, 52]), ([3], [60, 61, 62])):
        proposer.start(turn(prompt))
        proposer.update([*prompt, *answer], None, None)
    proposer.start(turn([9]))
    assert proposer.propose([9, 40, 41], 8).tree.tokens == []  # the first answer was evicted
    assert proposer.propose([9, 60, 61], 8).tree.tokens == [62]


def test_a_batchs_slots_share_one_global_index():
    """Built as a batch's slots, suffix proposers share the global index, as a serving engine's requests share its
    cache: a slot drafts from its batch-mate's answer in progress; evicted answers take no more tokens."""
    res = methods.Resources("none", None, None, torch.device("cpu"), torch.float32)
    one, two = methods.build_batch("suffix", res, 2).proposers
    assert one.answers is two.answers and methods.build("suffix", res).proposers[0].answers is not one.answers
    one.start(turn([1, 2], request=("q1", 0)))
    two.start(turn([5, 6], request=("q2", 0)))
    one.update([1, 2, 30, 31, 32, 33], None, None)  # q1's answer so far, still in progress
    assert two.propose([5, 6, 30, 31], 8).tree.tokens[:2] == [32, 33]
    full = SuffixDecoding(max_cached_requests=1)
    full.start(turn([1], request=("q1", 0)))
    evicted = full.current
    full.start(turn([2], request=("q2", 0)))  # q1's answer evicted; its later tokens go nowhere
    full.answers.extend(evicted, [40, 41, 42])
    assert full.propose([2, 40, 41], 8).tree.tokens == []


@pytest.fixture(scope="module")
def target():
    return random_llama(64, seed=0, init=0.3)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_suffix_matches_vanilla_token_for_token(target, prompt):
    reference = decode(CachedLM(target), Vanilla(), prompt, max_new_tokens=40, temperature=0, stop_ids=set()).tokens
    for proposer in (SuffixDecoding(), SuffixDecoding(tree=False), SuffixDecoding(max_spec_factor=4.0)):
        for _ in range(2):  # the second answer of the same prompt must not see the first
            gen = decode(CachedLM(target), proposer, prompt, max_new_tokens=40, temperature=0, stop_ids=set())
            assert gen.tokens == reference


def test_suffix_gains_from_an_earlier_answer(target):
    """A second request that continues the first one's answer gets long drafts from the global index."""
    proposer = SuffixDecoding()
    first = decode(CachedLM(target), proposer, PROMPTS[2], max_new_tokens=40, temperature=0, stop_ids=set())
    follow = [*PROMPTS[2], *first.tokens[:8]]
    second = decode(CachedLM(target), proposer, follow, max_new_tokens=30, temperature=0, stop_ids=set())
    assert second.tokens == first.tokens[8:38]
    assert max(second.accept_lengths) > 3


def test_suffix_passes_the_sampling_test():
    model = random_llama(8, layers=1, hidden=32, seed=0, init=0.5)
    prompt = [1, 2, *decode(CachedLM(model), Vanilla(), [1, 2], max_new_tokens=8, temperature=0, stop_ids=set()).tokens]
    proposer = SuffixDecoding(max_spec_factor=3.0, min_token_prob=0.0)
    gens = [
        decode(
            CachedLM(model),
            proposer,
            prompt,
            max_new_tokens=3,
            temperature=1.0,
            stop_ids=set(),
            generator=torch.Generator().manual_seed(i),
        )
        for i in range(20)
    ]
    assert max(n for g in gens for n in g.accept_lengths) > 1  # drafts are exercised while sampling
    result = sampling_test(
        CachedLM(model), proposer, prompt, horizon=3, samples=1500, temperature=1.0, stop_ids=set(), seed=0
    )
    assert result.passed, result


def test_bad_parameters_are_user_errors():
    assert isinstance(methods.build("suffix", None).proposers[0], SuffixDecoding)
    with pytest.raises(SpecbenchError, match="max_tree_depth >= 2"):
        methods.build("suffix", None, {"max_tree_depth": 1})
    with pytest.raises(SpecbenchError, match="max_cached_requests >= 0"):
        methods.build("suffix", None, {"max_cached_requests": -1})
