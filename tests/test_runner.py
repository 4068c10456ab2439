import gc
import json
import shutil
import time

import pytest
import torch

from specbench.config import RunConfig
from specbench.errors import SpecbenchError
from specbench.machine import files_digest, source_digest, warm_gpu
from specbench.results import read_file
from specbench.run.runner import answer_path, run

from .conftest import CUDA


def config(tiny_models, out, **kw) -> RunConfig:
    target, draft = tiny_models
    base = dict(
        model=str(target),
        draft=str(draft),
        methods=["vanilla", "sps", "pld"],
        tasks=["quick"],
        limit=1,
        max_new_tokens=16,
        out=str(out),
        progress=False,
    )
    return RunConfig(**{**base, **kw})


def line_ids(path):
    return [json.loads(line)["question_id"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def greedy_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return run(config(tiny_models, out))


def test_run_writes_spec_bench_answer_lines(greedy_run):
    path = answer_path(greedy_run, "quick", "sps", 0.0)
    record = json.loads(path.read_text().splitlines()[0])
    choice = record["choices"][0]
    for key in ("turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"):
        assert key in choice
    assert record["model_id"].endswith("-sps-temperature-0")
    assert len(choice["turns"]) == 2  # the first quick question has two turns
    assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])
    manifest = json.loads((greedy_run / "manifest.json").read_text())
    assert manifest["config"]["methods"] == ["vanilla", "sps", "pld"]
    assert "torch" in manifest["machine"] and (greedy_run / "forward_profile.json").exists()


def test_greedy_methods_match_vanilla(greedy_run):
    vanilla = {a.question_id: a for a in read_file(answer_path(greedy_run, "quick", "vanilla", 0.0))}
    assert len(vanilla) == 6  # one per category
    assert all(a.accept_lengths == [1] * sum(a.new_tokens) for a in vanilla.values())
    for method in ("sps", "pld"):
        for answer in read_file(answer_path(greedy_run, "quick", method, 0.0)):
            assert answer.output_ids == vanilla[answer.question_id].output_ids
            assert answer.greedy_check["match"]


def test_rerun_resumes_without_doubling(tiny_models, greedy_run):
    path = answer_path(greedy_run, "quick", "pld", 0.0)
    lines = path.read_text().splitlines(keepends=True)
    # a run killed while writing: two answers lost, the last line cut in half
    path.write_text("".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])
    run(config(tiny_models, greedy_run))
    ids = line_ids(path)
    assert sorted(ids) == sorted(json.loads(line)["question_id"] for line in lines)
    assert len(ids) == len(set(ids))
    for method in ("vanilla", "sps"):
        assert len(line_ids(answer_path(greedy_run, "quick", method, 0.0))) == 6


def test_resume_with_other_settings_is_refused(tiny_models, greedy_run):
    with pytest.raises(SpecbenchError, match="max_new_tokens"):
        run(config(tiny_models, greedy_run, max_new_tokens=8))


def test_a_busy_machine_is_warned_of_only_when_the_run_times_something(
    tiny_models, greedy_run, tmp_path, monkeypatch, capsys
):
    """A resumed run whose answers are all written times nothing: no warning that the machine is too busy to time."""
    from specbench.run import runner

    machine = json.loads((greedy_run / "manifest.json").read_text())["machine"]
    handed = []

    class BusyPool:  # what `_drive` asks of a pool, on a machine kept busy by others; nothing loaded
        def __init__(self, *args) -> None:
            pass

        def infos(self) -> list[dict]:
            return [{"machine": {**machine, "busy_cpus": machine["cpu_count"]}, "device": "cpu", "dtype": "float32"}]

        def check(self, units) -> None:
            pass

        def answers(self, units, bar):
            handed.extend(units)
            return iter([])

        def close(self) -> None:
            pass

    monkeypatch.setattr(runner, "LocalPool", BusyPool)
    out = tmp_path / "run"
    shutil.copytree(greedy_run, out)
    capsys.readouterr()
    run(config(tiny_models, out))
    assert not handed and "busy" not in capsys.readouterr().err
    path = answer_path(out, "quick", "pld", 0.0)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))  # one answer left to time
    run(config(tiny_models, out))
    assert len(handed) == 1 and "other processes keep" in capsys.readouterr().err


def test_sampling_run_records_seeds(tiny_models, tmp_path):
    out = run(config(tiny_models, tmp_path, methods=["sps"], temperatures=[1.0], limit=1))
    answers = read_file(answer_path(out, "quick", "sps", 1.0))
    assert len(answers) == 6 and all(a.seed is not None and a.greedy_check is None for a in answers)


