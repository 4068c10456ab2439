"""`draft_vocab`: EAGLE-1/2/3 reading out only the most frequent tokens of the head's training text (FR-Spec), on
the bundled tiny family: the ranking by hand and by brute force, the bundled counts are the heads' training
streams, outputs stay vanilla's and every drafted token is in the shortlist."""

import json

import pytest
import torch

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Drafter
from specbench.errors import SpecbenchError
from specbench.heads import frequencies
from specbench.models import loading as models
from specbench.models.chat import prompt_ids
from specbench.zoo import TINY_DIR

QUESTION = "Explain why the sky is blue to a ten-year-old."


def test_most_frequent_by_hand_and_by_brute_force():
    counts = torch.tensor([3, 0, 7, 3, 1, 7])
    assert frequencies.most_frequent(counts, 3).tolist() == [0, 2, 5]  # 7, 7, then the tie of 3s to id 0
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        counts = torch.randint(0, 4, (12,), generator=generator)
        size = int(torch.randint(1, 13, (1,), generator=generator))
        brute = sorted(sorted(range(12), key=lambda i: (-int(counts[i]), i))[:size])
        assert frequencies.most_frequent(counts, size).tolist() == brute


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_the_bundled_counts_are_the_heads_training_stream(family):
    written = json.loads((TINY_DIR / family / frequencies.FILE).read_text())
    trained = json.loads((TINY_DIR / family / "accuracy.json").read_text())
    assert written["tokens"] == sum(written["counts"]) == trained["train_tokens"]
    assert len(written["counts"]) == json.loads((TINY_DIR / family / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def tiny():
    target = models.load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)
    tokenizer = models.load_tokenizer(TINY_DIR / "target")
    res = methods.Resources(
        "tiny",
        target,
        None,
        torch.device("cpu"),
        torch.float32,
        head_paths={f: TINY_DIR / f for f in ("eagle", "eagle3")},
    )
    return res, prompt_ids(tokenizer, [{"role": "user", "content": QUESTION}])


class Drafts(Drafter):
    """Keeps every token the wrapped Drafter drafted."""

    def __init__(self, inner):
        self.inner, self.feature_layers, self.tokens = inner, inner.feature_layers, set()

    def start(self, slots, turns):
        self.inner.start(slots, turns)

    def propose(self, slots, tokens, max_depths):
        proposals = self.inner.propose(slots, tokens, max_depths)
        self.tokens |= {t for proposal in proposals for t in proposal.tree.tokens}
        return proposals

    def update(self, *args):
        self.inner.update(*args)


def greedy(res, proposer, prompt):
    return decode(CachedLM(res.target_model), proposer, prompt, max_new_tokens=48, temperature=0, stop_ids=set())


def shortlisted(tiny, method: str, params: str) -> Drafts:
    """The method on a 16-token tree with `params` (a draft_vocab), its drafts kept, after checking that its
    output is vanilla's and the whole readout's, at nearly the whole readout's tau."""
    res, prompt = tiny
    reference = greedy(res, methods.build("vanilla", res), prompt).tokens
    tree = "total_tokens=16,depth=3,top_k=4"
    full = greedy(res, methods.build(f"{method}[{tree}]", res), prompt)
    short = Drafts(methods.build(f"{method}[{tree},{params}]", res))
    gen = greedy(res, short, prompt)
    assert gen.tokens == reference == full.tokens and short.tokens
    tau, tau_full = len(gen.tokens) / len(gen.steps), len(full.tokens) / len(full.steps)
    assert tau >= 0.8 * tau_full  # a quarter of the vocabulary holds nearly every token the draft gets right
    return short


@pytest.mark.parametrize("extra", ["", ",draft_dtype=bfloat16"])
def test_a_shortlist_keeps_vanillas_output_and_drafts_only_inside_it(tiny, extra):
    short = shortlisted(tiny, "eagle2", f"draft_vocab=2048{extra}")
    counts = json.loads((TINY_DIR / "eagle" / frequencies.FILE).read_text())["counts"]
    assert short.tokens <= set(frequencies.most_frequent(torch.tensor(counts), 2048).tolist())
    assert short.inner.lm_head.weight.shape[0] == 2048


def test_a_share_below_one_is_that_part_of_the_vocabulary(tiny):
    assert methods.build("eagle2[draft_vocab=0.25]", tiny[0]).lm_head.weight.shape[0] == 2048


@pytest.mark.parametrize("value", [0, 9000, 1.5, "many", "true"])
def test_a_bad_draft_vocab_says_what_it_takes(tiny, value):
    with pytest.raises(SpecbenchError, match="draft_vocab must be a token count from 1 to the vocabulary's 8192, a"):
        methods.build(f"eagle2[draft_vocab={value}]", tiny[0])


def test_an_eagle3_shortlist_is_the_most_frequent_of_its_draft_vocabulary(tiny):
    short = shortlisted(tiny, "eagle3", "draft_vocab=1024")
    head = short.inner.head
    assert head.lm_head.weight.shape[0] == 1024
    shortlist = set(head.target_ids(torch.arange(1024)).tolist())
    vocabulary = set(methods.build("eagle3", tiny[0]).head.target_ids(torch.arange(4096)).tolist())
    rest = sorted(vocabulary - shortlist)
    assert len(rest) == 3072 and shortlist < vocabulary and short.tokens <= shortlist
    counts = torch.tensor(json.loads((TINY_DIR / "eagle3" / frequencies.FILE).read_text())["counts"])
    assert min(counts[sorted(shortlist)]) >= max(counts[rest])  # the most frequent, by the head's counts


def test_an_eagle3_share_is_that_part_of_its_draft_vocabulary(tiny):
    assert methods.build("eagle3[draft_vocab=0.25]", tiny[0]).head.lm_head.weight.shape[0] == 1024
    with pytest.raises(SpecbenchError, match="draft_vocab must be a token count from 1 to the draft vocabulary's 4096"):
        methods.build("eagle3[draft_vocab=5000]", tiny[0])
