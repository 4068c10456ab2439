"""Reports: numbers checked against hand computations from the raw answer files, plus a synthetic run folder."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from specbench import presets
from specbench.errors import SpecbenchError
from specbench.report import build as report
from specbench.report import metrics, plots, sources
from specbench.report.cells import collect_cells
from specbench.results import Answer

SPEC_BENCH_ANSWERS = Path(__file__).parent / "data" / "spec_bench_model_answers"
MT_LABELS = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def table_row(md: str, section: str, method: str, occurrence: int = 0) -> dict[str, str]:
    """The row of `method` in the `occurrence`-th table under the `## section` heading, keyed by column name."""
    body = next(part for part in md.split("\n## ") if part.startswith(section))
    tables = [block for block in body.split("\n\n") if block.startswith("| ")]
    lines = tables[occurrence].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[header.index("method")] == method:
            return dict(zip(header, cells, strict=True))
    raise AssertionError(f"no row {method!r} under {section!r}")


# ---------------------------------------------------------------- real Spec-Bench files, by hand


def raw(method: str) -> list[dict]:
    path = next(SPEC_BENCH_ANSWERS.glob(f"vicuna-7b-v1.3-{method}-float16-*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def throughput(record: dict) -> float:
    choice = record["choices"][0]
    return sum(choice["new_tokens"]) / sum(choice["wall_time"])


def group_of(record: dict) -> str:
    return "mt_bench" if record["category"] in MT_LABELS else record["category"]


def hand_tau(records: list[dict]) -> float:
    tokens = sum(sum(r["choices"][0]["new_tokens"]) for r in records)
    return tokens / sum(sum(r["choices"][0]["decoding_steps"]) for r in records)


def hand_spec_bench_speedup(method: list[dict], base: list[dict], group: str) -> float:
    def mean_throughput(records):
        values = [throughput(r) for r in records if group_of(r) == group]
        return sum(values) / len(values)

    return mean_throughput(method) / mean_throughput(base)


def hand_paired_speedup(method: list[dict], base: list[dict]) -> float:
    base_tp = {r["question_id"]: throughput(r) for r in base}
    logs = [math.log(throughput(r) / base_tp[r["question_id"]]) for r in method]
    return math.exp(sum(logs) / len(logs))


@pytest.fixture(scope="module")
def spec_bench_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    path = report.build_report([SPEC_BENCH_ANSWERS], out)
    cells = collect_cells(sources.load_sources([SPEC_BENCH_ANSWERS]))
    return path, cells


def test_spec_bench_report_files(spec_bench_report):
    path, cells = spec_bench_report
    assert path.name == "report.md" and path.is_file()
    for stem in ("speedup_by_category", "accept_length_hist"):
        for ext in ("png", "pdf"):
            assert (path.parent / f"{stem}.{ext}").stat().st_size > 1000
    tex = (path.parent / "tables.tex").read_text()
    assert r"\toprule" in tex and r"\bottomrule" in tex and r"$\times$" in tex
    assert len(cells) == 1 and set(cells[0].by_method) == {"vanilla", "sps-68m", "eagle"}


def test_spec_bench_numbers_match_a_hand_computation(spec_bench_report):
    path, (cell,) = spec_bench_report
    md = path.read_text()
    eagle, sps, vanilla = raw("eagle"), raw("sps-68m"), raw("vanilla")
    stats = cell.stats["eagle"]

    tau = hand_tau(eagle)
    assert stats.tau == pytest.approx(tau, rel=1e-12)
    assert abs(tau - 3.58) < 0.05 and abs(hand_tau(sps) - 2.50) < 0.05  # the data README's figures
    assert table_row(md, "Leaderboard", "eagle")["τ"] == f"{tau:.2f}"

    for group in ("translation", "mt_bench"):
        expected = hand_spec_bench_speedup(eagle, vanilla, group)
        assert stats.spec_bench[group] == pytest.approx(expected, rel=1e-12)
        assert table_row(md, "Speedup, Spec-Bench definition", "eagle")[group] == f"{expected:.2f}×"

    paired = hand_paired_speedup(eagle, vanilla)
    overall = stats.paired["overall"]
    assert overall.value == pytest.approx(paired, rel=1e-9) and overall.pairs == 480
    assert overall.low < paired < overall.high
    assert table_row(md, "Leaderboard", "eagle")["Overall"] == f"{paired:.2f}× [{overall.low:.2f}, {overall.high:.2f}]"


def test_spec_bench_report_labels_what_it_lacks(spec_bench_report):
    md = spec_bench_report[0].read_text()
    assert table_row(md, "Losslessness", "eagle")["questions checked"] == "not checked"
    assert "re-tokenises" in md and "new_tokens" in md
    assert "vanilla" not in [
        line.split("|")[1].strip() for line in md.split("## Speedup")[0].splitlines() if line.startswith("| ")
    ]  # the baseline is not a leaderboard row


# ---------------------------------------------------------------- a synthetic run folder


def answer(qid: int, group: str, method: str, temperature: float, seconds: float, steps: list[int], **extra) -> Answer:
    """One single-turn question whose steps accepted `steps` tokens each."""
    return Answer(
        question_id=qid,
        category=group,
        group=group,
        method=method,
        temperature=temperature,
        model="tiny",
        task="quick",
        new_tokens=[sum(steps)],
        wall_time=[seconds],
        decoding_steps=[len(steps)],
        accept_lengths=steps,
        turns=["text"],
        seed=qid,
        **extra,
    )


def write(path: Path, answers: list[Answer]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(a.to_record("tiny")) + "\n" for a in answers))


GREEDY = [
    {"match": True, "turn": None, "position": None, "margin": None, "near_tie": False},
    {"match": False, "turn": 0, "position": 3, "margin": 1e-4, "near_tie": True},
    {"match": False, "turn": 0, "position": 1, "margin": 2.5, "near_tie": False},
]
PROFILE = {"1": 0.010, "2": 0.011, "4": 0.013, "8": 0.020}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "run-a"
    run.mkdir()
    (run / "manifest.json").write_text(
        json.dumps(
            {"config": {"dtype": "float32"}, "model": {"name": "tiny"}, "machine": {"device_name": "Fake GPU 9000"}}
        )
    )
    (run / "forward_profile.json").write_text(json.dumps(PROFILE))
    groups = ["chat", "chat", "math"]
    vanilla = [
        answer(
            q,
            groups[q],
            "vanilla",
            0.0,
            1.0,
            [1, 1, 1, 1],
            tested=[0] * 4,
            tree_size=[1] * 4,
            draft_time=0.0,
            verify_time=0.9,
        )
        for q in range(3)
    ]
    sps = [
        answer(
            q,
            groups[q],
            "sps",
            0.0,
            0.5,
            [3, 1],
            tested=[3, 3],
            tree_size=[2, 4],
            draft_time=0.1,
            verify_time=0.3,
            greedy_check=GREEDY[q],
        )
        for q in range(3)
    ]
    lossy = [
        answer(
            q,
            groups[q],
            "medusa",
            0.0,
            0.25,
            [4],
            tested=[3],
            tree_size=[4],
            draft_time=0.0,
            verify_time=0.2,
            lossless_rule=False,
        )
        for q in range(3)
    ]
    warm = [
        answer(q, groups[q], "sps", 0.7, 0.5, [2, 2], tested=[3, 3], tree_size=[4, 4], draft_time=0.1, verify_time=0.3)
        for q in range(3)
    ]
    write(run / "answers" / "quick" / "vanilla-temperature-0.jsonl", vanilla)
    write(run / "answers" / "quick" / "sps-temperature-0.jsonl", sps)
    write(run / "answers" / "quick" / "medusa-temperature-0.jsonl", lossy)
    write(run / "answers" / "quick" / "sps-temperature-0.7.jsonl", warm)  # no vanilla at T=0.7
    return run


def test_reporting_and_listing_import_neither_torch_nor_a_method(run_dir, tmp_path):
    """A report reads answer files and presets: importing torch and every method cost a standalone report 6 s."""
    code = (
        "import sys; from specbench.cli.main import main; "
        f"assert main(['report', {str(run_dir)!r}, '--out', {str(tmp_path / 'out')!r}]) == 0; "
        "assert main(['list', 'methods']) == 0; "
        "print(sorted(m for m in ('torch', 'transformers', 'specbench.methods') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "report.md").is_file()


def test_synthetic_run_detail_roofline_and_losslessness(run_dir, tmp_path):
    md = report.build_report([run_dir], tmp_path / "out").read_text()
    assert "run-a (Fake GPU 9000)" in md

    sps = table_row(md, "Per-method detail", "sps")
    assert sps["τ"] == "2.00" and sps["tokens/s"] == "8.0" and sps["mean tree size"] == "3.0"
    assert sps["draft share"] == "25.0%"
    # two steps per question, both drafted 3 deep: accepted 2 and 0 draft tokens
    assert [sps[f"α_{k}"] for k in range(1, 6)] == ["0.50", "0.50", "0.00", "—", "—"]
    # every question is twice as fast as vanilla; ideal = tau * T(1) / (T(3) + D), D = 0.1 / 2 steps
    ideal = 2.0 * 0.010 / ((0.011 + 0.013) / 2 + 0.05)
    assert sps["roofline efficiency"] == f"{2.0 / ideal:.0%}"
    assert table_row(md, "Per-method detail", "vanilla")["roofline efficiency"] == "100%"

    check = table_row(md, "Losslessness", "sps")
    assert (
        check["questions checked"],
        check["exact match"],
        check["numerical divergences"],
        check["mismatches (bugs)"],
    ) == ("3", "33.3%", "1", "**1**")
    assert table_row(md, "Losslessness", "medusa (lossy)")["questions checked"] == "not checked"
    assert table_row(md, "Leaderboard", "medusa (lossy)")["Overall"].startswith("4.00× [4.00, 4.00]")
    assert table_row(md, "Leaderboard", "sps")["chat"] == "2.00× [2.00, 2.00]"


def test_cell_without_vanilla_shows_na(run_dir, tmp_path):
    out = tmp_path / "out"
    md = report.build_report([run_dir], out).read_text()
    warm = table_row(md, "Leaderboard", "sps", occurrence=1)  # the T=0.7 cell
    assert warm["Overall"] == "n/a" and warm["chat"] == "n/a" and warm["τ"] == "2.00"
    assert table_row(md, "Per-method detail", "sps", occurrence=1)["roofline efficiency"] == "n/a"
    assert "T=0.7: no `vanilla` answers in this source" in md
    # several cells: one set of plots per cell, named by slug; no speedup plot where there is no baseline
    assert (out / "speedup_by_category-run-a-tiny-quick-t0.png").is_file()
    assert (out / "accept_length_hist-run-a-tiny-quick-t0.7.pdf").is_file()
    assert not (out / "speedup_by_category-run-a-tiny-quick-t0.7.png").exists()
    text = report.summary([run_dir])
    assert "n/a" in text and "Per-method" not in text and "no `vanilla` answers" in text


def test_sources_never_mix(run_dir, tmp_path):
    other = tmp_path / "machine-b" / "run-a"
    other.mkdir(parents=True)
    write(
        other / "answers" / "quick" / "sps-temperature-0.jsonl",
        [answer(q, "chat", "sps", 0.0, 0.1, [4]) for q in range(3)],
    )
    cells = collect_cells(sources.load_sources([run_dir, other]))
    assert [c.source.name for c in cells] == ["run-a", "run-a", "machine-b/run-a"]
    assert cells[2].baseline is None and math.isnan(cells[2].stats["sps"].paired["overall"].value)
    colors = {name: presets.load("methods", name).color for name in ("sps", "eagle", "eagle2", "medusa")}
    shown = plots.method_colors({"sps", "sps-68m", "sps-x", "eagle", "mine"})
    assert shown["sps"] == colors["sps"] and shown["eagle"] == colors["eagle"]
    assert shown["sps-68m"] == "#8fbbda"  # beside its family: a lighter shade of its colour (#1f77b4)
    assert len(set(shown.values())) == 5  # a second variant, and a name with no preset: colours of their own
    assert plots.method_colors({"sps-68m"})["sps-68m"] == colors["sps"]
    assert plots.method_colors({"eagle2[top_k=6]"})["eagle2[top_k=6]"] == colors["eagle2"]
    assert plots.method_colors({"medusa-typical"})["medusa-typical"] == colors["medusa"]


def test_paper_figures_and_tables_for_several_runs(run_dir, tmp_path):
    write(
        run_dir / "answers" / "quick" / "vanilla-temperature-0.7.jsonl",
        [
            answer(
                q,
                "chat",
                "vanilla",
                0.7,
                1.0,
                [1, 1, 1, 1],
                tested=[0] * 4,
                tree_size=[1] * 4,
                draft_time=0.0,
                verify_time=0.9,
            )
            for q in range(3)
        ],
    )
    other = tmp_path / "machine-b"
    write(
        other / "answers" / "quick" / "vanilla-temperature-0.jsonl",
        [answer(q, "chat", "vanilla", 0.0, 0.5, [1, 1, 1, 1]) for q in range(3)],
    )
    write(
        other / "answers" / "quick" / "pld-temperature-0.jsonl",
        [answer(q, "chat", "pld", 0.0, 0.4, [2, 2]) for q in range(3)],
    )
    out = tmp_path / "out"
    md = report.build_report([run_dir, other], out).read_text()

    a0, b0 = "run-a-tiny-quick-t0", "machine-b-tiny-quick-t0"
    expected = [
        "speedup_overview",
        "speedup_vs_temperature-run-a-tiny-quick",
        f"acceptance_by_position-{a0}",
        f"tau_vs_tree_size-{a0}",
        f"time_split-{a0}",
        f"roofline-{a0}",
        f"speedup_by_category-{b0}",
    ]
    for stem in expected:
        for ext in ("png", "pdf"):
            assert (out / f"{stem}.{ext}").stat().st_size > 1000, stem
        assert f"![{stem}]({stem}.png)" in md
    # machine-b recorded no per-step fields, profile or second temperature: those figures are left out
    for stem in (
        f"acceptance_by_position-{b0}",
        f"time_split-{b0}",
        f"roofline-{b0}",
        "speedup_vs_temperature-machine-b-tiny-quick",
    ):
        assert not (out / f"{stem}.png").exists()
    assert "### run-a (Fake GPU 9000) · tiny · quick: speedup against temperature" in md

    tex = (out / "tables.tex").read_text()
    detail = next(block for block in tex.split("\n\n") if "T=0: per-method detail" in block)
    assert r"Method & Questions & $\tau$ & Tokens/s" in detail and r"$\alpha_{1}$" in detail
    md_sps = table_row(md, "Per-method detail", "sps")
    tex_sps = next(line for line in detail.splitlines() if line.startswith("sps &"))
    assert tex_sps == " & ".join(v.replace("%", r"\%") for v in md_sps.values()) + r" \\"


def test_missing_source_is_a_user_error(tmp_path):
    with pytest.raises(SpecbenchError, match="no such run folder"):
        sources.load_sources([tmp_path / "nowhere"])


def test_noise_floor_and_busy_machine_notes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(
        json.dumps(
            {
                "config": {"dtype": "float32"},
                "model": {"name": "tiny"},
                "machine": {"device_name": "cpu", "cpu_count": 2},
            }
        )
    )
    quiet = [answer(q, "chat", "vanilla", 0.0, 1.0, [1, 1], busy_cpus=0.1) for q in range(4)]
    again = [answer(q, "chat", "vanilla-aa", 0.0, 1.0 + 0.01 * q, [1, 1], busy_cpus=0.1) for q in range(4)]
    busy = [answer(q, "chat", "sps", 0.0, 0.5, [2], busy_cpus=1.5 if q == 2 else 0.0) for q in range(4)]
    write(run / "answers" / "quick" / "vanilla-temperature-0.jsonl", quiet)
    write(run / "answers" / "quick" / "vanilla-aa-temperature-0.jsonl", again)
    write(run / "answers" / "quick" / "sps-temperature-0.jsonl", busy)
    md = report.build_report([run], tmp_path / "out").read_text()
    # A/A ratios 1, 1/1.01, 1/1.02, 1/1.03: logs' sd 0.0127 < their rms 0.0185, the floor; t(3) = 3.182
    assert "noise floor (A/A: vanilla timed again in the same interleaving) 0.99× [0.96, 1.01]" in md
    assert "**busy machine**: 1 of 12 answers" in md and "more than 0.5 of 2 CPUs" in md
    quiet_run = tmp_path / "quiet"
    (quiet_run / "answers").mkdir(parents=True)
    (quiet_run / "manifest.json").write_text((run / "manifest.json").read_text())
    write(quiet_run / "answers" / "quick" / "vanilla-temperature-0.jsonl", quiet)
    write(
        quiet_run / "answers" / "quick" / "sps-temperature-0.jsonl",
        [answer(q, "chat", "sps", 0.0, 0.5, [2]) for q in range(4)],
    )
    assert "busy machine" not in report.build_report([quiet_run], tmp_path / "out2").read_text()
    profile = json.loads(
        next((tmp_path / "out" / "speculation_profiles").glob("*/sps/speculation_profile.json")).read_text()
    )
    assert profile["mean_accept_length"] == 2.0 and profile["marginal_accept_rates"] == [1.0]
    assert not list((tmp_path / "out" / "speculation_profiles").glob("*/vanilla*"))


@pytest.mark.parametrize(
    ("manifest", "regime"),
    [
        ({"config": {}}, "eager"),
        ({"config": {"compile": True}}, "eager+compile"),
        ({"config": {"graphs": True}}, "graphs"),
        ({"config": {"graphs": True, "compile": True}}, "graphs+compile"),
        ({"config": {}, "engine": {"name": "vllm", "version": "0.32.0"}}, "vllm 0.32.0"),
    ],
)
def test_a_runs_regime_says_graphs_compile_or_its_engine(manifest, regime):
    assert sources.Source(Path("run"), "run", [], manifest).regime == regime


def test_a_report_names_its_sources_relative_to_itself(run_dir, tmp_path, monkeypatch):
    """A report travels (committed, sent): a path of the machine that wrote it means nothing anywhere else."""
    monkeypatch.chdir(tmp_path)
    out = Path("reports") / "out"  # as `specbench report results/RUN --out reports/RUN` gives them
    md = report.build_report([Path(run_dir.name)], out).read_text()
    assert "**run-a (Fake GPU 9000)**: `../../run-a`" in md
    texts = [p for p in out.rglob("*") if p.suffix in (".md", ".tex", ".json")]
    assert {p.suffix for p in texts} == {".md", ".tex", ".json"}  # the speculation profiles among them
    for path in texts:
        text = path.read_text()
        assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text, path
        assert not re.search(r"(^|[\s`\"'(\[])/\w", text), path  # no absolute path of any other folder either


LONG_NAMES = [
    "vanilla",
    "vanilla-aa",
    "sps",
    "sps-68m-long-draft-name",
    "pld",
    "suffix",
    "lookahead",
    "lookahead-shifted",
    "medusa",
    "medusa-typical",
    "eagle",
    "eagle2[top_k=6,depth=4]",
    "eagle3",
    "mtp",
    "dflash",
    "pard",
]


def _drawn_tick_labels(ax) -> list:
    """The tick labels a draw shows: a locator's ticks outside the view (a log axis' next decade) keep a label
    that is never drawn."""
    out = []
    for axis in (ax.xaxis, ax.yaxis):
        low, high = sorted(axis.get_view_interval())
        ticks = [
            *axis.get_major_ticks(len(axis.get_majorticklocs())),
            *axis.get_minor_ticks(len(axis.get_minorticklocs())),
        ]
        out += [t.label1 for t in ticks if low - 1e-9 <= t.get_loc() <= high + 1e-9]
    return out


def _overlaps(a, b) -> bool:
    """Two window extents share more than a pixel's sliver."""
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 1 and min(a.y1, b.y1) - max(a.y0, b.y0) > 1