def test_methods_interleave_per_question_in_rotated_order(tiny_models, tmp_path, monkeypatch):
    """Each question runs every method back to back, the order rotating by one per question; the A/A column
    (vanilla timed again) is part of the rotation, matches vanilla token for token and shares its warm-up. The GPU's
    clock is brought up before the manifest reads it (and the forward profile runs), after the profile's capturing
    round, and again before the first timed answer."""
    from specbench.run import profiling, runner, session, worker

    calls = []
    answer_batch = session.Session.answer_batch

    def spy(self, method, target, drafting, questions, *args):
        calls.append((questions[0].id, method))
        return answer_batch(self, method, target, drafting, questions, *args)

    monkeypatch.setattr(session.Session, "answer_batch", spy)
    for module in (worker, profiling):
        monkeypatch.setattr(module, "warm_gpu", lambda device: calls.append(("warm", device.type)))
    out = run(config(tiny_models, tmp_path))
    assert [i for i, call in enumerate(calls) if call[0] == "warm"] == [0, 1, 5]  # info, forward profile, 3 warm-ups
    calls = [call for call in calls if call[0] != "warm"]
    by_question: dict = {}
    for qid, method in calls:
        by_question.setdefault(qid, []).append(method)
    first, *rest = by_question.values()
    assert sorted(first[:3]) == ["pld", "sps", "vanilla"]  # the first question's warm-ups, one a proposer
    orders = [first[3:], *rest]
    assert all(sorted(o) == ["pld", "sps", "vanilla", "vanilla"] for o in orders)  # vanilla twice: the A/A column
    assert len({tuple(o) for o in orders}) == 4, "the order rotates per question"
    aa = read_file(answer_path(out, "quick", runner.AA, 0.0))
    assert len(aa) == 6 and all(a.greedy_check["match"] for a in aa)
    recorded = {
        (a.position, a.question_id, a.method): a.order
        for m in ("vanilla", "sps", "pld", runner.AA)
        for a in read_file(answer_path(out, "quick", m, 0.0))
    }
    for position, qid in enumerate(by_question):  # each answer says where it ran
        timed = orders[position]
        assert {m: recorded[position, qid, m] for m in ("sps", "pld")} == {m: timed.index(m) for m in ("sps", "pld")}
        assert sorted([recorded[position, qid, "vanilla"], recorded[position, qid, runner.AA]]) == [
            i for i, m in enumerate(timed) if m == "vanilla"
        ]


def test_a_run_killed_inside_a_question_writes_none_of_it(tiny_models, tmp_path, monkeypatch):
    from specbench.run import session

    answer_batch = session.Session.answer_batch
    seen = []

    def dies_on_the_third_question(self, method, target, drafting, questions, *args):
        seen.append(questions[0].id)
        if len(set(seen)) == 3 and method == "pld":
            raise KeyboardInterrupt
        return answer_batch(self, method, target, drafting, questions, *args)

    monkeypatch.setattr(session.Session, "answer_batch", dies_on_the_third_question)
    with pytest.raises(KeyboardInterrupt):
        run(config(tiny_models, tmp_path, warmup=False, noise_floor=False))
    counts = {m: len(line_ids(answer_path(tmp_path, "quick", m, 0.0))) for m in ("vanilla", "sps", "pld")}
    assert counts == {"vanilla": 2, "sps": 2, "pld": 2}, "the interrupted question left no partial answers"
    monkeypatch.setattr(session.Session, "answer_batch", answer_batch)
    run(config(tiny_models, tmp_path, warmup=False, noise_floor=False))
    for method in ("vanilla", "sps", "pld"):
        ids = line_ids(answer_path(tmp_path, "quick", method, 0.0))
        assert len(ids) == 6 and len(set(ids)) == 6


@pytest.mark.parametrize("batch", [1, 2])
def test_repeats_keep_the_median_timing(tiny_models, tmp_path, monkeypatch, batch):
    """Each method decodes its unit (a question; at batch 2 the task's questions) `repeats` times, and keeps the
    median-time decode's answers."""
    from specbench.run import session

    answer_batch = session.Session.answer_batch
    walls = iter([3.0, 1.0, 2.0] * 100)  # the three repeats of each answer take 3 s, 1 s and 2 s

    def timed(self, *args):
        answered, _ = answer_batch(self, *args)
        wall = next(walls)
        for gens, _, _ in answered:
            for g in gens:
                g.wall_time = wall / len(gens)
        return answered, wall

    monkeypatch.setattr(session.Session, "answer_batch", timed)
    from specbench.run import runner

    doing = []
    monkeypatch.setattr(runner, "_doing", lambda bar, unit, what: doing.append((unit, what)))
    cfg = config(tiny_models, tmp_path, methods=["vanilla"], warmup=False, noise_floor=False, repeats=3, batch=[batch])
    out = run(cfg)
    label = "question 1" if batch == 1 else "6 questions at batch 2"  # the bar: the unit, then each decode's round
    assert (f"quick T=0 {label}", "vanilla, round 2 of 3") in doing and len(doing) == 3 * (6 if batch == 1 else 1)
    answers = read_file(answer_path(out, "quick", "vanilla", 0.0, batch))
    assert len(answers) == 6 and all(sum(a.wall_time) == pytest.approx(2.0) for a in answers)
    with pytest.raises(SpecbenchError, match="repeats"):
        run(config(tiny_models, tmp_path, methods=["vanilla"], repeats=1))  # resuming with other settings


