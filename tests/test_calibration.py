"""Sequential Temperature Scaling (`core.calibration`): the ECE on a hand-worked case and against a loop over the
bins, STS recovering the temperatures planted in simulated confidences, and `specbench calibrate` writing a drafter
folder whose temperatures DSpark's schedule weighs."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from specbench.core.calibration import GRID, ece, sts, survival
from specbench.core.schedule import prefix_lengths

from .test_dspark import PROMPTS, random_draft, target  # noqa: F401  (the fixture)


def test_ece_hand_worked():
    """Bins of width 0.1: two samples at 0.15 (one accepted: gap 0.35, weight 1/2), one at 0.85 and one at 0.95,
    both accepted (gaps 0.15 and 0.05, weights 1/4): 0.175 + 0.0375 + 0.0125."""
    predicted = torch.tensor([0.15, 0.15, 0.85, 0.95])
    assert ece(predicted, torch.tensor([0.0, 1.0, 1.0, 1.0])) == pytest.approx(0.225)
    assert ece(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])) == 0.0  # (1.0 in the last bin)
    assert ece(torch.empty(0), torch.empty(0)) == 0.0


def test_ece_is_the_weighted_gap_of_each_bin():
    rng = random.Random(0)
    for _ in range(20):
        n, bins = rng.randint(1, 50), rng.choice([5, 10, 15])
        p = [rng.random() for _ in range(n)]
        y = [float(rng.random() < 0.5) for _ in range(n)]
        total = 0.0
        for b in range(bins):
            members = [i for i in range(n) if min(int(p[i] * bins), bins - 1) == b]
            if members:
                gap = sum(p[i] for i in members) / len(members) - sum(y[i] for i in members) / len(members)
                total += len(members) / n * abs(gap)
        assert ece(torch.tensor(p), torch.tensor(y), bins) == pytest.approx(total, abs=1e-6)


def simulated(planted: list[float], steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps whose row j is accepted, given the rows before it were, with chance sigmoid(z_j / planted[j]): the
    head's logits z, the accepted drafts, and the rows drafted (1 to all, so later rows have fewer samples)."""
    generator = torch.Generator().manual_seed(seed)
    k = len(planted)
    logits = torch.randn(steps, k, generator=generator) * 2
    chance = torch.sigmoid(logits / torch.tensor(planted))
    accepted_each = torch.rand(steps, k, generator=generator) < chance
    accepted = accepted_each.long().cumprod(1).sum(1)
    drafted = torch.randint(1, k + 1, (steps,), generator=generator)
    return logits, torch.minimum(accepted, drafted), drafted


def test_sts_finds_the_planted_temperatures_and_lowers_the_error():
    planted = [2.0, 0.5, 1.0]
    logits, accepted, drafted = simulated(planted, 40_000)
    found = sts(logits, accepted, drafted)
    # (the ECE of a running product is a flat objective: later rows are found to within about 25%)
    assert [abs(math.log(t / p)) < 0.25 for t, p in zip(found.temperatures, planted, strict=True)] == [True] * 3
    assert found.ece_after[0] < found.ece_before[0] / 10 and found.ece_after[1] < found.ece_before[1]
    assert max(found.ece_after) < 0.01
    assert found.samples[0] == 40_000 and found.samples[0] > found.samples[1] > found.samples[2]


def test_sts_picks_the_grid_temperature_with_the_least_error_row_by_row():
    """Brute force over the grid on a small sample: each row's temperature minimises the ECE of the survival
    through it, the earlier rows' temperatures held at those found."""
    logits, accepted, drafted = simulated([1.5, 0.7], 300, seed=1)
    found = sts(logits, accepted, drafted)
    for j in range(2):
        seen = drafted > j
        outcome = (accepted[seen] > j).double()

        def error(t: float, j: int = j, seen: torch.Tensor = seen, outcome: torch.Tensor = outcome) -> float:
            return ece(survival(logits.double(), [*found.temperatures[:j], t])[seen, j], outcome)

        best = min(error(t) for t in GRID)
        assert error(found.temperatures[j]) == pytest.approx(best, abs=1e-12)


def test_ties_go_to_one_and_undrafted_rows_keep_one():
    """Confidences of 0.5 stay 0.5 at every temperature: 1 is kept; a row no step drafted keeps 1."""
    found = sts(torch.zeros(10, 2), torch.tensor([0, 1] * 5), torch.ones(10, dtype=torch.long))
    assert found.temperatures == [1.0, 1.0] and found.samples == [10, 0]


def test_survival_scales_each_row_and_keeps_the_order():
    logits = torch.tensor([[2.0, -1.0, 0.5], [1.0, 3.0, -2.0]])
    scaled = survival(logits, [2.0, 0.5])  # (the third row takes the last temperature)
    expected = torch.sigmoid(logits / torch.tensor([2.0, 0.5, 0.5])).cumprod(1)
    assert torch.allclose(scaled, expected)
    assert torch.equal(survival(logits), torch.sigmoid(logits).cumprod(1))
    assert torch.equal(logits[:, 0].argsort(), scaled[:, 0].argsort())


