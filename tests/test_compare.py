"""`specbench compare` on synthetic run folders with controlled timing noise (seeded, so deterministic)."""

from __future__ import annotations

import json
import re
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest

from specbench.cli.main import main
from specbench.errors import SpecbenchError
from specbench.report import metrics
from specbench.report.cells import collect_cells, select
from specbench.report.compare import Limits, compare
from specbench.report.sources import load_sources
from specbench.results import Answer

GROUPS = ("chat", "math")
STEPS = {"vanilla": [1] * 64, "sps": [4] * 16, "pld": [2] * 32}  # 64 new tokens per question
SECONDS = {"vanilla": 1.0, "sps": 0.5, "pld": 0.7}
MATCH = {"match": True, "turn": None, "position": None, "margin": None, "near_tie": False}
BUG = {"match": False, "turn": 0, "position": 5, "margin": 3.0, "near_tie": False}
TIE = {"match": False, "turn": 0, "position": 5, "margin": 1e-4, "near_tie": True}


def make_run(
    path: Path,
    *,
    seed: int,
    slowdown: dict[str, float] | None = None,
    noise: float = 0.01,
    per_group: int = 20,
    device: str = "Fake GPU 9000",
    dtype: str = "float16",
    methods: tuple[str, ...] = ("vanilla", "sps", "pld"),
    steps: dict[str, list[int]] | None = None,
    checks: dict[str, list[dict]] | None = None,
    synthetic: list[float] | None = None,
) -> Path:
    """A run folder: each question's wall time is a fixed per-question base (same in every run) times the
    method's factor, times 1 + the method's slowdown, times lognormal noise drawn with this run's seed. `synthetic`:
    its answers are cost-only, their verdicts forced at those rates."""
    questions = [(q, GROUPS[q % 2]) for q in range(2 * per_group)]
    base = np.random.default_rng(1234).uniform(0.5, 2.0, size=len(questions))
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(
        json.dumps(
            {
                "config": {"model": "tiny", "dtype": dtype, "device": "cuda", "methods": list(methods)},
                "machine": {
                    "device": "cuda",
                    "device_name": device,
                    "cpu_count": 16,
                    "torch": "2.13.0",
                    "transformers": "5.0.0",
                    "git_revision": f"rev{seed}",
                },
            }
        )
    )
    for method in methods:
        accept = (steps or {}).get(method, STEPS[method])
        lines = []
        for (q, group), t in zip(questions, base, strict=True):
            wall = t * SECONDS[method] * (1 + (slowdown or {}).get(method, 0.0)) * rng.lognormal(0.0, noise)
            check = None if method == "vanilla" else (checks or {}).get(method, [MATCH] * len(questions))[q]
            answer = Answer(
                question_id=q,
                category=group,
                group=group,
                method=method,
                temperature=0.0,
                model="tiny",
                task="quick",
                new_tokens=[sum(accept)],
                wall_time=[float(wall)],
                decoding_steps=[len(accept)],
                accept_lengths=accept,
                turns=["text"],
                seed=q,
                greedy_check=None if synthetic else check,
                synthetic=synthetic,
            )
            lines.append(json.dumps(answer.to_record("tiny")) + "\n")
        out = path / "answers" / "quick" / f"{method}-temperature-0.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(lines))
    return path


def all_slower(factor: float) -> dict[str, float]:
    return dict.fromkeys(SECONDS, factor)


def row(result, method: str, category: str = "overall"):
    return next(r for r in result.rows if (r.method, r.category) == (method, category))


@pytest.fixture
def baseline(tmp_path) -> Path:
    return make_run(tmp_path / "baseline", seed=1)


def test_one_percent_slowdown_is_within_limits(baseline, tmp_path):
    result = compare(baseline, make_run(tmp_path / "new", seed=2, slowdown=all_slower(0.01)))
    assert result.passed, result.failures
    vanilla = row(result, "vanilla")
    assert vanilla.throughput.value == pytest.approx(1 / 1.01, abs=0.005) and vanilla.throughput.pairs == 40
    assert row(result, "sps").speedup_change.value == pytest.approx(1.0, abs=0.01)
    order = [(r.method, r.category) for r in result.rows]
    assert order[:4] == [("vanilla", "chat"), ("vanilla", "math"), ("vanilla", "overall"), ("pld", "chat")]


