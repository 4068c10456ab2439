"""Micro-benchmarks of the hot paths (pytest-benchmark; not part of the test run):

    python -m pytest benchmarks/ --benchmark-only                    # the table
    ... --benchmark-storage=benchmarks/baselines --benchmark-save=NAME  # record a baseline for this machine
    ... --benchmark-storage=benchmarks/baselines --benchmark-compare --benchmark-compare-fail=mean:25%

The decode loop is timed against a stub target (no model: the next token after t is t + 1, and each
forward still builds the mask and positions a real one would), so what remains is the loop's own cost per
step; the bundled tiny target's forwards are timed beside it for scale. Run on an idle machine only.
"""

from __future__ import annotations

import random

import pytest
import torch

from specbench import methods
from specbench.core import acceptance
from specbench.core.cached_lm import CachedLM, Forward
from specbench.core.choices import MEDUSA_MC_SIM_7B_63
from specbench.core.decode import decode
from specbench.core.proposer import Proposal, Proposer, Turn
from specbench.core.static_cache import StaticRows
from specbench.core.tree import Tree, attention_mask, chain, from_choices, position_ids
from specbench.methods.ngram_pool import NgramPool
from specbench.methods.pld import find_continuation
from specbench.models.few_rows import FewRowLinear, use_few_row_layout
from specbench.models.loading import load_causal_lm
from specbench.zoo import TINY_DIR

VOCAB = 8192  # the tiny family's
TREE = from_choices(MEDUSA_MC_SIM_7B_63)  # 63 nodes, depth 4: the size of EAGLE-2's and Medusa's trees
PAST = 400  # tokens already in the cache


class StubTarget(CachedLM):
    """Logits by rule instead of a model; the tree mask and positions are built as for a real forward."""

    def __init__(self) -> None:
        self.device, self.dtype, self.context_length, self.length = torch.device("cpu"), torch.float32, 1 << 30, 0

    @property
    def cached(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0

    def run(self, tokens, tree=None, *, last_only=False, layers=None, side=None) -> Forward:
        if tree is not None and not tree.is_chain:
            position_ids(tree, self.length, self.device)
            attention_mask(tree, self.length, self.dtype, self.device)
        logits = torch.zeros(len(tokens), VOCAB)
        logits[torch.arange(len(tokens)), (torch.tensor(tokens) + 1) % VOCAB] = 1.0
        self.length += len(tokens)
        return Forward(logits[-1:] if last_only else logits)

    def commit(self, start: int, keep: list[int]) -> None:
        self.length = start + len(keep)

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


class Oracle(Proposer):
    """Proposes the stub's own continuation: as a chain of `k`, or along rank 0 of a tree with wrong siblings."""

    def __init__(self, tree: Tree | None = None, k: int = 5) -> None:
        self.tree, self.k = tree, k

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        if self.tree is None:
            return Proposal(chain([(tokens[-1] + i) % VOCAB for i in range(1, self.k + 1)]))
        depths = self.tree.depths()
        ranks = self.tree.tokens  # template: each node's rank among its siblings
        return Proposal(
            Tree([(tokens[-1] + d + 7 * r) % VOCAB for d, r in zip(depths, ranks, strict=True)], self.tree.parents)
        )


@pytest.mark.parametrize("shape", ["chain5", "tree63"])
def test_loop_overhead(benchmark, shape):
    """One whole decode of 120 tokens with a stub target: the loop's own cost (per step: divide by steps)."""
    proposer = Oracle() if shape == "chain5" else Oracle(TREE)
    run = benchmark(
        lambda: decode(StubTarget(), proposer, [1] * PAST, max_new_tokens=120, temperature=0, stop_ids=set())
    )
    benchmark.extra_info["steps"] = len(run.steps)
    assert run.tokens == [(1 + i) % VOCAB for i in range(1, 121)]


@pytest.fixture(scope="module")
def tiny():
    return load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)


@pytest.fixture(params=["few_rows", "f_linear"])
def layout(request, tiny):
    """The CPU linear layout the tiny target runs with: its own (few_rows, at the row counts this process
    calibrated) or plain F.linear throughout."""
    if request.param == "f_linear":
        for layer in tiny.modules():
            if isinstance(layer, FewRowLinear):
                layer.__class__ = torch.nn.Linear
    yield request.param
    use_few_row_layout(tiny)


@pytest.mark.parametrize("rows", [1, 4, 8, 16, 32, 64])
def test_tiny_target_forward(benchmark, tiny, layout, rows):
    """The tiny target over one token (a vanilla step), a chain of 4 to 32 (a draft model's), or [root] + a
    63-node tree, after PAST cached tokens."""
    lm = CachedLM(tiny)
    lm.prefill(list(range(1, PAST + 2)))

    def forward():
        lm.run(list(range(rows)), TREE if rows == len(TREE) + 1 else None)
        lm.crop(PAST)

    benchmark(forward)


@pytest.fixture(scope="module")
def logits():
    torch.manual_seed(0)
    return torch.randn(len(TREE) + 1, VOCAB) * 3


def test_accept_greedy_tree63(benchmark, logits):
    benchmark(acceptance.greedy, TREE, logits)


