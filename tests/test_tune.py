"""`specbench tune`: exact scoring of nested settings, the tuned-presets file, `run --tuned` and its errors."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specbench import methods, registry
from specbench.cli.main import main
from specbench.config import RunConfig
from specbench.core import acceptance, choices
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.one_slot import OneSlot
from specbench.core.own_step import verify
from specbench.core.proposer import Drafter, Proposal, Turn
from specbench.core.tree import Tree, chain
from specbench.errors import SpecbenchError
from specbench.methods import variant_name as variant
from specbench.models.loading import load_causal_lm
from specbench.run import tuned
from specbench.tune import calibrate as calibration
from specbench.tune.calibrate import Recorder, accepted
from specbench.tune.cost import Cost, Score, Turns, draft_slope, geometric_mean, verify_scale
from specbench.tune.space import TuneConfig, grid_values
from specbench.zoo import TINY_DIR

from .conftest import propose_one, random_llama
from .test_cli import error_of


def test_accepted_walks_the_path_the_continuation_follows():
    #   root ─ 5 ─ 6 ─ 7        continuation 5 6 9 ...: 5 and 6 accepted, then the target's own 9
    #        └ 8 ─ 9
    tree = Tree([5, 6, 7, 8, 9], [-1, 0, 1, -1, 3])
    assert accepted(tree, [5, 6, 9, 1]) == 3
    assert accepted(tree, [8, 9, 4]) == 3
    assert accepted(tree, [4, 5]) == 1  # no child matches: the target's token alone
    assert accepted(tree, [5, 6, 7]) == 3  # the output ends there: nothing past it is appended
    assert accepted(Tree([], []), [3]) == 1


def test_accepted_equals_what_greedy_verification_appends():
    """Brute force: random trees over a peaked random target, scored against its own greedy continuation, append
    what one verification forward appends."""
    model = random_llama(12, layers=1, seed=3, init=0.3)
    prompt = [1, 4, 7, 2, 9]
    vanilla = decode(CachedLM(model), methods.Proposer(), prompt, max_new_tokens=8, temperature=0, stop_ids=set())
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(1, 9, (), generator=gen))
        parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)]
        tokens = torch.randint(0, 12, (n,), generator=gen).tolist()
        for i, p in enumerate(parents):  # plant the greedy path along one branch now and then
            depth_path = []
            while p >= 0:
                depth_path.append(p)
                p = parents[p]
            if torch.rand((), generator=gen) < 0.5 and len(depth_path) < len(vanilla.tokens):
                tokens[i] = vanilla.tokens[len(depth_path)]
        tree = Tree(tokens, parents)
        target = OneSlot(CachedLM(model))
        target.prefill([0], [prompt])  # caches all but the last token: the root
        step = verify(target, prompt[-1], Proposal(tree), acceptance.EXACT, 0.0, None)
        assert accepted(tree, vanilla.tokens) == len(step.new)


def test_a_shorter_chain_is_the_prefix_of_the_longer_one(tiny_models):
    """sps and pld are nested in their length: the smaller setting proposes the longer one's first tokens."""
    target_dir, draft_dir = tiny_models
    model = load_causal_lm(target_dir, torch.device("cpu"), torch.float32)
    res = methods.Resources("t", model, None, torch.device("cpu"), torch.float32, draft_path=draft_dir)
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]
    for name, key in (("sps", "num_draft_tokens"), ("pld", "num_pred_tokens")):
        nested = registry.IMPLEMENTATIONS[name].nested
        assert nested.keys == (key,)
        big = methods.build_batch(name, res, 1, {key: 6})
        big.start([0], [Turn(prompt, 0.0)])
        proposal = propose_one(big, prompt, 10)
        for small_len in (1, 2, 3):
            small = methods.build_batch(name, res, 1, {key: small_len})
            small.start([0], [Turn(prompt, 0.0)])
            expected = propose_one(small, prompt, 10).tree
            assert nested.subtree(nested.snapshot(big, 0, proposal), {key: small_len}) == expected


