import math

import pandas as pd
import pytest

from specbench.cli.main import main
from specbench.report import cells, metrics, sources
from specbench.report.frames import frame, from_sources, steps_frame, steps_from_sources

from .test_report import SPEC_BENCH_ANSWERS, answer, write


@pytest.fixture
def run_dir(tmp_path):
    """A run folder: vanilla and sps on three questions, one of them two turns long."""
    run = tmp_path / "run-a"
    two_turns = answer(2, "chat", "sps", 0.0, 0.5, [3, 1, 2, 2], tested=[3, 3, 3, 3], tree_size=[4] * 4)
    two_turns.new_tokens, two_turns.wall_time, two_turns.decoding_steps = [4, 4], [0.2, 0.3], [2, 2]
    two_turns.turns = ["first", "second"]
    sps = [answer(q, "chat", "sps", 0.0, 0.5, [3, 1], tested=[3, 3], tree_size=[4, 4]) for q in range(2)]
    vanilla = [answer(q, "chat", "vanilla", 0.0, 1.0, [1] * 4) for q in range(3)]
    write(run / "answers" / "quick" / "sps-temperature-0.jsonl", [*sps, two_turns])
    write(run / "answers" / "quick" / "vanilla-temperature-0.jsonl", vanilla)
    return run


def test_one_row_per_turn_with_the_recorded_fields(run_dir):
    data = frame([run_dir])
    assert len(data) == 3 + 2 + 2  # vanilla 3 turns, sps 2 single-turn questions + one of two turns
    row = data[(data.method == "sps") & (data.question_id == 2) & (data.turn == 1)].iloc[0]
    assert (row.new_tokens, row.wall_time, row.steps, row.tau, row.text) == (4, 0.3, 2, 2.0, "second")
    assert row.tokens_per_s == pytest.approx(4 / 0.3) and row.mean_tree_size == 4.0
    assert row.source == "run-a" and row.task == "quick" and row.model == "tiny"
    steps = steps_frame([run_dir])
    assert len(steps) == 4 * 3 + 2 * 2 + 4
    two = steps[(steps.method == "sps") & (steps.question_id == 2)]
    assert two.turn.tolist() == [0, 0, 1, 1] and two.step.tolist() == [0, 1, 0, 1]
    assert two.accepted.tolist() == [3, 1, 2, 2] and two.tested.tolist() == [3] * 4


def test_answer_level_fields_count_once(tmp_path):
    """Draft and verify time sum to the answer's over its turns; checks and CPU load count once per answer."""
    two = answer(
        1,
        "chat",
        "sps",
        0.0,
        0.5,
        [3, 1, 2, 2],
        draft_time=0.3,
        verify_time=0.6,
        busy_cpus=0.5,
        greedy_check={"match": False, "near_tie": True},
    )
    two.new_tokens, two.wall_time, two.decoding_steps = [4, 4], [0.2, 0.3], [2, 2]
    bare = answer(2, "chat", "sps", 0.0, 0.5, [2])
    source = sources.Source(tmp_path, "run", [two, bare])
    data = from_sources([source])
    assert data.draft_time.tolist()[:2] == [0.3, 0.0] and data.verify_time.sum() == 0.6
    assert math.isnan(data.draft_time.iloc[2])  # not recorded
    assert data.busy_cpus.notna().sum() == 1 and data.greedy_match.notna().sum() == 1
    check = metrics.losslessness(data)
    assert (check.questions, check.near_ties) == (1, 1)
    steps = steps_from_sources([source])
    assert steps.turn.tolist() == [0, 0, 1, 1, 0] and steps.step.tolist() == [0, 1, 0, 1, 0]
    assert steps.group.tolist() == steps.category.tolist() == ["chat"] * 5