def test_calibrate_writes_a_drafter_whose_schedule_weighs_the_temperatures(tmp_path, capsys):
    """`specbench calibrate` on two held-out questions: a folder with the temperatures (one per row) and the
    weights linked, which loads with them; DSpark's schedule weighs the calibrated confidences unless told not to,
    and the threshold reads them raw."""
    from specbench.cli.main import main
    from specbench.heads import dspark as heads
    from specbench.methods.dspark import DSpark
    from specbench.models import aliases, loading

    out = tmp_path / "calibrated"
    argv = ["calibrate", "--limit", "1", "--max-new-tokens", "24", "--device", "cpu", "--out", str(out)]
    assert main([*argv, "--tasks", "quick"]) == 0
    raw = json.loads((out / "config.json").read_text())
    temperatures = raw["confidence_temperatures"]
    assert len(temperatures) == 7 and all(t in GRID for t in temperatures)
    assert raw["confidence_calibration"]["steps"] > 0 and (out / "model.safetensors").is_symlink()
    assert "| 7 |" in capsys.readouterr().out
    assert main([*argv, "--tasks", "quick"]) == 2  # (a second time: the folder is not empty)
    there, back = tmp_path / "speculators", tmp_path / "official"  # (kept both ways by `specbench convert`)
    assert main(["convert", str(out), "--to", "speculators", "--out", str(there)]) == 0
    assert main(["convert", str(there), "--to", "official", "--out", str(back)]) == 0
    for folder in (there, back):
        assert json.loads((folder / "config.json").read_text())["confidence_temperatures"] == temperatures

    tiny = loading.load_causal_lm(aliases.resolve("tiny").target.id, torch.device("cpu"), torch.float32, "target")
    draft = heads.load(out, tiny)
    assert draft.temperatures == temperatures
    hidden, prev = torch.randn(3, 7, draft.config.hidden_size), torch.randint(0, 100, (3, 7))
    logits = draft.confidence_logits(hidden, prev)
    assert torch.allclose(draft.confidence(hidden, prev, True), torch.sigmoid(logits / torch.tensor(temperatures)))
    assert torch.equal(draft.confidence(hidden, prev), torch.sigmoid(logits))
    costs = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2}
    for calibrated in (True, False):  # the schedule's survivals: the calibrated confidences', or the raw ones'
        made = DSpark(draft, 7, verify="adaptive", costs=costs, calibrated=calibrated)
        weighed = draft.confidence(hidden, prev, calibrated).cumprod(1).tolist()
        assert made._verified([7, 7, 7], hidden, list(prev.unbind(1))) == prefix_lengths(weighed, costs)
    made = DSpark(draft, 7, confidence_threshold=0.5)  # (the threshold: raw)
    assert (
        made._verified([7, 7, 7], hidden, list(prev.unbind(1)))
        == (torch.sigmoid(logits) >= 0.5).long().cumprod(1).sum(1).tolist()
    )


def test_calibrate_refuses_other_methods_and_bad_temperatures(tmp_path):
    from specbench.cli.main import main

    for method in ("dflash", "dspark[verify=adaptive]", "dspark[tree=8]"):  # (before the target loads)
        assert main(["calibrate", "--method", method, "--device", "cpu", "--out", str(tmp_path / "a")]) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    config = {"confidence_temperatures": [1.0, -2.0]}
    from specbench.errors import SpecbenchError
    from specbench.heads import dspark as heads
    from specbench.models import aliases

    raw = json.loads((Path(aliases.resolve("tiny").heads["dspark"].id) / "config.json").read_text())
    with pytest.raises(SpecbenchError, match="confidence_temperatures must be a list of positive numbers"):
        heads.build({**raw, **config})


def test_recording_keeps_each_steps_confidences_and_accepted_drafts(target):  # noqa: F811
    """`record`: a step per drafting step, its rows' confidence logits (the head's, one per row drafted) and the
    drafts it kept; every row verified; the tokens vanilla's."""
    from specbench.core.cached_lm import CachedLM
    from specbench.core.decode import decode
    from specbench.methods.dspark import DSpark
    from specbench.methods.vanilla import Vanilla

    draft = random_draft(target, kind="vanilla", std=0.6)
    made = DSpark(draft, 4, record=True)
    ours = decode(CachedLM(target), made, PROMPTS[0], max_new_tokens=24, temperature=0, stop_ids=set())
    reference = decode(CachedLM(target), Vanilla(), PROMPTS[0], max_new_tokens=24, temperature=0, stop_ids=set())
    assert ours.tokens == reference.tokens
    drafting = [s for s in ours.steps if s.tree_size > 1]
    assert made.recorded is not None and len(made.recorded) == len(drafting) > 0
    for (logits, accepted), step in zip(made.recorded, drafting, strict=True):
        assert len(logits) == step.tree_size - 1 == step.drafted
        assert accepted == step.accept_length - 1 or step is ours.steps[-1]  # (the last may stop at the budget)