def test_recorded_steps_score_the_run_own_accept_lengths(tiny_models):
    """The run's own setting, scored from its records against its output, gives the loop's accept lengths."""
    target_dir, draft_dir = tiny_models
    model = load_causal_lm(target_dir, torch.device("cpu"), torch.float32)
    res = methods.Resources("t", model, None, torch.device("cpu"), torch.float32, draft_path=draft_dir)
    nested = registry.IMPLEMENTATIONS["sps"].nested
    recorder = Recorder(methods.build("sps", res, {"num_draft_tokens": 5}), nested, torch.device("cpu"))
    prompt = [3, 4, 5, 6, 7]
    gen = decode(CachedLM(model), recorder, prompt, max_new_tokens=24, temperature=0, stop_ids=set())
    full = prompt + gen.tokens
    scored = [
        accepted(Proposal(nested.subtree(snap, {"num_draft_tokens": 5})).pruned(depth).tree, full[length:])
        for length, depth, snap in recorder.records
    ]
    assert scored == gen.accept_lengths
    assert len(recorder.propose_times) == len(gen.steps)


def test_variant_names_only_what_differs():
    assert (
        variant("eagle2", {"top_k": 10, "depth": 4, "total_tokens": 24}, {"top_k": 10, "depth": 5, "total_tokens": 60})
        == "eagle2[depth=4,total_tokens=24]"
    )
    assert variant("sps", {"num_draft_tokens": 4}, {"num_draft_tokens": 4}) == "sps"
    named = variant("eagle2", {"draft_dtype": "bfloat16", "tree": "null"}, {"draft_dtype": None, "tree": None})
    assert named == 'eagle2[draft_dtype=bfloat16,tree="null"]'  # a string that would read back as None is quoted
    assert methods.variant(named) == ("eagle2", {"draft_dtype": "bfloat16", "tree": "null"})
    assert methods.variant("eagle2[depth=4,total_tokens=24]") == ("eagle2", {"depth": 4, "total_tokens": 24})
    assert grid_values(["depth=3,4", "sampled=true"]) == {"depth": [3, 4], "sampled": [True]}