def test_the_reports_numbers_come_out_of_the_frame(run_dir, tmp_path):
    (cell,) = cells.collect_cells(sources.load_sources([run_dir]))
    data = frame([run_dir])
    for method, rows in data.groupby("method"):
        assert rows.new_tokens.sum() / rows.steps.sum() == pytest.approx(cell.stats[method].tau)
    per_question = data.groupby(["method", "question_id"]).agg(tokens=("new_tokens", "sum"), wall=("wall_time", "sum"))
    throughput = per_question.tokens / per_question.wall
    ratio = throughput["sps"] / throughput["vanilla"]
    assert math.exp(ratio.map(math.log).mean()) == pytest.approx(cell.stats["sps"].paired[cells.OVERALL].value)


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_export_round_trips(run_dir, tmp_path, capsys, fmt):
    out = tmp_path / f"turns.{fmt}"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert "7 rows (turns)" in capsys.readouterr().out
    back = {"csv": pd.read_csv, "parquet": pd.read_parquet, "jsonl": lambda p: pd.read_json(p, lines=True)}[fmt](out)
    expected = frame([run_dir])
    assert len(back) == len(expected) == 7
    assert back.new_tokens.tolist() == expected.new_tokens.tolist()
    assert back.wall_time.tolist() == pytest.approx(expected.wall_time.tolist())
    assert not list(tmp_path.glob("*.partial"))
    steps = tmp_path / "steps.csv"
    assert main(["export", str(run_dir), "--steps", "--out", str(steps)]) == 0
    assert len(pd.read_csv(steps)) == 20


def test_export_errors_are_one_line(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "--out", str(tmp_path / "turns.xlsx")]) == 2
    assert "name it .csv, .parquet or .jsonl" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "t.csv")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()


def test_spec_bench_files_reproduce_the_reference_figures():
    """The data README's figures from Spec-Bench's own answer files: τ, Spec-Bench's speedup (ratio of mean
    per-question tokens/s) and our paired speedup (geometric mean of per-question ratios)."""
    data = frame([SPEC_BENCH_ANSWERS])
    assert len(data) == 3 * (480 + 80)  # MT-bench's 80 questions have two turns
    per_question = data.groupby(["method", "question_id"])[["new_tokens", "wall_time", "steps"]].sum()
    throughput = per_question.new_tokens / per_question.wall_time
    tau = per_question.groupby("method").new_tokens.sum() / per_question.groupby("method").steps.sum()
    figures = {"sps-68m": (2.50, 1.51, 1.47), "eagle": (3.58, 2.18, 2.12)}
    for method, (expected_tau, spec_bench, paired) in figures.items():
        assert tau[method] == pytest.approx(expected_tau, abs=0.005)
        assert throughput[method].mean() / throughput["vanilla"].mean() == pytest.approx(spec_bench, abs=0.005)
        ratios = throughput[method] / throughput["vanilla"]
        assert math.exp(ratios.map(math.log).mean()) == pytest.approx(paired, abs=0.005)


def test_acceptance_csv_has_speculators_columns_worked_by_hand(run_dir, tmp_path, capsys):
    """sps's 8 steps (accepted 3, 1 | 3, 1 | 3, 1, 2, 2; 3 drafted tokens each, depth 3 examined): 8 drafts, 24
    draft tokens, 2 + 2 + 4 = 8 accepted (the target's own left out), acceptance length 1 + 8/8; position 0 taken
    by the five steps that accepted 2 or more tokens, position 1 by the three that accepted 3, position 2 by none.
    Vanilla drafted nothing: no row."""
    out = tmp_path / "acceptance.csv"
    assert main(["export", str(run_dir), "--format", "acceptance-csv", "--out", str(out)]) == 0
    assert "2 rows (method x subset)" in capsys.readouterr().out
    table = pd.read_csv(out)
    columns = ["subset", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length"]
    assert list(table.columns[-8:]) == [*columns, *(f"acceptance_at_pos_{i}" for i in range(3))]
    assert table.subset.tolist() == ["chat", "all"] and set(table.method) == {"sps"}
    row = table.iloc[0]
    assert (row.num_drafts, row.num_draft_tokens, row.num_accepted_tokens) == (8, 24, 8)
    assert row.acceptance_length == 2.0
    assert [row[f"acceptance_at_pos_{i}"] for i in range(3)] == [5 / 8, 3 / 8, 0.0]
    assert main(["export", str(run_dir), "--steps", "--format", "acceptance-csv", "--out", str(out)]) == 2
    assert "leave out --steps" in capsys.readouterr().err


def test_acceptance_csv_refuses_answers_without_drafts(tmp_path, capsys):
    run = tmp_path / "run"
    write(run / "answers" / "quick" / "vanilla-temperature-0.jsonl", [answer(0, "chat", "vanilla", 0.0, 1.0, [1])])
    out = tmp_path / "acceptance.csv"
    assert main(["export", str(run), "--format", "acceptance-csv", "--out", str(out)]) == 2
    assert "no drafts recorded" in capsys.readouterr().err and not out.exists()