def test_ten_percent_slowdown_fails_beyond_noise(baseline, tmp_path):
    result = compare(baseline, make_run(tmp_path / "new", seed=2, slowdown=all_slower(0.10)))
    assert not result.passed
    vanilla = row(result, "vanilla")
    assert vanilla.throughput.value == pytest.approx(1 / 1.10, abs=0.005) and vanilla.throughput.high < 1
    assert any(f.startswith("tiny · quick · T=0 · vanilla · overall: tokens/s -9.") for f in result.failures)
    # every method slowed alike, as on a slower machine: the run-internal speedups did not move
    assert not any("speedup over vanilla" in f for f in result.failures)
    assert compare(baseline, tmp_path / "new", Limits(speedup_only=True)).passed
    assert compare(baseline, tmp_path / "new", Limits(max_slowdown=0.15)).passed


def test_one_method_slower_fails_its_speedup_too(baseline, tmp_path):
    result = compare(baseline, make_run(tmp_path / "new", seed=2, slowdown={"sps": 0.10}))
    failing = {r.method for r in result.rows if r.failures}
    assert failing == {"sps"}
    assert any("sps · overall: speedup over vanilla -9." in f for f in result.failures)
    assert not compare(baseline, tmp_path / "new", Limits(speedup_only=True)).passed


def test_drop_beyond_the_limit_but_within_noise_passes(tmp_path):
    noisy = {"noise": 0.25, "per_group": 10}  # timing noise far above the limit, no real change
    base = make_run(tmp_path / "baseline", seed=1, **noisy)
    result = compare(base, make_run(tmp_path / "new", seed=4, **noisy))
    vanilla = row(result, "vanilla", "math")
    assert vanilla.throughput.value < 0.95 < 1 < vanilla.throughput.high
    assert result.passed, result.failures


def test_too_few_questions_are_not_judged_on_speed(tmp_path):
    base = make_run(tmp_path / "baseline", seed=1, per_group=2)
    result = compare(base, make_run(tmp_path / "new", seed=2, slowdown=all_slower(0.10), per_group=2))
    vanilla = row(result, "vanilla")
    assert vanilla.throughput.pairs == 4 and vanilla.throughput.high < 0.95 and not vanilla.speed_judged
    assert result.passed  # four pairs: an interval from so few says nothing about noise
    assert not compare(base, tmp_path / "new", Limits(min_tau_ratio=1.01)).passed  # tau and losslessness still count


def test_losslessness_regression_fails(baseline, tmp_path):
    checks = [MATCH] * 40
    checks[3] = BUG
    result = compare(baseline, make_run(tmp_path / "new", seed=2, checks={"sps": checks}))
    assert result.failures == ["tiny · quick · T=0 · sps · overall: real greedy mismatches with vanilla 0 → 1"]
    assert row(result, "sps").bugs == (0, 1) and row(result, "sps", "chat").bugs is None
    checks[3] = TIE  # a near-tie divergence is numerics, not a bug
    assert compare(baseline, make_run(tmp_path / "ties", seed=2, checks={"sps": checks})).passed


def test_tau_drop_fails(baseline, tmp_path):
    result = compare(baseline, make_run(tmp_path / "worse", seed=2, steps={"sps": [4] * 14 + [1] * 8}))
    assert row(result, "sps").tau_ratio == pytest.approx(64 / 22 / 4)
    assert any("sps · overall: τ 4.00 → 2.91" in f for f in result.failures)
    assert compare(baseline, tmp_path / "worse", Limits(min_tau_ratio=0, speedup_only=True)).passed


def test_different_machines_are_refused_unless_allowed(baseline, tmp_path):
    other = make_run(tmp_path / "new", seed=2, device="Other GPU", dtype="bfloat16")
    with pytest.raises(SpecbenchError) as err:
        compare(baseline, other)
    assert "dtype float16 → bfloat16" in str(err.value) and "device_name Fake GPU 9000 → Other GPU" in str(err.value)
    assert "--allow-different-machines" in str(err.value)
    result = compare(baseline, other, allow_different_machines=True)
    assert result.machine_differences == ["dtype float16 → bfloat16", "device_name Fake GPU 9000 → Other GPU"]
    assert result.software_differences == ["git_revision rev1 → rev2"]


def test_missing_manifest_is_an_unknown_machine(baseline, tmp_path):
    other = make_run(tmp_path / "new", seed=2)
    (other / "manifest.json").unlink()
    with pytest.raises(SpecbenchError, match="new has no manifest.json"):
        compare(baseline, other)


def test_cells_in_one_run_only_are_listed_not_failed(baseline, tmp_path):
    new = make_run(tmp_path / "new", seed=2, methods=("vanilla", "sps"), per_group=19)
    result = compare(baseline, new)
    assert result.passed
    assert result.only_in_baseline == [
        "tiny · quick · T=0 · vanilla: 2 question(s)",
        "tiny · quick · T=0 · pld",
        "tiny · quick · T=0 · sps: 2 question(s)",
    ]
    assert row(result, "sps").throughput.pairs == 38
    assert not compare(baseline, new, Limits(strict=True)).passed