def test_tune_sps_end_to_end_then_run_with_the_tuned_variant(capsys, tiny_models, tmp_path):
    target, draft = tiny_models
    file = tmp_path / "tuned.yaml"
    model = ["--model", str(target), "--draft", str(draft), "--limit", "1", "--max-new-tokens", "8", "--device", "cpu"]
    code = main(
        [
            "tune",
            "--method",
            "sps",
            *model,
            "--grid",
            "num_draft_tokens=1,2",
            "--tuned-file",
            str(file),
            "--out",
            str(tmp_path / "tune"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "3 settings" in err  # 1, 2 and the default 4, from one run of the longest
    assert "predicted" in out and "measured" in out and "default" in out
    key = tuned.device_key(torch.device("cpu"))
    entry = tuned.lookup(file, key, Path(target).name, "float32")["sps"]
    assert entry["measured"]["value"] >= entry["default"]["measured"]["value"]  # never slower than the default
    assert entry["calibration"]["tasks"] == ["calibrate"] and entry["evaluation_task"] == "quick"
    assert entry["predicted_eval"] is not None and entry["default"]["predicted_eval"] is not None
    assert entry["predicted_at_measured_tau"] is not None
    scores = json.loads((tmp_path / "tune" / "scores.json").read_text())
    assert sorted(s["variant"] for s in scores) == ["sps", "sps[num_draft_tokens=1]", "sps[num_draft_tokens=2]"]
    assert all(s["predicted_if_drafting_were_free"] > s["predicted"] for s in scores)  # drafting costs time
    assert "if drafting were free" in out

    # a tuned variant that differs from the default runs beside it; the manifest and the report say so
    tuned.save(file, key, Path(target).name, "float32", "sps", {**entry, "variant": "sps[num_draft_tokens=2]"})
    run_dir = tmp_path / "run"
    code = main(
        [
            "run",
            *model,
            "--methods",
            "sps",
            "--tasks",
            "quick",
            "--tuned",
            str(file),
            "--out",
            str(run_dir),
            "--no-noise-floor",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["config"]["methods"] == ["vanilla", "sps", "sps[num_draft_tokens=2]"]
    assert manifest["tuned"]["sps"]["variant"] == "sps[num_draft_tokens=2]"
    report = (run_dir / "report" / "report.md").read_text()
    assert "## Tuned vs default" in report and "sps[num_draft_tokens=2]" in report


def test_tuned_file_from_another_device_is_refused(capsys, tiny_models, tmp_path):
    target, draft = tiny_models
    file = tmp_path / "tuned.yaml"
    tuned.save(file, "NVIDIA H100 80GB HBM3", Path(target).name, "float32", "sps", {"variant": "sps"})
    err = error_of(
        capsys,
        [
            "run",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--tuned",
            str(file),
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert "NVIDIA H100" in err and "not on this device" in err and "specbench tune" in err
    err = error_of(
        capsys, ["run", "--model", str(target), "--tuned", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "run")]
    )
    assert "no tuned presets" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "suffix"], "nothing to tune"),
        (["--method", "sps", "--grid", "gamma=1,2"], "sps: unknown parameter 'gamma'; its parameters are num_draft"),
        (["--method", "sps", "--tasks", "quick"], "another task than the evaluation task"),
        (["--method", "sps", "--grid", "depth"], "--grid takes KEY=V1,V2"),
    ],
)
def test_tune_mistakes_get_one_line(capsys, tiny_models, tmp_path, args, message):
    target, draft = tiny_models
    err = error_of(
        capsys,
        [
            "tune",
            *args,
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--tuned-file",
            str(tmp_path / "t.yaml"),
        ],
    )
    assert message in err


def test_chain_prefix_helper_is_what_sps_registers():
    nested = registry.IMPLEMENTATIONS["sps"].nested
    assert nested.subtree(chain([4, 5, 6]), {"num_draft_tokens": 2}) == chain([4, 5])
    assert nested.subtree(chain([4]), {"num_draft_tokens": 3}) == chain([4])


def test_first_keeps_the_listed_paths_whose_parents_are_kept():
    listed = [[0], [0, 0], [1], [1, 1], [0, 0, 0], [2], [2, 0]]
    assert choices.first(listed, 3) == [[0], [0, 0], [1]]
    assert choices.first(listed, 5) == [[0], [0, 0], [1], [1, 1], [0, 0, 0]]
    assert choices.first(listed, None) == listed
    assert choices.first(listed, 99) == listed
    # an orphan is skipped and does not count: [3, 0]'s parent [3] is not in the tree
    assert choices.first([[0], [3, 0], [1], [0, 1]], 3) == [[0], [1], [0, 1]]
    for bad in (0, -2, 2.5, True, "8"):
        with pytest.raises(SpecbenchError, match="nodes must be a whole number"):
            choices.first(listed, bad)


@pytest.mark.parametrize(
    ("name", "key", "largest", "smaller"),
    [
        ("eagle", "nodes", None, (1, 4, 7, 12, 20)),
        ("medusa", "nodes", None, (1, 4, 9, 16, 30, 48)),
        ("mtp", "num_draft_tokens", 6, (1, 2, 3, 5)),
    ],
)
def test_a_smaller_static_tree_or_mtp_chain_is_nested_in_the_larger(name, key, largest, smaller):
    """At T = 0 the first N paths of a static tree (EAGLE-1, Medusa) propose the whole tree's nodes on those
    paths, and a shorter MTP chain the longer one's first tokens: `specbench tune` scores them from one run."""
    model = load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)
    heads = {h: TINY_DIR / h for h in ("eagle", "medusa", "mtp")}
    res = methods.Resources("tiny", model, None, torch.device("cpu"), torch.float32, head_paths=heads)
    nested = registry.IMPLEMENTATIONS[name].nested
    assert nested.keys == (key,)
    prompt = list(range(3, 70))
    features = CachedLM(model).prefill(prompt, layers=(-1,)).features
    big = methods.build(name, res, {key: largest})
    big.start([0], [Turn(prompt, 0.0, features=features)])
    snapshot = nested.snapshot(big, 0, propose_one(big, prompt, 10))
    for n in smaller:
        small = methods.build(name, res, {key: n})
        small.start([0], [Turn(prompt, 0.0, features=features)])
        expected = propose_one(small, prompt, 10).tree
        assert len(expected) == n
        assert nested.subtree(snapshot, {key: n}) == expected


def test_evaluation_questions_are_predicted_from_calibration_questions_of_their_group():
    """Vanilla took 1 s (0.2 s fixed, 10 tokens) on each evaluation question. Calibration: a translation question
    with tau 2 and a qa one with tau 4, each at 0.1 s a step. An evaluation question of a group no calibration
    question has is predicted with every one in turn."""
    vanilla = Turns(
        questions=[1, 2, 3, 4],
        tokens=[10] * 4,
        fixed=[0.2] * 4,
        wall=[1.0] * 4,
        groups={1: "translation", 2: "qa", 3: "qa", 4: "rag"},
    )
    score = Score(
        {},
        3.0,
        8.0,
        0.0,
        0.0,
        step=0.1,
        by_question={"c1": (2.0, 0.1), "c2": (4.0, 0.1)},
        groups={"c1": "translation", "c2": "qa"},
    )
    on_1, on_2 = 1 / (0.2 + 10 / 2 * 0.1), 1 / (0.2 + 10 / 4 * 0.1)  # 1.43x and 2.22x
    expected = math.exp((1.5 * math.log(on_1) + 2.5 * math.log(on_2)) / 4)  # question 4: the mean of both logs
    assert geometric_mean(vanilla, score) == pytest.approx(expected)
    # with its own tau per question (calibration): question 1 read as c1 would be, were its id c1
    own = Turns(questions=["c1", "c2"], tokens=[10, 10], fixed=[0.2, 0.2], wall=[1.0, 1.0])
    assert geometric_mean(own, score, calibration=True) == pytest.approx(math.sqrt(on_1 * on_2))


def test_calibration_on_a_busy_machine_is_flagged(capsys, tiny_models, tmp_path, monkeypatch):
    class Busy:  # other processes kept every CPU busy
        value = float(os.cpu_count() or 1)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(calibration, "OtherLoad", Busy)
    target, draft = tiny_models
    code = main(
        [
            "tune",
            "--method",
            "sps",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--device",
            "cpu",
            "--grid",
            "num_draft_tokens=1",
            "--no-verify",
            "--tuned-file",
            str(tmp_path / "t.yaml"),
            "--out",
            str(tmp_path / "tune"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert "busy during the calibration run of sps" in err


def test_the_forward_cost_is_linear_in_the_context_between_and_past_the_profiled_ones():
    cost = Cost({64: {1: 0.010, 16: 0.030}, 512: {1: 0.014, 16: 0.050}})
    assert cost(1, 64) == pytest.approx(0.010)
    assert cost(16, 288) == pytest.approx(0.040)  # halfway in context
    assert cost(8.5, 64) == pytest.approx(0.020)  # halfway in rows
    assert cost(16, 960) == pytest.approx(0.070)  # past the longest: the last segment extended
    assert cost(1, 0) == pytest.approx(0.010 - 0.004 * 64 / 448)
    assert Cost({100: {1: 0.01, 4: 0.02}})(4, 5000) == pytest.approx(0.02)  # one context: no slope known


def test_an_evaluation_question_is_costed_at_its_own_context():
    """Calibration: tau 2 at 8 rows a step, 2 ms of drafting a step, verifications 10% slower than profiled. An
    evaluation question (10 tokens, 0.2 s fixed, 1 s for vanilla) after a context of 512 tokens verifies in
    1.1 * T(8, 512) = 44 ms a step."""
    cost = Cost({64: {1: 0.010, 8: 0.020}, 512: {1: 0.014, 8: 0.040}})
    score = Score(
        {},
        2.0,
        8.0,
        0.002,
        0.0,
        step=0.023,
        by_question={"c": (2.0, 0.023)},
        groups={"c": "qa"},
        rows_by_question={"c": 8.0},
        verify_scale=1.1,
        cost=cost,
    )
    vanilla = Turns(questions=[1], tokens=[10], fixed=[0.2], wall=[1.0], groups={1: "qa"}, contexts={1: 512.0})
    assert geometric_mean(vanilla, score) == pytest.approx(1 / (0.2 + 10 / 2 * (0.002 + 1.1 * 0.040)))
    vanilla.contexts.clear()  # context unknown: the calibration question's own step cost
    assert geometric_mean(vanilla, score) == pytest.approx(1 / (0.2 + 10 / 2 * 0.023))


def test_verification_past_the_profile_is_a_ratio():
    """Two 60-row steps verified in 80 and 82 ms where the profile says 74 and 76: 1.08 times the profile, so an
    8-row tree profiled at 27 ms is predicted at 29.16 ms, not 27 + 6 (the difference in seconds)."""
    scale = verify_scale([0.080, 0.082], [0.074, 0.076])
    assert scale == pytest.approx(1.08)
    assert scale * 0.027 == pytest.approx(0.02916)
    assert verify_scale([], []) == 1.0


def test_a_step_moves_to_the_pace_of_the_vanilla_run_it_is_compared_with():
    """The calibration's vanilla ran its one-token steps at 1.1 times the profile, the evaluation's vanilla at
    1.21 times it (the machine 10% slower then): the setting's 2 + 1.1 * 20 = 24 ms step becomes 26.4 ms. Its
    own verification ran at 1.3 times the profile (its drafting evicts the target's weights): that stays in it."""
    cost = Cost({64: {1: 0.010, 8: 0.020}})
    vanilla = Turns(
        questions=[1],
        tokens=[10],
        fixed=[0.2],
        wall=[1.0],
        groups={1: "qa"},
        contexts={1: 64.0},
        step_contexts=[64] * 10,
        verify_seconds=10 * 0.0121,
    )
    vanilla.speed = vanilla.speed_against(cost)
    assert vanilla.speed == pytest.approx(1.21)
    score = Score(
        {},
        2.0,
        8.0,
        0.002,
        0.0,
        by_question={"c": (2.0, 0.024)},
        groups={"c": "qa"},
        rows_by_question={"c": 8.0},
        verify_scale=1.1,
        cost=cost,
        context=64.0,
        pace=1.1,
    )
    assert geometric_mean(vanilla, score) == pytest.approx(1 / (0.2 + 10 / 2 * 0.0264))
    own = replace(score, verify_scale=1.3)  # 2 + 1.3 * 20 = 28 ms at the calibration's pace, 30.8 at the evaluation's
    assert geometric_mean(vanilla, own) == pytest.approx(1 / (0.2 + 10 / 2 * 0.0308))
    assert geometric_mean(vanilla, replace(score, pace=None)) == pytest.approx(1 / (0.2 + 10 / 2 * 0.024))
    assert Turns().speed_against(cost) is None


def test_calibration_answers_each_question_with_vanilla_just_before_the_method():
    """The vanilla that prices a run's steps is answered beside it, question by question, as `specbench run`
    interleaves them; only the method's turns are yielded for scoring."""

    class Question:
        def __init__(self, id):
            self.id, self.group = id, "qa"

    class Gen:
        tokens, steps, wall_time = [7, 8], [], 0.01

    class FakeSession:
        resources, asked = None, []

        def answer(self, label, proposer, question, budget, temperature, seed):
            self.asked.append((label, question.id, budget))
            return [Gen()], [[1, 2, 3]], ["text"]

    tuner = object.__new__(calibration.Tuner)
    tuner.session, tuner.questions, tuner.budget = FakeSession(), [Question(1), Question(2)], 32
    tuner.cfg = TuneConfig("pld", RunConfig(methods=["pld"]))
    vanilla, turns = Turns(), Turns()
    yielded = list(tuner._answer("pld", methods.build("vanilla", None), turns, vanilla))
    assert tuner.session.asked == [
        ("vanilla", 1, 16),
        ("pld", 1, 16),
        ("vanilla", 1, 32),
        ("pld", 1, 32),
        ("vanilla", 2, 32),
        ("pld", 2, 32),
    ]
    assert len(yielded) == 2 and vanilla.questions == turns.questions == [1, 2]


def test_each_timed_propose_follows_a_target_forward(monkeypatch):
    """A decode's propose comes after a verification, which streams the target's weights through the caches: the
    draft-cost timings reproduce that (one-token forward, the cache cropped back to the state) before each."""
    events = []

    class Target:  # (the batch interface's, a batch of one)
        def prefill(self, slots, prompts, layers):
            events.append(("prefill", slots, len(prompts[0]), layers))
            return [None]

        def verify(self, rows):
            events.append(("forward", rows[0].slot, rows[0].tokens))

        def rewind(self, slot, length):
            events.append(("crop", slot, length))

    class Timed(Drafter):
        feature_layers = ()

        def start(self, slot, turn):
            events.append(("start",))

        def propose(self, slots, tokens, max_depths):
            events.append(("propose",))
            return [Proposal(Tree([], []))]

    class FakeSession:
        target, resources, device = Target(), None, torch.device("cpu")

    monkeypatch.setattr(calibration.methods, "build_batch", lambda *a: Timed())
    tuner = object.__new__(calibration.Tuner)
    tuner.session, tuner.budget = FakeSession(), 8
    tuner.cfg = TuneConfig("sps", RunConfig(methods=["sps"]))
    assert tuner.propose_seconds({}, [5, 6, 7]) >= 0
    assert events == [("prefill", [0], 3, None)] + [("start",), ("forward", 0, [7]), ("crop", 0, 2), ("propose",)] * 4


def test_drafting_cost_follows_the_context_it_was_calibrated_at():
    """Calibration steps drafted in 10 ms at context 100 and 14 ms at 300: 0.02 ms more per token of context.
    An evaluation question at context 500 drafts in 12 + 0.02 * (500 - 200) = 18 ms (the steps' mean: 200, 12 ms)."""
    assert draft_slope([100, 300, 100, 300], [0.010, 0.014, 0.010, 0.014]) == pytest.approx(2e-5)
    assert draft_slope([100, 300], [0.014, 0.010]) == 0.0  # never cheaper with more context
    assert draft_slope([100, 100], [0.010, 0.014]) == 0.0  # one context: no slope known
    cost = Cost({64: {1: 0.010, 8: 0.020}})
    score = Score(
        {},
        2.0,
        8.0,
        0.012,
        0.0,
        by_question={"c": (2.0, 0.033)},
        groups={"c": "qa"},
        rows_by_question={"c": 8.0},
        verify_scale=1.05,
        cost=cost,
        context=200.0,
        draft_slope=2e-5,
    )
    vanilla = Turns(questions=[1], tokens=[10], fixed=[0.2], wall=[1.0], groups={1: "qa"}, contexts={1: 500.0})
    assert geometric_mean(vanilla, score) == pytest.approx(1 / (0.2 + 10 / 2 * (0.018 + 1.05 * 0.020)))


def test_a_grid_setting_the_model_cannot_build_is_skipped_but_not_the_default(monkeypatch, capsys):
    """A head without token counts cannot read out a draft vocabulary: tune scores the rest and says why; the
    default's own run must build."""
    monkeypatch.setattr(calibration, "forward_profile", lambda target, context, sizes: {1: 0.01, 96: 0.02})
    monkeypatch.setattr(calibration.Tuner, "_state", lambda self: [1, 2])

    def calibrate(self, plain, settings, cost, state):
        if plain.get("draft_vocab") is not None:
            raise calibration.Unbuildable("eagle2[draft_vocab=0.25]: token_counts.json is missing")
        return [Score({**plain, **settings[0]}, 2.0, 4.0, 0.001, 1.5)]

    monkeypatch.setattr(calibration.Tuner, "calibrate", calibrate)
    tuner = object.__new__(calibration.Tuner)
    tuner.cfg = TuneConfig("eagle2", RunConfig(methods=["eagle2"]), grid={"top_k": [4, 10]})
    tuner.session = type("S", (), {"target": type("T", (), {"context_length": 1024})()})()
    tuner.questions, tuner.budget, tuner.started = [], 8, calibration.time.perf_counter()
    tuner.defaults = dict(methods.preset("eagle2").params)
    scores, cut = tuner.search()
    assert not cut and [s.params["top_k"] for s in scores] == [10, 4]  # the default's run first
    assert capsys.readouterr().err.count("skipped eagle2[draft_vocab=0.25]: token_counts.json is missing") == 2
    no_head = calibration.Unbuildable("no head")
    monkeypatch.setattr(calibration.Tuner, "calibrate", lambda *a: (_ for _ in ()).throw(no_head))
    with pytest.raises(calibration.Unbuildable, match="no head"):
        tuner.search()
