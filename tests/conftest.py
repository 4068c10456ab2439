"""Shared fixtures: tiny random-weight models written to disk like any Hugging Face checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specbench import tasks
from specbench.zoo.tokenizer import train_tokenizer

torch.set_num_threads(1)  # correctness tests: tiny ops gain nothing from threads and lose a lot under load

DATA = Path(__file__).parent / "data"  # a small copy of ../shared/data, laid out like it (data/README.md)


def _small(vocab: int, layers: int, hidden: int, context: int, init: float) -> dict:
    """Config fields shared by the random test models."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=init,
        tie_word_embeddings=False,
    )


def random_llama(
    vocab: int, *, layers: int = 2, hidden: int = 64, seed: int = 0, context: int = 1024, init: float = 0.02
) -> LlamaForCausalLM:
    """A random Llama; a large `init` makes its next-token distributions peaked (useful for sampling tests)."""
    config = LlamaConfig(**_small(vocab, layers, hidden, context, init), bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def random_qwen2(vocab: int, *, layers: int = 2, hidden: int = 64, seed: int = 0, init: float = 0.02):
    """A random Qwen2 (biased q/k/v projections), the second architecture family the target must handle."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_small(vocab, layers, hidden, 1024, init), use_sliding_window=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="captures on a GPU"))


def recording(drafter, pruned: bool = False) -> list:
    """The trees a Drafter proposes from now on, in order, every slot's (its propose wrapped; proposals pass
    through); `pruned`: as the loop verifies them, cut to the token budget's depth."""
    trees, propose = [], drafter.propose

    def recorded(slots: list[int], tokens: list[list[int]], max_depths: list[int]):
        proposals = propose(slots, tokens, max_depths)
        trees.extend((p.pruned(d) if pruned else p).tree for p, d in zip(proposals, max_depths, strict=True))
        return proposals

    drafter.propose = recorded
    return trees


def propose_one(drafter, tokens: list[int], max_depth: int):
    """A Drafter's proposal for slot 0 alone (a test's hand-driven step)."""
    return drafter.propose([0], [tokens], [max_depth])[0]


class ClaimsUniform:
    """A planted mistake to mix into a Drafter that samples its drafts: rows drawn from its own law but verified
    as if drawn uniformly, over the vocabulary (over its candidates, for a sparse law) (the sampling audit must fail
    it)."""

    def propose(self, slots, tokens, max_depths):
        from specbench.core.proposer import Proposal
        from specbench.core.sampling import SparseLaws

        def uniform(laws):
            if isinstance(laws, SparseLaws):
                return SparseLaws(laws.ids, torch.full_like(laws.probs, 1 / laws.probs.shape[1]))
            return torch.full_like(laws, 1 / laws.shape[1])

        return [
            p if p.draft_probs is None else Proposal(p.tree, uniform(p.draft_probs))
            for p in super().propose(slots, tokens, max_depths)
        ]


class ClaimsUniformTree:
    """A planted mistake to mix into a block drafter's tree mode (DDTree): its point-mass nodes verified as if each
    were a uniform draw (the sampling audit must fail it)."""

    def propose(self, slots, tokens, max_depths):
        from specbench.core.proposer import Proposal

        vocab = self.draft.config.vocab_size
        return [
            Proposal(p.tree, torch.full((len(p.tree), vocab), 1 / vocab))
            for p in super().propose(slots, tokens, max_depths)
        ]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, draft folder): random weights, a BPE tokenizer trained on the built-in quick prompts."""
    root = tmp_path_factory.mktemp("models")
    text = [turn for q in tasks.load("quick").questions for turn in q.turns]
    tokenizer = train_tokenizer(text * 3, vocab_size=400)
    paths = []
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        model = random_llama(len(tokenizer), layers=layers, seed=seed, init=0.1)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(root / name)
    return paths[0], paths[1]


@pytest.fixture(scope="session")
def quick_text(tmp_path_factory) -> Path:
    """The quick task's turns, twice, as a JSONL training text ({"text": ...} a line)."""
    path = tmp_path_factory.mktemp("text") / "text.jsonl"
    texts = [turn for q in tasks.load("quick").questions for turn in q.turns] * 2
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(autouse=True)
def _brief_forward_profile(monkeypatch):
    """A run in the tests times the target's forward T(n) over 2 rounds, not a run's 10: the tests check that the
    profile is written, read and used, not how precise it is (tests/test_forward_profile.py times it as a run does).
    Runs in other processes (Ray workers, a killed driver) keep the run's rounds."""
    from specbench.run import worker

    timed = worker.forward_profile.__wrapped__  # (under torch.inference_mode's wrapper)
    context, sizes, _ = timed.__defaults__
    monkeypatch.setattr(timed, "__defaults__", (context, sizes, 1))


def same_tokens_in_slots(model, made, alone: list, prompts: list[list[int]], n: int, slots: int = 2) -> None:
    """The prompts as turns of n tokens through `slots` slots of `model` (on the owned decoder), `made` drafting for
    them all: each turn's tokens and accepted lengths are its batch of one's generation `alone[i]`."""
    from specbench.core.decode import Job, decode_batch
    from specbench.core.static_lm import BatchedLM
    from specbench.models.decoder import Decoder

    jobs = [Job(p, n, 0.0, request=(i, 0)) for i, p in enumerate(prompts)]
    ended: dict[int, object] = {}
    decode_batch(
        BatchedLM(Decoder.adopt(model), slots, context=128),
        made,
        lambda: jobs.pop(0) if jobs else None,
        lambda job, gen: ended.__setitem__(job.request[0], gen),
        stop_ids=set(),
    )
    assert sorted(ended) == list(range(len(prompts)))
    for i, gen in ended.items():
        assert (gen.tokens, gen.accept_lengths) == (alone[i].tokens, alone[i].accept_lengths), i


def audited(made, model, prompt: list[int], samples: int, batch: int = 1):
    """The sampling audit (T = 1, horizon 3) of a Drafter `made` for `batch` slots: one at a time, or `batch` at a
    time on a batched target."""
    from specbench.core.cached_lm import CachedLM
    from specbench.core.losslessness import sampling_test
    from specbench.core.static_lm import BatchedLM
    from specbench.models.decoder import Decoder

    return sampling_test(
        CachedLM(model),
        made,
        prompt,
        horizon=3,
        samples=samples,
        temperature=1.0,
        stop_ids=set(),
        seed=0,
        batch=None if batch == 1 else (BatchedLM(Decoder.adopt(model), batch, context=16), made),
    )
