import copy
from dataclasses import replace

import pytest
import torch

from specbench.core import acceptance
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.losslessness import (
    classify,
    exact_distribution,
    first_divergence,
    greedy_check,
    sampling_test,
    two_ways,
)
from specbench.core.one_slot import OneSlot
from specbench.core.proposer import Proposal
from specbench.methods.pld import PromptLookup
from specbench.methods.sps import DraftModel
from specbench.methods.vanilla import Vanilla

from .conftest import random_llama

PROMPT = [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def small_vocab():
    """An 8-token vocabulary makes the exact law of a few sampled tokens cheap to enumerate."""
    return random_llama(8, layers=1, hidden=32, seed=0, init=0.5), random_llama(
        8, layers=1, hidden=32, seed=1, init=0.5
    )


class UniformClaimDraft(DraftModel):
    """A deliberately wrong sampler: drafts from its model but reports uniform draft probabilities."""

    def propose(self, slots, tokens, max_depths):
        vocab = self.draft.model.config.vocab_size
        proposals = super().propose(slots, tokens, max_depths)
        return [Proposal(p.tree, torch.full((len(p.tree), vocab), 1.0 / vocab)) for p in proposals]


def run_test(target, proposer, samples=1500):
    return sampling_test(
        CachedLM(target), proposer, PROMPT, horizon=2, samples=samples, temperature=1.0, stop_ids=set(), seed=0
    )


def test_exact_distribution_sums_to_one(small_vocab):
    law = exact_distribution(OneSlot(CachedLM(small_vocab[0])), PROMPT, 2, 1.0, set(), min_prob=0.0)
    assert len(law) == 64
    assert abs(sum(law.values()) - 1) < 1e-5


def test_stop_token_ends_a_sequence_early(small_vocab):
    law = exact_distribution(OneSlot(CachedLM(small_vocab[0])), PROMPT, 2, 1.0, {3}, min_prob=0.0)
    assert (3,) in law and not any(len(k) == 2 and k[0] == 3 for k in law)
    assert abs(sum(law.values()) - 1) < 1e-5


@pytest.mark.parametrize(
    "make", [Vanilla, lambda d: PromptLookup(2, 3), lambda d: DraftModel(d, 3)], ids=["vanilla", "pld", "sps"]
)
def test_lossless_methods_pass_the_sampling_test(small_vocab, make):
    target, draft = small_vocab
    proposer = make(draft) if make is not Vanilla else Vanilla()
    result = run_test(target, proposer)
    assert result.passed, result


def test_a_wrong_sampler_fails_the_sampling_test(small_vocab):
    target, draft = small_vocab
    result = run_test(target, UniformClaimDraft(draft, 3))
    assert not result.passed, result


def test_first_divergence():
    assert first_divergence([[1, 2], [3]], [[1, 2], [3]]) is None
    assert first_divergence([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == (1, 1)
    assert first_divergence([[1, 2]], [[1, 2, 3]]) == (0, 2)


def test_greedy_check_reports_margin_at_divergence(small_vocab):
    target = small_vocab[0]
    with torch.no_grad():
        logits = target(torch.tensor([PROMPT])).logits[0, -1]
    best, second = torch.topk(logits, 2).indices.tolist()
    check = greedy_check(target, [[second]], [[best]], [PROMPT])
    assert not check["match"] and check["turn"] == 0 and check["position"] == 0
    top = torch.topk(logits, 2).values
    assert check["margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-5)
    assert greedy_check(target, [[best]], [[best]], [PROMPT])["match"]


@pytest.mark.parametrize("method", ["lookahead", "lookahead-shifted", "suffix"])
def test_verify_command_passes_for_model_free_presets(capsys, tiny_models, method):
    """Greedy answers token-identical to vanilla's and the sampling test passed, through the registry's presets."""
    from specbench.cli.main import main

    target, _ = tiny_models
    args = ["--model", str(target), "--limit", "1", "--max-new-tokens", "12"]
    code = main(["verify", "--method", method, *args, "--samples", "300", "--horizon", "2", "--prompts", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "greedy: 6/6 questions token-identical" in out and "verdict: pass" in out


def test_classify_hand_worked():
    """A token the method's own verification did not pick is a bug whatever the margins; otherwise the two margins
    together must fit in twice the measured two-logit spread (2 x 2 x spread)."""
    assert classify(5, 6, 0.0, 0.0, 1.0) == "bug"
    assert classify(5, 5, 0.01, 0.01, 0.01) == "numerical"  # 0.02 <= 0.04
    assert classify(5, 5, 0.03, 0.02, 0.01) == "bug"  # 0.05 > 0.04
    assert classify(5, 5, 0.5, 0.0, 0.01) == "bug"  # vanilla was sure of its token
    assert classify(5, None, 0.03, None, 0.01) == "numerical"  # an engine's answer: vanilla's margin alone
    assert classify(5, 5, 0.0, 0.0, 0.0) == "numerical"  # an exact tie needs no spread


def test_two_ways_agree_to_rounding_in_float32(small_vocab):
    one, many = two_ways(small_vocab[0], PROMPT + [4, 5, 6, 7, 1, 2, 3])
    assert one.shape == many.shape == (8,)
    assert float((one - many).abs().max()) < 1e-4


def _greedy_run(target, proposer):
    return decode(CachedLM(target), proposer, PROMPT, max_new_tokens=12, temperature=0.0, stop_ids=set())


def test_a_planted_real_bug_is_still_caught(small_vocab, monkeypatch):
    """A greedy rule that emits another token than the target's argmax as its own: its verification forward picked
    another token, so the mismatch is a bug however close the margins."""
    target = small_vocab[0]
    reference = _greedy_run(target, Vanilla())
    greedy = acceptance.greedy  # (the eager cache's: a batch on the device plants it in `greedy_batch`)

    def off_by_one(tree, best, limit=None):
        accepted = greedy(tree, best, limit)
        return replace(accepted, token=(accepted.token + 1) % target.config.vocab_size)

    monkeypatch.setattr(acceptance, "greedy", off_by_one)
    ours = _greedy_run(target, Vanilla())
    assert ours.target_top1 is not None and ours.tokens != reference.tokens
    check = greedy_check(
        target,
        [ours.tokens],
        [reference.tokens],
        [PROMPT],
        [ours.target_top1],
        [ours.target_margin],
        [reference.target_margin],
    )
    assert check["verdict"] == "bug" and not check["near_tie"]
    assert check["method_top1"] != ours.tokens[check["position"]]


def test_a_forced_tie_is_numerical(small_vocab):
    """Two tokens whose readout rows are equal tie exactly: a method whose verification row ranked the other one
    first diverged numerically, not by a bug; with a clear margin the same divergence is a bug."""
    target = copy.deepcopy(small_vocab[0])
    with torch.no_grad():
        logits = target(torch.tensor([PROMPT])).logits[0, -1]
        best, second = torch.topk(logits, 2).indices.tolist()
        target.lm_head.weight[second] = target.lm_head.weight[best]
    reference = _greedy_run(target, Vanilla())
    first = reference.tokens[0]
    other = second if first == best else best
    check = greedy_check(
        target, [[other]], [reference.tokens[:1]], [PROMPT], [[other]], [[0.0]], [reference.target_margin]
    )
    assert check["margin"] == 0.0 and check["verdict"] == "numerical" and check["near_tie"]
    clear = greedy_check(small_vocab[0], [[second]], [[best]], [PROMPT], [[second]], [[0.0]])
    assert clear["verdict"] == "bug"


def test_every_greedy_token_records_the_targets_pick(small_vocab):
    """At T=0 the loop keeps, per new token, the target's argmax in the forward that chose it and its margin."""
    gen = _greedy_run(small_vocab[0], PromptLookup())
    assert gen.target_top1 == gen.tokens and len(gen.target_margin) == len(gen.tokens)
    assert all(m >= 0 for m in gen.target_margin)


def test_a_reused_prefill_samples_what_a_fresh_one_does(small_vocab):
    """The sampling audit keeps the prompt's cache rows between samples: the same draws, seed for seed."""
    target, draft = small_vocab
    lm = CachedLM(target)

    def draws(reuse):
        generator = torch.Generator().manual_seed(7)
        return [
            decode(
                lm,
                DraftModel(draft, 2),
                PROMPT,
                max_new_tokens=4,
                temperature=1.0,
                stop_ids=set(),
                generator=generator,
                reuse_prefill=reuse,
            ).tokens
            for _ in range(6)
        ]

    fresh = draws(False)
    assert draws(True) == fresh
    assert lm.prefilled is not None and lm.prefilled[0][0] == tuple(PROMPT)
