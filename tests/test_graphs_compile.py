"""`--graphs --compile`: the target's decoder layers and EAGLE's static drafting go through torch.compile (dynamic
shapes) before they are captured. They give the uncompiled static path's outputs, and a forward past a new key span
(256 rows more) builds no new graph: the span is a symbol, not a constant, so a long answer never recompiles; the
layer's number is one too, so the layers share their graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.static_lm import SPAN, BatchedLM, Row
from specbench.core.tree import Tree
from specbench.heads.eagle import build, config_from_target
from specbench.methods.eagle import Eagle
from specbench.methods.eagle_trees import DynamicTree
from specbench.models.decoder import Decoder
from specbench.models.loading import compile_layers

from .conftest import CUDA, random_llama, recording

TREE = Tree([40, 41, 42, 43], [-1, -1, 1, 2])


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def forward(lm: BatchedLM, tokens: list[int], tree: Tree | None = None) -> torch.Tensor:
    return lm.run([Row(0, tokens, tree)])[0].logits


def steps(lm: BatchedLM) -> list[torch.Tensor]:
    """One of each kind of step a decode takes: a one-token forward, a chain of 3, a tree with its mask; commits."""
    outs = [forward(lm, [7])]
    start = lm.lengths[0]
    outs.append(forward(lm, [8, 9, 10]))
    lm.commit([(0, start - 1, [0, 1])])
    start = lm.lengths[0]
    outs.append(forward(lm, TREE.rows(11), TREE))
    lm.commit([(0, start, [0, 2, 3])])
    return outs


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_compiled_static_forward_gives_the_uncompiled_logits_and_no_graph_per_span_or_layer(device):
    model = random_llama(64, layers=4, seed=3).to(device)
    owned = Decoder.adopt(copy.deepcopy(model))
    compile_layers(owned.layers)  # (what `--graphs --compile` does on a GPU)
    plain, compiled = BatchedLM(Decoder.adopt(model)), BatchedLM(owned)
    prompt = [int(t) for t in torch.randint(3, 64, (SPAN - 12,), generator=torch.Generator().manual_seed(0))]
    before = graphs()
    for lm in (plain, compiled):
        lm.prefill([0], [prompt])  # (the compiled one's allocates the cache, uncompiled)
    for lm in (plain, compiled):  # the first span's shapes: compiled (and captured on a GPU) here
        forward(lm, [5])
    torch.testing.assert_close(forward(compiled, [5]), forward(plain, [5]), rtol=1e-4, atol=1e-4)
    built = None
    for _ in range(4):  # 4 x 7 rows: from the first span of keys into the second
        for ours, theirs in zip(steps(compiled), steps(plain), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        built = graphs() if built is None else built
    assert compiled.lengths == plain.lengths and plain.lengths[0] > SPAN
    assert graphs() == built, "a new key span recompiled the forward"
    assert built - before == 2  # one for a single row, one for more, the 4 layers sharing them (a graph a layer: 8)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_compiled_static_drafting_proposes_the_uncompiled_trees(device):
    """EAGLE-2's drafting compiled proposes the trees of the uncompiled static drafting step by step, through a
    prompt that takes the head's cache past one key span, and builds no graph for the second span."""
    model = random_llama(64, layers=1, seed=0, init=0.3).to(device)
    torch.manual_seed(2)
    head = build(config_from_target(model.config)).eval().to(device)
    head.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    prompt = [int(t) for t in torch.randint(3, 64, (SPAN - 40,), generator=torch.Generator().manual_seed(1))]
    runs, built = [], []
    for compiled in (False, True):
        proposer = Eagle(head, model.get_output_embeddings(), DynamicTree(16, 3, 3), static=True, compile=compiled)
        trees = recording(proposer)
        for tokens, spans in ((8, {SPAN}), (40, {SPAN, 2 * SPAN})):  # the first key span, then into the second
            gen = decode(CachedLM(model), proposer, prompt, max_new_tokens=tokens, temperature=0.0, stop_ids=set())
            assert set(proposer.static.inputs) == spans
            built.append(graphs())
        runs.append((gen.tokens, gen.accept_lengths, trees))
    assert runs[1] == runs[0]
    assert len(runs[0][2]) > 3 and any(len(tree) for tree in runs[0][2])
    assert built[2] - built[1] == 1, "the drafting step is one graph (no graph breaks)"
    assert built[3] == built[2], "a new key span recompiled the drafting"
