"""Fidelity to the official implementations, kept under test: our eagle2, eagle3, medusa and ouroboros on the
reference traces' prompts (bundled tiny family, greedy, 128 tokens) append the same number of tokens at every
root both runs verify from, and eagle2/eagle3 verify the same tree there (as a set of token paths)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Drafter
from specbench.models.aliases import ALIASES
from specbench.models.loading import load_causal_lm
from specbench.zoo import TINY_DIR

from .conftest import DATA

TRACES = DATA / "reference_traces"
WEIGHTS = {  # trace key -> the bundled file it was recorded with
    "target": TINY_DIR / "target" / "model.safetensors",
    "draft": TINY_DIR / "draft" / "model.safetensors",
    "eagle2/head": TINY_DIR / "eagle" / "model.safetensors",
    "eagle3/head": TINY_DIR / "eagle3" / "model.safetensors",
    "medusa/heads": TINY_DIR / "medusa" / "medusa_lm_head.safetensors",
}
QUESTIONS = 6  # of the trace's 12: enough roots to compare (hundreds of steps), a CI-sized run time


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trace(method: str) -> dict:
    trace = json.loads((TRACES / f"{method}.json").read_text())
    for key, recorded in trace["weights_sha256"].items():
        path = WEIGHTS.get(f"{method}/{key}") or WEIGHTS[key]
        if _sha256(path) != recorded:
            pytest.skip(
                f"the bundled {key} ({path}) is not the one the {method} trace was recorded with: "
                "the family was retrained, so the trace is stale (record it again with the reference code)"
            )
    return trace


class Recorder(Drafter):
    """Wraps a batch of one's Drafter and keeps the tree the loop verifies at each step (pruned to the budget, as
    the loop does)."""

    def __init__(self, drafter) -> None:
        self.inner = drafter
        self.feature_layers = drafter.feature_layers
        self.trees = []

    def start(self, *args) -> None:
        self.inner.start(*args)

    def propose(self, slots, tokens, max_depths):
        proposals = self.inner.propose(slots, tokens, max_depths)
        self.trees += [p.pruned(d).tree for p, d in zip(proposals, max_depths, strict=True)]
        return proposals

    def update(self, *args) -> None:
        self.inner.update(*args)


def _paths(tree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return set(paths)


@pytest.fixture(scope="module")
def tiny():
    spec = ALIASES["tiny"]
    model = load_causal_lm(spec.target.id, torch.device("cpu"), torch.float32)
    resources = methods.Resources(
        "tiny",
        model,
        None,
        torch.device("cpu"),
        torch.float32,
        draft_path=Path(spec.draft.id),
        head_paths={family: Path(source.id) for family, source in spec.heads.items()},
    )
    return model, resources


@pytest.mark.parametrize("method", ["eagle2", "eagle3", "medusa", "ouroboros"])
def test_steps_match_the_reference_at_shared_roots(tiny, method):
    trace = _trace(method)
    model, resources = tiny
    compared = widest = 0
    for qid, q in list(trace["questions"].items())[:QUESTIONS]:
        recorder = Recorder(methods.build_batch(method, resources))
        gen = decode(
            CachedLM(model),
            recorder,
            q["prompt_ids"],
            max_new_tokens=128,
            temperature=0,
            stop_ids={2},
            rule=methods.rule(method),
        )
        assert gen.tokens == q["tokens"], f"question {qid}: the output differs from the reference run's"
        ours = {}
        root = -1  # our first tree hangs from the last prompt token
        for step, tree in zip(gen.steps, recorder.trees, strict=True):
            ours[root] = (step.accept_length, tree)
            root += step.accept_length
        for ref in q["steps"]:
            if ref["root"] not in ours:
                continue
            appended, tree = ours[ref["root"]]
            where = f"question {qid}, root {ref['root']}"
            assert appended == ref["appended"], f"{where}: we appended {appended}, the reference {ref['appended']}"
            if "tree_paths" in ref:
                assert _paths(tree) == {tuple(p) for p in ref["tree_paths"]}, f"{where}: another tree"
                widest = max(widest, len(tree) + 1)
            compared += 1
    assert compared >= 20, f"only {compared} shared roots: the runs no longer line up"
    if method.startswith("eagle"):
        assert widest == 60, "total_tokens = 60 means 60 verified rows: 59 drafts + the root"