def test_nothing_shared_is_an_error(baseline, tmp_path):
    new = make_run(tmp_path / "new", seed=2, methods=("vanilla",))
    (new / "answers" / "quick").rename(new / "answers" / "other")
    for f in (new / "answers" / "other").glob("*.jsonl"):
        f.write_text(f.read_text().replace('"task": "quick"', '"task": "other"'))
    with pytest.raises(SpecbenchError, match="nothing to compare"):
        compare(baseline, new)


def error_line(capsys, argv: list[str]) -> str:
    """The one line `main(argv)` ends with, exit status 2."""
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_synthetic_runs_compare_only_with_the_same_profile(baseline, tmp_path, capsys):
    """A cost-only run is refused beside a real one, either way round, and beside another profile; two of the same
    profile compare (a cost-regression check on random weights)."""
    cost = make_run(tmp_path / "cost", seed=2, synthetic=[0.8, 0.5])
    same = make_run(tmp_path / "same", seed=3, synthetic=[0.8, 0.5], slowdown=all_slower(0.3))
    other = make_run(tmp_path / "other", seed=4, synthetic=[0.6])
    for old, new, says in [
        (baseline, cost, "real acceptance and the new run with cost-only, synthetic acceptance 0.8,0.5"),
        (cost, baseline, "cost-only, synthetic acceptance 0.8,0.5 and the new run with real acceptance"),
        (cost, other, "synthetic acceptance 0.8,0.5 and the new run with cost-only, synthetic acceptance 0.6"),
    ]:
        assert says in error_line(capsys, ["compare", str(old), str(new)])
    result = compare(cost, same)
    assert not result.passed and row(result, "sps").throughput.value == pytest.approx(1 / 1.3, rel=0.05)


def test_cli_exit_codes_table_and_json(baseline, tmp_path, capsys):
    new = make_run(tmp_path / "new", seed=2, slowdown=all_slower(0.10))
    assert main(["compare", str(baseline), str(new), "--max-slowdown", "5%"]) == 1
    out = capsys.readouterr().out
    assert "## Verdict: FAIL" in out and re.search(r"\| vanilla +\| overall +\| +40 \|", out) and "▼" in out
    assert main(["compare", str(baseline), str(new), "--max-slowdown", "0.15", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True and data["failures"] == [] and data["limits"]["max_slowdown"] == 0.15
    vanilla = next(r for r in data["rows"] if (r["method"], r["category"]) == ("vanilla", "overall"))
    assert vanilla["throughput"]["high"] < 1 and vanilla["speedup"] is None and vanilla["bugs"] is None


def test_cli_errors_are_one_line(baseline, tmp_path, capsys):
    other = make_run(tmp_path / "new", seed=2, device="Other GPU")
    assert main(["compare", str(baseline), str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specbench: error:") and "Other GPU" in err and len(err.splitlines()) == 1
    assert main(["compare", str(baseline), str(other), "--allow-different-machines"]) == 0
    assert "Machines differ" in capsys.readouterr().out
    assert main(["compare", str(baseline), str(tmp_path / "nowhere")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", str(baseline), str(other), "--max-slowdown", "5"])
    assert "percentage (5%)" in capsys.readouterr().err


def test_compare_loads_without_matplotlib():
    """A CI runner that only compares runs needs no plotting stack: compare reads cells and tables, not plots."""
    import subprocess
    import sys

    code = "import sys, specbench.report.compare; sys.exit(any(m.startswith('matplotlib') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_category_rows_pool_the_spread_over_the_categories(tmp_path):
    """Two questions a category: each category's interval takes the spread pooled over both (metrics.pooled_speedups),
    the overall row its own questions'; no A/A column, so no floor."""
    base = make_run(tmp_path / "baseline", seed=1, per_group=2)
    result = compare(base, make_run(tmp_path / "new", seed=2, per_group=2))
    b, n = (collect_cells(load_sources([p]))[0].by_method["sps"][0] for p in (base, tmp_path / "new"))
    ratios = {g: metrics.paired_ratios(select(n, g), select(b, g)).to_numpy() for g in GROUPS}
    expected = metrics.pooled_speedups(ratios) | {"overall": metrics.paired_speedup(n, b)}
    for category, speedup in expected.items():
        got = row(result, "sps", category).throughput
        assert astuple(got) == pytest.approx(astuple(speedup))
    assert astuple(expected["chat"]) != pytest.approx(astuple(metrics.geometric_mean(ratios["chat"])))
