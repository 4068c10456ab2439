"""`draft_vocab`: EAGLE-1/2 reading out only the most frequent tokens of the head's training text (FR-Spec), on
the bundled tiny family: the ranking by hand and by brute force, the bundled counts are the head's training
stream, outputs stay vanilla's and every drafted token is in the shortlist."""

import json

import pytest
import torch

from specbench import methods, models
from specbench.cached_lm import CachedLM
from specbench.chat import prompt_ids
from specbench.decode import decode
from specbench.errors import SpecbenchError
from specbench.heads import frequencies
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


def test_the_bundled_counts_are_the_heads_training_stream():
    written = json.loads((TINY_DIR / "eagle" / frequencies.FILE).read_text())
    trained = json.loads((TINY_DIR / "eagle" / "accuracy.json").read_text())
    assert written["tokens"] == sum(written["counts"]) == trained["train_tokens"]
    assert len(written["counts"]) == json.loads((TINY_DIR / "eagle" / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def tiny():
    target = models.load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)
    tokenizer = models.load_tokenizer(TINY_DIR / "target")
    res = methods.Resources("tiny", target, None, torch.device("cpu"), torch.float32,
                            head_paths={"eagle": TINY_DIR / "eagle"})  # fmt: skip
    return res, prompt_ids(tokenizer, [{"role": "user", "content": QUESTION}])


class Drafts:
    """Keeps every token the wrapped proposer drafted."""

    def __init__(self, inner):
        self.inner, self.feature_layers, self.tokens = inner, inner.feature_layers, set()

    def start(self, turn):
        self.inner.start(turn)

    def propose(self, tokens, max_depth):
        proposal = self.inner.propose(tokens, max_depth)
        self.tokens |= set(proposal.tree.tokens)
        return proposal

    def update(self, *args):
        self.inner.update(*args)


def greedy(res, proposer, prompt):
    return decode(CachedLM(res.target_model), proposer, prompt, max_new_tokens=48, temperature=0, stop_ids=set())


@pytest.mark.parametrize("extra", ["", ",draft_dtype=bfloat16"])
def test_a_shortlist_keeps_vanillas_output_and_drafts_only_inside_it(tiny, extra):
    res, prompt = tiny
    reference = greedy(res, methods.build("vanilla", res), prompt).tokens
    tree = "total_tokens=16,depth=3,top_k=4"
    full = greedy(res, methods.build(f"eagle2[{tree}]", res), prompt)
    short = Drafts(methods.build(f"eagle2[{tree},draft_vocab=2048{extra}]", res))
    gen = greedy(res, short, prompt)
    counts = json.loads((TINY_DIR / "eagle" / frequencies.FILE).read_text())["counts"]
    shortlist = set(frequencies.most_frequent(torch.tensor(counts), 2048).tolist())
    assert gen.tokens == reference == full.tokens
    assert short.tokens and short.tokens <= shortlist
    assert short.inner.lm_head.weight.shape[0] == 2048
    tau, tau_full = len(gen.tokens) / len(gen.steps), len(full.tokens) / len(full.steps)
    assert tau >= 0.8 * tau_full  # a quarter of the vocabulary holds nearly every token the draft gets right


def test_a_share_below_one_is_that_part_of_the_vocabulary(tiny):
    assert methods.build("eagle2[draft_vocab=0.25]", tiny[0]).lm_head.weight.shape[0] == 2048


@pytest.mark.parametrize("value", [0, 9000, 1.5, "many", "true"])
def test_a_bad_draft_vocab_says_what_it_takes(tiny, value):
    with pytest.raises(SpecbenchError, match="draft_vocab must be a token count from 1 to the vocabulary's 8192, a"):
        methods.build(f"eagle2[draft_vocab={value}]", tiny[0])
