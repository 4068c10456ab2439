"""DSpark's hardware-aware prefix scheduler (`core.schedule`, Algorithm 1 of arXiv 2607.05147 on this loop's padded
forward): hand-worked batches, its causality (a row's verification never depends on the rows after it), and
`dspark[verify=adaptive]` greedy-identical, exact when sampled, and its drafted tokens recorded beside those
verified."""

import random
from functools import partial

import pytest
import torch

from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.core.proposer import Turn
from specbench.core.schedule import capacity, prefix_lengths, step_cost, top_lengths
from specbench.methods.dspark import DSpark
from specbench.methods.vanilla import Vanilla

from . import conftest
from .test_dspark import PROMPTS, random_draft, target  # noqa: F401  (the fixture)

SURVIVAL = [[0.9, 0.6, 0.3], [0.8, 0.2]]


def test_step_cost_is_the_smallest_profiled_size_holding_the_rows():
    costs = {1: 1.0, 2: 1.2, 4: 2.0}
    assert [step_cost(costs, n) for n in (1, 2, 3, 4, 9)] == [1.0, 1.2, 2.0, 2.0, 2.0]


def test_hand_worked_batches():
    """Two slots. Flat costs up to 2 rows: rows (0, 1) and (1, 1) raise the expected rate from 2 to 2.9 and 3.7 for
    free; slot 0's second row (0.6) needs 3 rows a slot, costing 1.5: 4.3 / 1.5 = 2.87 < 3.7, and the search stops
    there. With 3-4 rows at 1.1 instead, every row pays: 4.3 / 1.1, 4.6 / 1.1, 4.8 / 1.1 each beat the last."""
    assert prefix_lengths(SURVIVAL, {1: 1.0, 2: 1.0, 4: 1.5, 8: 3.0}) == [1, 1]
    assert prefix_lengths(SURVIVAL, {1: 1.0, 2: 1.0, 4: 1.1, 8: 3.0}) == [3, 2]
    assert prefix_lengths(SURVIVAL, {1: 1.0, 2: 2.5}) == [0, 0]  # a second row a slot never pays
    assert prefix_lengths([[0.5, 0.5, 0.5]], dict.fromkeys((1, 2, 4), 1.0)) == [3]  # ties: in row order


def random_survival(rng: random.Random) -> list[list[float]]:
    """One to four slots of one to seven rows, each row's survival its predecessor's times a chance in [0.3, 1]."""
    survival = []
    for _ in range(rng.randint(1, 4)):
        row, a = [], 1.0
        for _ in range(rng.randint(1, 7)):
            a *= rng.uniform(0.3, 1.0)
            row.append(a)
        survival.append(row)
    return survival


def check_causal(seed: int, rule) -> None:
    """300 random batches: lowering any slot's survivals past row j (they stay non-increasing) never changes whether
    row j is verified, by the schedule `rule(survival, rng)` gives for the batch (the paper's lossless condition)."""
    rng = random.Random(seed)
    for _ in range(300):
        survival = random_survival(rng)
        schedule = rule(survival, rng)
        lengths = schedule(survival)
        r = rng.randrange(len(survival))
        j = rng.randrange(len(survival[r]))
        changed = [list(row) for row in survival]
        for i in range(j + 1, len(changed[r])):
            changed[r][i] = changed[r][i - 1] * rng.uniform(0.0, 1.0)
        assert (schedule(changed)[r] > j) == (lengths[r] > j)


def test_a_rows_verification_never_depends_on_the_rows_after_it():
    """Algorithm 1: its early stop's causality."""
    costs = {1: 1.0, 2: 1.05, 4: 1.3, 8: 1.9, 16: 3.5}
    check_causal(0, lambda survival, rng: lambda s: prefix_lengths(s, costs))


def test_the_asynchronous_capacity_searches_every_count():
    """One slot, a step cost that jumps at 3 rows: the second draft (2.8 / 1.6 = 1.75) loses to the first alone
    (1.9 / 1.0), where Algorithm 1 stops; the third (3.7 / 1.6 = 2.31) wins, which only the search over every count
    finds. Two slots, the costs of `test_hand_worked_batches`: the best count is 2 (3.7), the last 4.8 / 1.5."""
    jagged = {1: 1.0, 2: 1.0, 4: 1.6}
    assert prefix_lengths([[0.9, 0.9, 0.9]], jagged) == [1]
    assert capacity([[0.9, 0.9, 0.9]], jagged) == 3
    assert capacity(SURVIVAL, {1: 1.0, 2: 1.0, 4: 1.5, 8: 3.0}) == 2
    assert capacity(SURVIVAL, {1: 1.0, 2: 2.5}) == 0


def test_a_capacity_takes_the_rows_in_admission_order():
    """Admission order (0.9, slot 0), (0.8, slot 1), (0.6, slot 0), (0.3, slot 0), (0.2, slot 1)."""
    assert [top_lengths(SURVIVAL, n) for n in range(6)] == [[0, 0], [1, 0], [1, 1], [2, 1], [3, 1], [3, 2]]
    assert top_lengths(SURVIVAL, 99) == [3, 2]


def test_a_capacitys_rows_never_depend_on_the_rows_after_them():
    """Random capacities: whether row j is among the admitted."""
    check_causal(1, lambda survival, rng: partial(top_lengths, count=rng.randint(0, sum(map(len, survival)))))