def test_no_figure_overlaps_its_labels_with_fifteen_long_method_names(tmp_path, monkeypatch):
    """Every figure of a run with 16 methods, some long-named: no two texts of a figure (tick labels, legend
    entries, axis labels, title) overlap. Side by side under bars, `lookahead-shifted` met its neighbours."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(
        json.dumps(
            {"config": {"dtype": "float32"}, "model": {"name": "tiny"}, "machine": {"device_name": "Fake GPU 9000"}}
        )
    )
    (run / "forward_profile.json").write_text(json.dumps(PROFILE))
    groups = ["chat", "math_reasoning", "summarization", "translation"]
    for i, method in enumerate(LONG_NAMES):
        deep = [1 + min(i, 6)] * 3 + [1 + (q % 12) for q in range(12)]  # deep drafts rest on few steps
        for temperature in (0.0, 1.0):
            answers = [
                answer(
                    q,
                    groups[q % 4],
                    method,
                    temperature,
                    1.0 / (1 + 0.1 * i),
                    deep,
                    tested=[min(n, 12) for n in deep],
                    tree_size=[1 + i] * len(deep),
                    draft_time=0.01 * i,
                    verify_time=0.5,
                    lossless_rule=method != "medusa-typical",
                )
                for q in range(8)
            ]
            write(run / "answers" / "quick" / f"{method}-temperature-{temperature:g}.jsonl", answers)
    figures = []

    def keep(fig, out_dir: Path, stem: str) -> list[Path]:  # laid out as saved, not written (half the test's time)
        fig.tight_layout()
        figures.append((stem, fig))
        return []

    monkeypatch.setattr(plots, "_save", keep)
    md = report.build_report([run], tmp_path / "out").read_text()
    drawn = {stem.split("-")[0] for stem, _ in figures}
    assert drawn == {
        "speedup_overview",
        "speedup_vs_temperature",
        "speedup_by_category",
        "accept_length_hist",
        "acceptance_by_position",
        "tau_vs_tree_size",
        "time_split",
        "roofline",
    }
    assert f"fewer than {metrics.MIN_DRAFTS} drafts" in md  # the footnote says how thin points are drawn
    for stem, fig in figures:
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        texts = [t for ax in fig.axes for t in (*_drawn_tick_labels(ax), ax.xaxis.label, ax.yaxis.label, ax.title)]
        texts += [t for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        boxes = [
            (t.get_text(), t.get_window_extent(canvas.get_renderer()))
            for t in texts
            if t.get_visible() and t.get_text().strip()
        ]
        assert len(boxes) > len(LONG_NAMES) or not stem.startswith(("time_split", "roofline")), stem
        clashes = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1 :] if _overlaps(box, other)]
        assert not clashes, f"{stem}: {clashes}"


def test_acceptance_counts_are_the_drafts_each_depth_rests_on(run_dir):
    (cell, _) = collect_cells(sources.load_sources([run_dir]))
    steps = cell.stats["sps"].steps  # two steps a question, both drafted 3 deep
    assert metrics.acceptance_counts(steps) == [6, 6, 6]
    assert metrics.acceptance_counts(steps, 5) == [6, 6, 6, 0, 0]
    assert len(metrics.acceptance_counts(steps, 5)) == len(metrics.acceptance_by_position(steps, 5))
    assert metrics.acceptance_counts(cell.stats["vanilla"].steps) == []


def test_one_question_cells_show_no_interval(tmp_path):
    """`--limit 1`: a category of one question has a ratio and no interval; overall (three) has one, floored by
    the A/A column's noise."""
    run = tmp_path / "run"
    groups = ["chat", "math", "rag"]
    for method, seconds in (("vanilla", 1.0), ("vanilla-aa", 1.05), ("sps", 0.5)):
        write(
            run / "answers" / "quick" / f"{method}-temperature-0.jsonl",
            [answer(q, g, method, 0.0, seconds * (1 + 0.1 * q), [2, 2]) for q, g in enumerate(groups)],
        )
    (cell,) = collect_cells(sources.load_sources([run]))
    md = report.build_report([run], tmp_path / "out").read_text()
    row = table_row(md, "Leaderboard", "sps")
    assert [row[g] for g in groups] == ["2.00×"] * 3 and not cell.stats["sps"].paired["chat"].has_interval
    overall = cell.stats["sps"].paired["overall"]
    assert overall.pairs == 3 and overall.has_interval and overall.low < 2.0 < overall.high
    assert row["Overall"] == f"2.00× [{overall.low:.2f}, {overall.high:.2f}]"
    assert cell.noise == pytest.approx(math.log(1.05))