def test_accept_sampling_chain5(benchmark, logits):
    probs, draft = torch.softmax(logits[:6], -1), torch.softmax(logits[1:6] * 0.9, -1)
    tokens = draft.argmax(-1).tolist()
    generator = torch.Generator().manual_seed(0)
    benchmark(acceptance.speculative_sampling, chain(tokens), probs, draft, generator)


@pytest.mark.parametrize("laws", ["point", "sampled"])
def test_accept_sampling_tree63(benchmark, logits, laws):
    probs = torch.softmax(logits, -1)
    draft = torch.softmax(logits[1:] * 0.9, -1) if laws == "sampled" else None
    tree = Tree(probs[[0, *[p + 1 for p in TREE.parents]]].argmax(-1)[1:].tolist(), TREE.parents)
    generator = torch.Generator().manual_seed(0)
    benchmark(acceptance.speculative_sampling, tree, probs, draft, generator)


def test_tree_mask_and_positions(benchmark):
    benchmark(lambda: (attention_mask(TREE, PAST, torch.float32), position_ids(TREE, PAST)))


def _time_propose(benchmark, tiny, method: str) -> None:
    res = methods.Resources(
        "tiny", tiny, None, torch.device("cpu"), torch.float32, head_paths={"eagle": TINY_DIR / "eagle"}
    )
    proposer = methods.build(method, res)
    prompt = list(range(1, PAST + 2))
    features = CachedLM(tiny).prefill(prompt, layers=(-1,)).features
    proposer.start(Turn(prompt, 0.0, features=features))
    proposal = benchmark(proposer.propose, prompt, 10)
    assert len(proposal.tree) == 59


@pytest.mark.parametrize("depth", [1, 5])
def test_eagle2_drafting(benchmark, tiny, depth):
    """EAGLE-2's drafting of one step with the bundled head, built as `specbench run` builds it: top_k 10, 60
    tokens, depth 5 (its default: 6 levels, 59 drafts kept) or depth 1 (2 levels: the root's readout, then one
    grown level fed and read out)."""
    _time_propose(benchmark, tiny, f"eagle2[depth={depth}]")


@pytest.mark.parametrize("depth", [1, 5])
def test_eagle2_drafting_bfloat16(benchmark, tiny, depth):
    """The same with `draft_dtype=bfloat16`: the head and a copy of the lm_head in bfloat16, the target float32."""
    _time_propose(benchmark, tiny, f"eagle2[depth={depth},draft_dtype=bfloat16]")


@pytest.mark.parametrize("depth", [1, 5])
def test_eagle2_drafting_bfloat16_quarter(benchmark, tiny, depth):
    """And reading out only the most frequent quarter of the vocabulary (`draft_vocab=0.25`, FR-Spec)."""
    _time_propose(benchmark, tiny, f"eagle2[depth={depth},draft_dtype=bfloat16,draft_vocab=0.25]")


@pytest.mark.parametrize("depth", [1, 5])
def test_eagle2_drafting_products(benchmark, tiny, depth):
    """The matrix products alone of test_eagle2_drafting at the same depth, through the same layers and row
    counts: the LM-head readout of the root, then per level the head's fc, q, k, v, o, gate, up and down over
    the 10 grown nodes and their readout. What drafting costs beyond this is the loop's own (attention, top-k,
    norms, the tree's bookkeeping); this part only a faster kernel or fewer weights read can cut."""
    res = methods.Resources(
        "tiny", tiny, None, torch.device("cpu"), torch.float32, head_paths={"eagle": TINY_DIR / "eagle"}
    )
    head = methods.build("eagle2", res).head
    layer, readout = head.layers[0], tiny.get_output_embeddings()
    attention, mlp = layer.self_attn, layer.mlp
    hidden = head.config.hidden_size
    root, level = torch.randn(1, hidden), torch.randn(10, hidden)  # top_k = 10 nodes grow per level

    @torch.inference_mode()
    def products():
        readout(root)
        for _ in range(depth):
            x = head.fc(torch.cat([level, level], dim=-1))
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
                proj(x)
            mlp.down_proj(mlp.gate_proj(x) * mlp.up_proj(x))
            readout(x)

    benchmark(products)


def test_pld_lookup(benchmark):
    """Prompt lookup's n-gram search over a 2,000-token context whose match lies far back."""
    tokens = [i % 997 for i in range(2000)] + [5, 6, 7]
    benchmark(find_continuation, tokens, 3, 10)


def test_ngram_pool(benchmark):
    """Lookahead's pool: adding a step's n-grams and looking up a key."""
    pool = NgramPool(length=4, capacity=7)
    tokens = [i % 251 for i in range(2000)]
    pool.add_sequence(tokens)

    def step():
        pool.add_sequence(tokens[-12:])
        return pool.candidates(tokens[-1], 7)

    benchmark(step)


@pytest.mark.parametrize("layers", [12, 32])
def test_commit_rows_at_batch_64(benchmark, layers):
    """One tree step's commit in a static cache of 64 slots (`StaticRows.commit_rows`): each slot keeps its root and
    three nodes, none of them in place, through every layer (the tiny family's 12, a 7B's 32)."""
    draw = random.Random(0)
    cache = StaticRows(layers, capacity=512, batch=64)
    cache.keys, cache.values = (torch.zeros(64, 1, layers * 512, 8) for _ in range(2))
    moves = [(slot, 100, [0, *sorted(draw.sample(range(2, 30), 3))]) for slot in range(64)]
    benchmark(cache.commit_rows, moves)
