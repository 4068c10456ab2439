"""The target's forward profile (roofline, tune's cost model) times its sizes in interleaved rounds."""

from types import SimpleNamespace

import pytest
import torch

from specbench.core.cached_lm import Forward
from specbench.core.one_slot import OneSlot
from specbench.run import profiling


class FakeTarget:
    """A CachedLM whose forwards take k ms over k tokens, except during a slow spell; a fake clock advances by that
    much."""

    context_length = 4096
    device = torch.device("cpu")
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=100))

    def __init__(self, slow_calls: set[int]) -> None:
        self.now, self.calls, self.sizes, self.slow_calls = 0.0, 0, [], slow_calls

    def prefill(self, prompt: list[int], layers=None, reuse: bool = False) -> None:
        pass  # (the context)

    def crop(self, length: int) -> None:
        pass

    def run(self, tokens, tree=None, *, last_only=False, layers=None, side=None, greedy: bool = False) -> Forward:
        self.calls += 1
        self.sizes.append(len(tokens))
        self.now += len(tokens) * 1e-3 * (3 if self.calls in self.slow_calls else 1)
        return Forward(torch.zeros(len(tokens), 100))


def test_sizes_are_timed_in_rounds_and_a_slow_spell_does_not_skew_one_size(monkeypatch):
    """Sizes 1, 2, 4 over 1 + 3 rounds; calls 7-9 (the whole second timed round) run 3x slower. Timed one size
    after another, that spell would have fallen on one size and made its median wrong; in rounds, each size has
    one slow timing of three and the median is its true time. The first round is discarded."""
    target = FakeTarget(slow_calls={7, 8, 9})
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: target.now)
    profile = profiling.forward_profile(OneSlot(target), context=10, sizes=(1, 2, 4), repeats=3)
    assert target.sizes == [1, 2, 4] * 4
    assert profile == pytest.approx({1: 1e-3, 2: 2e-3, 4: 4e-3})