def test_a_speedup_axis_fits_the_speedups_not_the_widest_interval():
    """Two questions can honestly give [0.01, 90]: the axis stops at twice the largest speedup and says so."""
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    wide = [metrics.Speedup(1.2, 1.1, 1.3, 12), metrics.Speedup(1.1, 0.01, 90.0, 2), metrics.Speedup(0.9, 0.9, 0.9, 1)]
    note = plots._ratio_axis(ax, wide)
    assert ax.get_ylim() == pytest.approx((0.0, 1.15 * 1.2)) and note == " (intervals beyond 1.4× cut)"
    assert plots._ratio_axis(ax, [*wide[:1], metrics.Speedup(1.5, 1.0, 2.5, 3)]) == ""
    assert ax.get_ylim()[1] == pytest.approx(2.5)  # an interval within twice the largest speedup is shown whole
    assert plots._ratio_axis(ax, wide[1:2]) == " (intervals beyond 1.3× cut)"  # every interval beyond the top


def test_a_method_that_drafts_nothing_shows_no_draft_share_bar_or_cost(tmp_path, monkeypatch):
    """Vanilla verifies its root alone: what the loop timed as its drafting (its own calls between the forward and
    the next) is no draft share, no draft bar, and no D that lifted its roofline efficiency to 1 + D/T(1) > 100%."""
    from specbench.report import tables

    run = tmp_path / "run"
    run.mkdir()
    (run / "forward_profile.json").write_text(json.dumps(PROFILE))
    root_alone = dict(steps=[1] * 4, tested=[0] * 4, tree_size=[1] * 4)  # four steps verifying the root alone
    drafted = dict(steps=[4], tested=[3], tree_size=[6])
    for method, how in (("vanilla", root_alone), ("vanilla-aa", root_alone), ("pld", drafted)):
        answers = [answer(q, "chat", method, 0.0, 1.0, draft_time=0.02, verify_time=0.8, **how) for q in range(3)]
        write(run / "answers" / "quick" / f"{method}-temperature-0.jsonl", answers)
    (cell,) = collect_cells(sources.load_sources([run]))
    header, rows = tables.detail_rows(cell)
    detail = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert detail["vanilla"]["draft share"] == detail["vanilla-aa"]["draft share"] == "—"
    assert detail["pld"]["draft share"] == "2.4%"  # 0.02 / (0.02 + 0.8)
    assert detail["vanilla"]["roofline efficiency"] == detail["vanilla-aa"]["roofline efficiency"] == "100%"

    figures = {}

    def keep(fig, out_dir: Path, stem: str) -> list[Path]:
        figures[stem] = fig
        return []

    monkeypatch.setattr(plots, "_save", keep)
    colors = plots.method_colors(set(cell.stats))
    plots.plot_time_split(cell, colors, tmp_path, "split")
    (ax,) = figures["split"].axes
    draft, verify, _ = ax.containers
    assert [s.method for s in cell.stats.values()] == ["pld", "vanilla", "vanilla-aa"]
    assert [p.get_y() + p.get_height() / 2 for p in draft.patches] == [0] and len(verify.patches) == 3

    plots.plot_tau_vs_tree(cell, colors, tmp_path, "tau")  # points at 1 and 6: a tick at or past 6 reads them
    (ax,) = figures["tau"].axes
    low, high = ax.get_xlim()
    assert [t for t in ax.get_xticks() if low <= t <= high] == [1, 2, 4, 8]


def test_a_report_inside_its_run_names_the_run_folder():
    """`run` writes its report into `<run>/report/`: the Sources line named the run `..`, no folder a reader of a
    committed report could find."""
    folder = Path("results") / "tiny-quick-0123abcd"
    source = sources.Source(folder.resolve(), folder.name, [])
    assert source.where(folder / "report") == "../../tiny-quick-0123abcd"
    assert source.where(folder) == "../tiny-quick-0123abcd"
    assert source.where(Path("reports") / "tiny") == "../../results/tiny-quick-0123abcd"