def test_repeats_that_differ_in_tokens_are_named(tiny_models, tmp_path, monkeypatch, capsys):
    """A question whose tokens differ between a batch's repeats (nondeterministic kernels) gets a warning naming it;
    the others none."""
    from specbench.run import session

    answer_batch, calls = session.Session.answer_batch, []

    def drifting(self, *args):
        answered, wall = answer_batch(self, *args)
        calls.append(1)
        if len(calls) == 2:  # the second repeat: the last question's first turn ends one token later
            answered[-1].generations[0].tokens.append(3)  # (the last question: id 11)
        return answered, wall

    monkeypatch.setattr(session.Session, "answer_batch", drifting)
    cfg = config(tiny_models, tmp_path, methods=["vanilla"], warmup=False, noise_floor=False, repeats=2, batch=[2])
    run(cfg)
    warned = [line for line in capsys.readouterr().err.splitlines() if "different tokens" in line]
    assert len(warned) == 1 and "repeats of question 11 " in warned[0], warned


def test_a_worker_sets_what_it_loaded_aside_from_the_collector_while_it_runs(tiny_models, tmp_path, monkeypatch):
    """The full collection before each timed decode walks only what decoding made, not the imports, models and
    proposers (a fifth of a second a decode otherwise); the run's end gives them back to the collector."""
    from specbench.run import session

    answer_batch, frozen = session.Session.answer_batch, []

    def counted(self, *args):
        frozen.append(gc.get_freeze_count())
        return answer_batch(self, *args)

    monkeypatch.setattr(session.Session, "answer_batch", counted)
    run(config(tiny_models, tmp_path, methods=["vanilla"], warmup=False, noise_floor=False))
    assert frozen and min(frozen) > 100_000  # torch's, transformers' and the models' objects
    assert gc.get_freeze_count() == 0


def test_cross_request_methods_never_see_their_own_earlier_answer(tiny_models, tmp_path, monkeypatch):
    """suffix keeps a run's earlier answers, but the warm-up and each repeat of a question decode exactly as
    the first time: their own earlier answers are evicted, not drafted from."""
    from specbench.run import session

    answer_batch = session.Session.answer_batch
    steps: dict = {}

    def spy(self, method, target, drafting, questions, *args):
        answered, wall = answer_batch(self, method, target, drafting, questions, *args)
        if method == "suffix":
            for question, (gens, _, _) in zip(questions, answered, strict=True):
                steps.setdefault(question.id, []).append([g.accept_lengths for g in gens])
        return answered, wall

    monkeypatch.setattr(session.Session, "answer_batch", spy)
    run(config(tiny_models, tmp_path, methods=["vanilla", "suffix"], noise_floor=False, repeats=2))
    assert len(steps) == 6 and sum(len(calls) for calls in steps.values()) == 6 * 2 + 1  # one warm-up
    for calls in steps.values():  # (the warm-up decodes a first turn)
        assert all(call == calls[-1][: len(call)] for call in calls), calls


def test_the_manifest_names_the_code_that_ran(greedy_run, tmp_path):
    """The source digest identifies the package's code and presets where a checkout's commit is stale or missing: it
    changes with any file's content or name."""
    machine = json.loads((greedy_run / "manifest.json").read_text())["machine"]
    assert machine["source_digest"] == source_digest() and len(machine["source_digest"]) == 16
    code, presets = tmp_path / "code", tmp_path / "presets"
    (code / "sub").mkdir(parents=True)
    presets.mkdir()
    (code / "sub" / "a.py").write_text("x = 1\n")
    (presets / "m.yaml").write_text("implementation: m\n")
    first = files_digest(code, presets)
    (code / "sub" / "a.py").write_text("x = 2\n")
    second = files_digest(code, presets)
    (code / "sub" / "a.py").rename(code / "sub" / "b.py")
    assert len({first, second, files_digest(code, presets)}) == 3


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_warming_keeps_a_gpu_busy_and_leaves_a_cpu_alone(device):
    start = time.perf_counter()
    warm_gpu(torch.device(device), seconds=0.3)
    took = time.perf_counter() - start
    assert took >= 0.3 if device == "cuda" else took < 0.05
