import pytest
import torch

from specbench.core.cached_lm import CachedLM
from specbench.core.losslessness import exact_distribution, first_divergence, greedy_check, sampling_test
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

    def propose(self, tokens, max_depth):
        proposal = super().propose(tokens, max_depth)
        n, vocab = len(proposal.tree), self.draft.model.config.vocab_size
        return Proposal(proposal.tree, torch.full((n, vocab), 1.0 / vocab))


def run_test(target, proposer, samples=1500):
    return sampling_test(
        CachedLM(target), proposer, PROMPT, horizon=2, samples=samples, temperature=1.0, stop_ids=set(), seed=0
    )


def test_exact_distribution_sums_to_one(small_vocab):
    law = exact_distribution(CachedLM(small_vocab[0]), PROMPT, 2, 1.0, set(), min_prob=0.0)
    assert len(law) == 64
    assert abs(sum(law.values()) - 1) < 1e-5


def test_stop_token_ends_a_sequence_early(small_vocab):
    law = exact_distribution(CachedLM(small_vocab[0]), PROMPT, 2, 1.0, {3}, min_prob=0.0)
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