def test_the_asynchronous_schedule_takes_its_capacity_from_two_steps_before(target):  # noqa: F811
    """Its first two steps are Algorithm 1's; the third admits as many rows as the first step's survivals make
    best; a batch's start begins the history anew."""
    jagged = {1: 1.0, 2: 1.0, 4: 1.6}
    made = DSpark(random_draft(target), 3, verify="async", costs=jagged)
    steps = [[[0.9, 0.9, 0.9]], [[0.5, 0.1, 0.05]], [[0.95, 0.9, 0.8]], [[0.9, 0.2, 0.1]]]
    assert [made._scheduled(s) for s in steps] == [[1], [1], [3], [1]]  # (capacities of steps 1 and 2: 3 and 1)
    made.start([0], [Turn([1, 2, 3], 0.0)])
    assert made._scheduled(steps[2]) == prefix_lengths(steps[2], jagged)


COSTS = {1: 1.0, 2: 1.0, 4: 1.02, 8: 1.04, 16: 1.08}  # nearly flat: deep rows still pay, cut where confidence drops


@pytest.mark.parametrize("verify", ["adaptive", "async"])
def test_scheduled_dspark_is_vanillas_greedy_and_records_what_it_cut(target, verify):  # noqa: F811
    draft = random_draft(target, kind="vanilla", std=0.6)
    with torch.no_grad():
        draft.confidence_head.proj.bias.fill_(-1.0)  # predicted acceptance well below 1: the schedule cuts
    for prompt in PROMPTS:
        reference = decode(CachedLM(target), Vanilla(), prompt, max_new_tokens=24, temperature=0, stop_ids=set())
        made = DSpark(draft, 4, verify=verify, costs=COSTS)
        ours = decode(CachedLM(target), made, prompt, max_new_tokens=24, temperature=0, stop_ids=set())
        assert ours.tokens == reference.tokens
        assert all(s.tree_size - 1 <= s.drafted <= 4 for s in ours.steps) and ours.steps[0].drafted == 4
        assert any(s.tree_size - 1 < s.drafted for s in ours.steps)


class ClaimsUniform(conftest.ClaimsUniform, DSpark):
    pass


FLAT = {1: 1.0, 2: 1.0, 4: 1.1}  # the second row free, the third 10%: in this test about 1 step in 8 is cut


def test_adaptive_dspark_passes_the_sampling_audit_with_four_slots_scheduled_together():
    """Four slots' rows chosen together (a slot's verified rows depend on its batch-mates' confidences): still the
    target's law, by Algorithm 1 and by the asynchronous capacity; rows claimed uniform fail."""
    from .test_dspark import small_sampling_test

    for verify in ("adaptive", "async"):

        def scheduled(draft, k, slots=1, verify=verify):
            return DSpark(draft, k, verify=verify, costs=FLAT, slots=slots)

        assert small_sampling_test(scheduled, 600, batch=4).passed, verify
    assert not small_sampling_test(
        lambda d, k, slots=1: ClaimsUniform(d, k, verify="adaptive", costs=FLAT, slots=slots),
        400,  # (p ~ 1e-36 at 400)
        batch=4,
    ).passed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"verify": "some"}, "verify is all, adaptive or async"),
        ({"verify": "async"}, "needs the target's profiled step costs"),
        ({"verify": "async", "costs": COSTS, "record": True}, "records the confidences of every row"),
        ({"verify": "adaptive"}, "needs the target's profiled step costs"),
        ({"verify": "adaptive", "costs": COSTS, "confidence_threshold": 0.5}, "drop confidence_threshold"),
    ],
)
def test_bad_schedules_are_refused(target, options, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        DSpark(random_draft(target), 4, **options)


def test_a_run_records_the_schedule_and_the_report_shows_what_it_cut(tmp_path, capsys, monkeypatch):
    """The tiny DSpark drafter with `verify=adaptive` through `specbench run`, the run's target's step costs steep
    (a made-up profile: measured ones vary run to run): greedy-identical, each answer's drafted tokens recorded,
    and the report's schedule table."""
    import json

    from specbench.cli.main import main
    from specbench.run import session

    steep = {n: 1.0 + 0.2 * n for n in (1, 2, 4, 8, 16, 32, 64)}
    monkeypatch.setattr(session, "forward_profile", lambda model, repeats: steep)

    out, questions = tmp_path / "run", tmp_path / "two.jsonl"
    questions.write_text('{"id": 1, "prompt": "Name three colours."}\n{"id": 2, "prompt": "Count to five."}\n')
    argv = ["run", "--methods", "dspark[verify=adaptive]", "--tasks", str(questions), "--max-new-tokens", "16"]
    argv += ["--no-warmup"]
    assert main([*argv, "--no-noise-floor", "--no-report", "--device", "cpu", "--out", str(out)]) == 0
    lines = [json.loads(line) for path in (out / "answers").rglob("dspark*.jsonl") for line in path.open()]
    assert lines and all(line["specbench"]["greedy_check"]["match"] for line in lines)
    recorded = [line["specbench"] for line in lines if line["specbench"]["drafted"] is not None]
    assert recorded and all(
        len(r["drafted"]) == len(r["tree_size"])
        and all(d >= t - 1 for d, t in zip(r["drafted"], r["tree_size"], strict=True))
        for r in recorded
    )
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    section = report.split("## Verification schedules")[1].split("\n## ")[0]
    assert "| dspark[verify=adaptive] |" in section and "drafted, not verified" in section
