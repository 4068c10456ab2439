"""Synthetic acceptance (`run --acceptance synthetic:PROFILE`): the verdict of a real verification forced at given
per-position rates, in every regime and batch size; its answers marked cost-only and kept out of every
losslessness check."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from specbench import methods
from specbench.cli.main import main
from specbench.config import RunConfig
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import Generation, Job, decode, decode_batch
from specbench.core.static_lm import BatchedLM
from specbench.core.synthetic import Profile, parse
from specbench.errors import SpecbenchError
from specbench.methods.sps import DraftModel
from specbench.models.decoder import Decoder
from specbench.models.loading import load_causal_lm
from specbench.report import metrics
from specbench.run.runner import _check_manifest, default_out
from specbench.zoo import TINY_DIR

from .conftest import random_llama, recording
from .test_batch import HEADS
from .test_cli import base, error_of

PROMPTS = [[5, 9, 11], [40, 41, 42, 43], [7, 3], [12, 30, 31, 8, 2]]
DRAFTS = 4


@pytest.fixture(scope="module")
def models():
    """A random target and draft of one vocabulary, as transformers models (the eager regime's) and on the owned
    decoder (the static caches')."""
    target, draft = random_llama(64, layers=2, seed=4), random_llama(64, layers=1, seed=5)
    return {"eager": (target, draft), "static": (Decoder.adopt(target), Decoder.adopt(draft))}


def decoded(models, rates, regime: str, temperature: float = 0.0, budget: int = 24) -> list[Generation]:
    """Every prompt answered by sps under the synthetic profile `rates`, in `regime`: the eager cache, the static one
    (`--graphs`) or a batch of 3 (`--batch 3`); each turn's draws keyed by its own seed."""
    target, draft = models["eager" if regime == "eager" else "static"]
    profile = Profile(tuple(rates))
    if regime == "batch":
        jobs = [Job(p, budget, temperature, torch.Generator().manual_seed(i), (i, 0)) for i, p in enumerate(PROMPTS)]
        ended: dict[int, Generation] = {}
        decode_batch(
            BatchedLM(target, 3, context=128),
            DraftModel(BatchedLM(draft, 3, context=128), DRAFTS),
            lambda: jobs.pop(0) if jobs else None,
            lambda job, gen: ended.__setitem__(job.request[0], gen),
            stop_ids=set(),
            rule=profile,
        )
        return [ended[i] for i in range(len(PROMPTS))]
    cache = CachedLM if regime == "eager" else BatchedLM
    return [
        decode(
            cache(target),
            DraftModel(cache(draft), DRAFTS),
            p,
            max_new_tokens=budget,
            temperature=temperature,
            stop_ids=set(),
            generator=torch.Generator().manual_seed(i),
            request=(i, 0),
            rule=profile,
        )
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("regime", ["eager", "static", "batch"])
def test_rates_of_one_accept_every_draft_and_zero_none(models, regime, temperature):
    for gen in decoded(models, [1.0], regime, temperature):
        assert all(s.accept_length == s.tree_size and s.tested == s.tree_size - 1 for s in gen.steps)
        assert len(gen.tokens) == 24 and gen.target_top1 is None  # (no greedy check's picks: not the target's)
    for gen in decoded(models, [0.0], regime, temperature, budget=8):
        assert all(s.accept_length == 1 and s.tested == min(1, s.tree_size - 1) for s in gen.steps)
        assert max(s.tree_size for s in gen.steps) == DRAFTS + 1  # (the drafter drafted: only the verdict refused)


def test_measured_acceptance_matches_the_profile(models):
    """α_k of a synthetic run (the report's per-position acceptance) is each position's rate within sampling error
    (4 standard errors), positions past the profile taking its last rate."""
    rates = [0.8, 0.5, 0.3]
    gens = decoded(models, rates, "eager", budget=200)
    steps = pd.DataFrame(
        [(s.accept_length, s.tested) for g in gens for s in g.steps if s.tree_size > 1], columns=["accepted", "tested"]
    )
    alphas, counts = metrics.acceptance_by_position(steps, DRAFTS), metrics.acceptance_counts(steps, DRAFTS)
    for k, (alpha, n) in enumerate(zip(alphas, counts, strict=True), 1):
        rate = Profile(tuple(rates)).rate(k)
        assert n >= 20 and abs(alpha - rate) <= 4 * (rate * (1 - rate) / n) ** 0.5, (k, alpha, rate, n)


def test_a_slots_verdicts_do_not_depend_on_its_batch_mates(models):
    """Each turn draws from a generator keyed by its seed, turn and step: in a batch of 3 its tokens and accepted
    lengths are its batch of one's."""
    alone, together = decoded(models, [0.6], "static"), decoded(models, [0.6], "batch")
    for one, batch in zip(alone, together, strict=True):
        assert (one.tokens, one.accept_lengths) == (batch.tokens, batch.accept_lengths)
    assert len({tuple(g.accept_lengths) for g in alone}) > 1


def test_profiles_parse_from_rates_or_files(tmp_path):
    assert parse("synthetic:0.8, 0.6,0.5").rates == (0.8, 0.6, 0.5)
    assert parse("synthetic:0.7").rate(9) == 0.7 and parse("synthetic:1,0").rate(5) == 0.0
    listed = tmp_path / "rates.json"
    listed.write_text("[0.9, 0.4]")
    assert parse(f"synthetic:{listed}").label == "0.9,0.4"
    measured = tmp_path / "speculation_profile.json"  # as `report` writes it
    measured.write_text(json.dumps({"conditional_accept_rates": [0.75, 0.5], "mean_accept_length": 2.1}))
    assert parse(f"synthetic:{measured}").rates == (0.75, 0.5)
    for spec, says in [
        ("0.8,0.6", "the one mode is synthetic"),
        ("synthetic:0.8,1.2", "must lie in"),
        (f"synthetic:{tmp_path / 'none.json'}", "neither rates nor a file"),
        (f"synthetic:{measured.parent}", "neither rates nor a file"),
    ]:
        with pytest.raises(SpecbenchError, match=says):
            parse(spec)
    measured.write_text('{"mean_accept_length": 2.1}')
    with pytest.raises(SpecbenchError, match="conditional_accept_rates"):
        parse(f"synthetic:{measured}")


def test_a_synthetic_run_is_marked_and_never_checked(capsys, tiny_models, tmp_path):
    """Every answer (one at a time and two at a time), the manifest, the report's header and every row of its tables
    say cost-only; no answer carries a greedy check, the losslessness table lists none, and `verify` takes no
    synthetic acceptance."""
    argv = [*base(tiny_models, tmp_path), "--methods", "sps", "--no-warmup", "--no-noise-floor", "--batch", "1,2"]
    assert main([*argv, "--acceptance", "synthetic:0.9,0.5"]) == 0, capsys.readouterr().err
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["synthetic"] == {"cost_only": True, "rates": [0.9, 0.5]}
    records = [json.loads(line) for f in (run / "answers").rglob("*.jsonl") for line in f.open()]
    assert {(r["specbench"]["method"], r["specbench"]["batch_size"]) for r in records} == {
        (m, b) for m in ("vanilla", "sps") for b in (1, 2)
    }
    assert all(r["specbench"]["synthetic"] == [0.9, 0.5] and r["specbench"]["greedy_check"] is None for r in records)
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "**Cost-only**" in report and "synthetic acceptance 0.9,0.5" in report
    rows = [line for line in report.splitlines() if line.startswith(("| sps", "| vanilla"))]
    assert rows and all("(cost-only)" in line for line in rows)
    assert "with real acceptance (cost-only answers are never checked)" in report
    assert "synthetic:1.5" in error_of(capsys, [*argv, "--acceptance", "synthetic:1.5"])
    with pytest.raises(SystemExit):
        main(["verify", "--method", "sps", "--acceptance", "synthetic:1"])


@pytest.fixture(scope="module")
def tiny():
    """The bundled tiny family: its target on the eager cache and on the owned decoder, and its drafters."""
    target = load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)
    res = methods.Resources("tiny", target, None, torch.device("cpu"), torch.float32, head_paths=HEADS)
    return target, Decoder.adopt(target), res


@pytest.mark.parametrize("method", ["eagle2", "eagle3", "medusa", "dflash", "pard"])
def test_every_model_drafter_takes_the_forced_verdict(tiny, method):
    """The tiny family's learned drafters, eager alone and two slots drafting together on the static cache: at rate
    1 every step accepts a path as deep as its tree (down the deepest branch: trees too), at rate 0 nothing."""
    target, owned, res = tiny
    prompts = [[1, 23, 45, 67, 89, 101], [1, 300, 301, 302]]
    for rate, budget in ((1.0, 24), (0.0, 6)):
        profile = Profile((rate,))
        drafters = [methods.build_batch(method, res) for _ in prompts]
        logs = [recording(drafting) for drafting in drafters]  # each one's trees, as it proposes them
        gens = [
            decode(CachedLM(target), d, p, max_new_tokens=budget, temperature=0, stop_ids=set(), rule=profile)
            for d, p in zip(drafters, prompts, strict=True)
        ]
        jobs = iter([Job(p, budget, 0.0, request=(i, 0)) for i, p in enumerate(prompts)])
        decode_batch(
            BatchedLM(owned, 2),
            methods.build_batch(method, res, 2),
            lambda it=jobs: next(it, None),
            lambda job, gen, out=gens: out.append(gen),
            stop_ids=set(),
            rule=profile,
        )
        steps = [s for g in gens for s in g.steps if s.tree_size > 1]
        assert len(gens) == 4 and len(steps) >= 4
        if rate:
            for gen, log in zip(gens[:2], logs, strict=True):  # (not the last step: its tree pruned to the budget)
                assert [s.accept_length - 1 for s in gen.steps[:-1]] == [t.max_depth() for t in log[:-1]]
            assert all(s.tested == s.accept_length - 1 >= 1 for s in steps)
        else:
            assert all((s.accept_length, s.tested) == (1, 1) for s in steps)


def test_a_run_resumes_only_with_its_acceptance(tmp_path):
    """A synthetic run gets a folder of its own by default, and a run folder refuses to resume with another
    `--acceptance` (its answers would mix real and forced verdicts)."""
    assert default_out(RunConfig()) != default_out(RunConfig(acceptance="synthetic:0.8"))
    config = {"methods": ["vanilla"], "repeats": 1, "engine": "specbench"}
    path, real = tmp_path / "manifest.json", {"config": config, "machine": {"device_name": "cpu"}}
    _check_manifest(path, real)
    _check_manifest(path, real)  # (the same settings resume)
    with pytest.raises(SpecbenchError, match="with different acceptance: pass another --out"):
        _check_manifest(path, {**real, "config": {**real["config"], "acceptance": "synthetic:0.8"}})
