"""Engine mode (`run --engine vllm`): the method -> speculative_config mapping, vLLM's per-step counts read as our
steps, the concurrency numbers, and whole runs through a stand-in vLLM (tests/fake_vllm) and, where vLLM is
installed, through vLLM itself."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pandas as pd
import pytest

from specbench.cli.main import main
from specbench.engines import concurrency, translate
from specbench.engines.steps import step_lengths
from specbench.errors import SpecbenchError

from .test_cli import error_of

FAKE = Path(__file__).parent / "fake_vllm"


def test_presets_map_to_speculative_configs():
    paths = {"target": Path("/t"), "draft": Path("/d"), "eagle3 head": Path("/e3")}
    assert translate.speculative_config("vanilla", paths) is None
    assert translate.speculative_config("sps", paths) == {
        "method": "draft_model",
        "model": "/d",
        "num_speculative_tokens": 4,
        "draft_sample_method": "probabilistic",
    }
    assert translate.speculative_config("sps[num_draft_tokens=2]", paths)["num_speculative_tokens"] == 2
    assert translate.speculative_config("pld", paths) == {
        "method": "ngram",
        "num_speculative_tokens": 10,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    assert translate.speculative_config("eagle3", paths)["model"] == "/e3"
    assert translate.why_not("mtp").startswith("vLLM runs MTP only")
    assert translate.why_not("sps") is None
    names, skipped = translate.restrict(["vanilla", "sps", "lookahead", "medusa"], {"x": "why"})
    assert names == ["vanilla", "sps"] and set(skipped) == {"x", "lookahead", "medusa"}
    assert skipped["lookahead"] == "not in engine mode: vLLM has no Lookahead (Jacobi) decoding"


def test_a_preset_mapping_naming_what_it_lacks_fails_in_one_line(tmp_path):
    from specbench import registry

    (tmp_path / "odd.yaml").write_text(
        "implementation: sps\nneeds: draft\nparams: {num_draft_tokens: 2}\n"
        "vllm: {method: draft_model, model: draft, num_speculative_tokens: $gamma}\n"
    )
    (tmp_path / "odd2.yaml").write_text("implementation: vanilla\nvllm: {method: eagle, model: eagle head}\n")
    registry.add_methods(tmp_path)
    with pytest.raises(SpecbenchError, match=r"vllm.num_speculative_tokens reads \$gamma, not one of its params"):
        translate.speculative_config("odd", {"draft": Path("/d")})
    with pytest.raises(SpecbenchError, match="vllm.model is 'eagle head', which it does not need"):
        translate.speculative_config("odd2", {"target": Path("/t")})
    assert translate.why_not("odd") is None


@pytest.mark.parametrize(
    ("new", "accepted", "drafted", "lengths", "tested"),
    [
        (1, [], [], [1], [0]),  # the prefill's token alone
        (9, [0, 1, 4], [4, 4, 4], [1, 1, 2, 5], [0, 1, 2, 4]),  # tested: accepted drafts + the rejected one
        (4, [4], [4], [1, 3], [0, 4]),  # the last step cut at the budget or a stop token
        (2, [3, 1], [4, 4], [1, 1], [0, 4]),  # a step past the end is dropped
        (5, [1], [2], [1, 2, 1, 1], [0, 2, 0, 0]),  # forwards without a draft, which vLLM does not list
    ],
)
def test_vllm_step_counts_become_our_steps(new, accepted, drafted, lengths, tested):
    assert step_lengths(new, accepted, drafted)[:2] == (lengths, tested)


def test_step_counts_always_add_up_to_the_answer():
    import random

    rng = random.Random(0)
    for _ in range(500):
        steps = rng.randint(0, 6)
        drafted = [rng.randint(0, 5) for _ in range(steps)]
        accepted = [rng.randint(0, d) for d in drafted]
        new = rng.randint(1, 1 + sum(a + 1 for a in accepted))
        lengths, tested, sent = step_lengths(new, accepted, drafted)
        assert sum(lengths) == new and len(tested) == len(lengths) and min(lengths) >= 1
        assert all(n - 1 <= t < s for n, t, s in zip(lengths, tested, sent, strict=True))  # accepted <= examined < sent


def test_concurrency_levels_by_hand():
    rows = pd.DataFrame(
        [
            # vanilla at 2 in flight: 30 tokens in 3 s; sps: 30 tokens in 2 s over 12 steps
            {
                "task": "t",
                "temperature": 0.0,
                "method": m,
                "concurrency": 2,
                "question_id": q,
                "turn": 0,
                "prompt_tokens": 5,
                "new_tokens": 15,
                "steps": s,
                "ttft": f,
                "latency": 1.5,
                "level_wall": w,
            }
            for m, s, w in (("vanilla", 15, 3.0), ("sps", 6, 2.0))
            for q, f in ((1, 0.1), (2, 0.3))
        ]
    )
    out = concurrency.levels(rows).set_index("method")
    assert out.loc["vanilla", "throughput"] == pytest.approx(10.0)
    assert out.loc["sps", "throughput"] == pytest.approx(15.0)
    assert out.loc["sps", "speedup"] == pytest.approx(1.5) and out.loc["vanilla", "speedup"] == pytest.approx(1.0)
    assert out.loc["sps", "tau"] == pytest.approx(2.5)
    assert out.loc["sps", "ttft"] == pytest.approx(0.2)  # the median
    assert out.loc["sps", "tpot"] == pytest.approx(((1.5 - 0.1) / 14 + (1.5 - 0.3) / 14) / 2)
    assert out.loc["sps", "per_user"] == pytest.approx(30 / 3.0)  # two requests' 30 tokens over their 3 s of latency


def test_concurrency_file_survives_a_cut_line(tmp_path):
    path = tmp_path / concurrency.FILE
    row = {"task": "t", "temperature": 0.0, "method": "sps", "concurrency": 4}
    concurrency.append(path, [row])
    with path.open("a") as f:
        f.write('{"task": "t", "temp')  # a killed run's half line
    assert concurrency.done(path) == {("t", 0.0, "sps", 4)}


def test_engine_mode_needs_its_flags_right(capsys, tiny_models, tmp_path, monkeypatch):
    target, draft = tiny_models
    run = ["run", "--model", str(target), "--draft", str(draft), "--out", str(tmp_path / "r"), "--no-report"]
    assert "add --engine vllm" in error_of(capsys, [*run, "--concurrency", "2"])
    assert "--one-engine-at-a-time applies" in error_of(capsys, [*run, "--one-engine-at-a-time"])
    assert "not to --engine vllm" in error_of(capsys, [*run, "--engine", "vllm", "--workers", "2"])
    assert "drop --shard" in error_of(capsys, [*run, "--engine", "vllm", "--concurrency", "2", "--shard", "1/2"])
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed
    assert 'needs vLLM: pip install "specbench[vllm]"' in error_of(capsys, [*run, "--engine", "vllm"])
    assert not (tmp_path / "r").exists()


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The stand-in vLLM importable here and in the engine processes; the engines' arguments land in the log."""
    monkeypatch.syspath_prepend(str(FAKE))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    log = tmp_path / "engines.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    yield log
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def test_a_run_in_the_engine_writes_answers_sweeps_and_the_cross_check(capsys, tiny_models, tmp_path, fake_vllm):
    target, draft = tiny_models
    questions = tmp_path / "two.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"id": i, "turns": [t, "And then?"]}) + "\n"
            for i, t in enumerate(["Name a colour.", "Count to three."])
        )
    )
    common = [
        "run",
        "--model",
        str(target),
        "--draft",
        str(draft),
        "--tasks",
        str(questions),
        "--max-new-tokens",
        "6",
        "--no-noise-floor",
        "--no-report",
        "--methods",
        "vanilla,sps",
        "--device",
        "cpu",
    ]  # (on a GPU, auto would pick float16 there)
    engine_run, loop_run = tmp_path / "engine", tmp_path / "loop"
    assert main([*common, "--engine", "vllm", "--concurrency", "2", "--out", str(engine_run)]) == 0
    assert main([*common, "--out", str(loop_run)]) == 0

    engines = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    configs = [e["speculative_config"] for e in engines]  # vanilla's and sps's engines for the answers, at once;
    assert len(engines) == 4 and configs[2:] == [None, configs[3]]  # then a fresh engine per sweep level
    assert configs.count(None) == 2 and {e["dtype"] for e in engines} == {"float32"}
    assert configs[3] == {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 4,
        "draft_sample_method": "probabilistic",
    }

    manifest = json.loads((engine_run / "manifest.json").read_text())
    assert manifest["engine"] == {"name": "vllm", "version": "0.0-fake"} and manifest["config"]["engine"] == "vllm"
    answers = {
        a["specbench"]["method"]: a
        for a in map(json.loads, (engine_run / "answers" / "two" / "sps-temperature-0.jsonl").open())
    }
    sps = answers["sps"]
    assert sps["specbench"]["greedy_check"]["match"] is True
    # per turn: the prefill's token, then the 2 accepted drafts + 1 of each step, the last step cut at the end
    expected = [n for t in sps["choices"][0]["new_tokens"] for n in step_lengths(t, [2] * t, [4] * t)[0]]
    assert sps["choices"][0]["accept_lengths"] == expected and expected[:2] == [1, 3]
    ours = json.loads((loop_run / "answers" / "two" / "vanilla-temperature-0.jsonl").open().readline())
    theirs = json.loads((engine_run / "answers" / "two" / "vanilla-temperature-0.jsonl").open().readline())
    assert ours["specbench"]["output_ids"] == theirs["specbench"]["output_ids"]  # the same prompts, the same greedy

    rows = concurrency.read(engine_run / concurrency.FILE)
    assert sorted(set(rows.method)) == ["sps", "vanilla"] and set(rows.concurrency) == {2} and len(rows) == 8

    assert main(["report", str(loop_run), str(engine_run), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Concurrency sweeps (engine mode)" in report and "![concurrency-engine-two-t0]" in report
    assert "## Cross-check: our loop / the engine" in report
    tau = sum(sps["choices"][0]["new_tokens"]) / sum(sps["choices"][0]["decoding_steps"])
    row = next(line for line in report.splitlines() if line.startswith("| sps ") and "100% / 100%" in line)
    assert f" / {tau:.2f} " in row  # τ in the engine: per turn the prefill's token, then 3 a step (the last cut)

    assert "compare runs of one engine" in error_of(capsys, ["compare", str(loop_run), str(engine_run)])

    fake_vllm.unlink()  # one engine at a time: the same answers, the engines built one after another
    one = tmp_path / "one"
    assert main([*common, "--engine", "vllm", "--one-engine-at-a-time", "--out", str(one)]) == 0
    assert len(fake_vllm.read_text().splitlines()) == 2
    for method in ("vanilla", "sps"):
        name = f"{method}-temperature-0.jsonl"
        ids = [
            [json.loads(line)["specbench"]["output_ids"] for line in (run / "answers" / "two" / name).open()]
            for run in (engine_run, one)
        ]
        assert ids[0] == ids[1]
    assert main([*common[:-2], "--methods", "vanilla,mtp,sps", "--engine", "vllm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "skipped: mtp: not in engine mode: vLLM runs MTP only" in out and "methods: vanilla, sps" in out


def test_vllm_output_goes_to_the_run_folder_and_a_failure_shows_its_end(
    capfd, tiny_models, tmp_path, fake_vllm, monkeypatch
):
    """vLLM's own lines go to engine-logs/<method>.log, not between our progress lines; an engine that fails to
    build prints the end of its log and where the whole log is, then one error line."""
    target, _ = tiny_models
    common = [
        "run",
        "--model",
        str(target),
        "--methods",
        "vanilla",
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
        "--no-noise-floor",
        "--no-report",
        "--engine",
        "vllm",
    ]
    assert main([*common, "--out", str(tmp_path / "ok")]) == 0
    shown = capfd.readouterr()
    assert "fake vLLM" not in shown.out + shown.err and "vLLM's own output goes to" in shown.err
    log = (tmp_path / "ok" / "engine-logs" / "vanilla.log").read_text()
    assert "INFO fake vLLM: building an engine" in log and "WARNING fake vLLM: a notice" in log

    monkeypatch.setenv("FAKE_VLLM_FAIL", "no KV cache blocks left")
    assert main([*common, "--out", str(tmp_path / "bad")]) == 2
    err = capfd.readouterr().err
    assert "the last lines of vLLM's output:" in err and "ERROR fake vLLM: no KV cache blocks left" in err
    assert f"its whole output is in {tmp_path / 'bad' / 'engine-logs' / 'vanilla.log'}" in err


@pytest.mark.slow
def test_the_bundled_family_in_vllm(tmp_path, monkeypatch):
    """vLLM itself (skipped where it is not installed): greedy answers equal vanilla's, and the bundled EAGLE head's
    drafts are accepted (its config once said "bias": true, which vLLM read as attention biases it lacks)."""
    vllm = pytest.importorskip("vllm")
    if vllm.__version__.endswith("fake"):
        pytest.skip("the stand-in vLLM is loaded")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    out = tmp_path / "run"
    code = main(
        [
            "run",
            "--engine",
            "vllm",
            "--methods",
            "vanilla,sps,eagle",
            "--limit",
            "1",
            "--max-new-tokens",
            "24",
            "--no-noise-floor",
            "--no-report",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    from specbench.results import read_answers

    answers = [a for a in read_answers(out) if a.method != "vanilla"]
    assert all(a.greedy_check["match"] for a in answers)
    eagle = [a for a in answers if a.method == "eagle"]
    assert sum(sum(a.new_tokens) for a in eagle) > 1.3 * sum(sum(a.decoding_steps) for a in eagle)


@pytest.fixture
def some_vllm(request) -> str:
    """vLLM itself where it is installed ("real"), else the stand-in ("fake", its engines' arguments logged)."""
    if importlib.util.find_spec("vllm") is not None:
        return "real"
    request.getfixturevalue("fake_vllm")
    return "fake"


def test_vllm_serves_a_head_this_suite_trained_in_the_speculators_format(tmp_path, monkeypatch, some_vllm):
    """The closure of the speculators format: the tiny family's EAGLE-3 head, converted, is served by vLLM as its
    eagle3 drafter; greedy answers equal vanilla's, and (the real vLLM) more than one token is accepted a step."""
    from specbench.models.aliases import TINY_DIR
    from specbench.results import read_answers

    converted = tmp_path / "eagle3-speculators"
    assert main(["convert", str(TINY_DIR / "eagle3"), "--to", "speculators", "--out", str(converted)]) == 0
    questions = tmp_path / "one.jsonl"
    questions.write_text(json.dumps({"id": 0, "turns": ["Write a short story about a cat who learns to fly."]}))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    out = tmp_path / "run"
    run = ["run", "--engine", "vllm", "--methods", "vanilla,eagle3", "--head", f"eagle3={converted}"]
    options = ["--tasks", str(questions), "--max-new-tokens", "32", "--no-noise-floor", "--no-report", "--no-warmup"]
    assert main([*run, *options, "--device", "cpu", "--out", str(out)]) == 0
    eagle3 = [a for a in read_answers(out) if a.method == "eagle3"]
    assert len(eagle3) == 1 and all(a.greedy_check["match"] for a in eagle3)
    if some_vllm == "real":
        assert sum(sum(a.new_tokens) for a in eagle3) > 1.3 * sum(sum(a.decoding_steps) for a in eagle3)
    else:
        engines = [json.loads(line) for line in Path(os.environ["FAKE_VLLM_LOG"]).read_text().splitlines()]
        configs = [e["speculative_config"] for e in engines if e["speculative_config"]]
        assert configs == [{"method": "eagle3", "model": str(converted), "num_speculative_tokens": 8}]
