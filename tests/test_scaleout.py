"""`run --workers N` on a local Ray instance (the bundled tiny family, one thread per worker): the same answers as
one process, a killed driver resumed, nothing lost or doubled (a killed worker's question retried elsewhere:
test_multinode.py, where its whole node dies); and
one-line errors without Ray or without the CPUs/GPUs asked for."""

import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from specbench.cli.main import main
from specbench.results import read_answers

pytest.importorskip("ray", reason='Ray is not installed: pip install "specbench[ray]"')

RUN = [
    "run",
    "--model",
    "tiny",
    "--methods",
    "vanilla,sps,eagle2",
    "--limit",
    "1",
    "--max-new-tokens",
    "12",
    "--no-noise-floor",
    "--no-warmup",
    "--no-report",
]
CLI = [sys.executable, "-c", "from specbench.cli import main; raise SystemExit(main())"]


def tokens(run_dir: Path, batch: int = 1) -> dict:
    """(method, question) -> output ids at batch size `batch`; fails when an answer was written twice."""
    got = {}
    for a in (a for a in read_answers(run_dir) if a.batch_size == batch):
        key = (a.method, str(a.question_id))
        assert key not in got, f"{key} written twice"
        got[key] = a.output_ids
    return got


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: the same matrix in this process (one torch thread, as conftest sets)."""
    out = tmp_path_factory.mktemp("single")
    assert main([*RUN, "--out", str(out)]) == 0
    return tokens(out)


def test_two_workers_give_the_single_process_answers(single, tmp_path):
    """Batch 1's questions spread over both workers; batch 2's (one unit: the task's questions, every method) go to
    one, and keep their batch-1 tokens."""
    assert main([*RUN, "--workers", "2", "--batch", "1,2", "--out", str(tmp_path)]) == 0
    assert tokens(tmp_path, 1) == single and len(single) == 18  # 6 questions x 3 methods, the same greedy tokens
    assert tokens(tmp_path, 2) == single
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["workers"]) == 2 and all(w["torch_threads"] == 1 for w in manifest["workers"])
    nodes = {(a.node["id"], a.node["worker"]) for a in read_answers(tmp_path)}
    assert {worker for _, worker in nodes} == {1, 2} and len({node for node, _ in nodes}) == 1  # a local Ray
    from specbench.report.build import build_report

    report = build_report([tmp_path], tmp_path / "report").read_text()
    assert "## Which node answered what" not in report  # said of a run on more than one node only


def _wait_for(condition, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def _written(run_dir: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in run_dir.glob("answers/*/*.jsonl"))


def test_a_killed_driver_resumes(single, tmp_path):
    proc = subprocess.Popen([*CLI, *RUN, "--workers", "2", "--out", str(tmp_path)], stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _written(tmp_path) >= 4)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert 4 <= _written(tmp_path) < 18
    assert main([*RUN, "--workers", "2", "--out", str(tmp_path)]) == 0
    assert tokens(tmp_path) == single


def test_without_ray_workers_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    assert main([*RUN, "--workers", "2", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip()
    assert err.endswith('pip install "specbench[ray]"') and "\n" not in err


@pytest.mark.parametrize(
    ("resources", "extra", "message"),
    [
        ({"CPU": 2.0}, ["--workers", "3", "--threads", "1"], "needs 3 CPUs, the Ray cluster has 2"),
        ({"CPU": 8.0, "GPU": 1.0}, ["--workers", "2", "--device", "cuda"], "needs 2 GPUs, the Ray cluster has 1"),
        ({"CPU": 8.0}, ["--workers", "2", "--device", "cuda:1"], "use auto, cpu or cuda"),
    ],
)
def test_workers_the_cluster_cannot_hold_are_refused(monkeypatch, capsys, tmp_path, resources, extra, message):
    fake = types.SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: resources)
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert main([*RUN, *extra, "--out", str(tmp_path)]) != 0
    assert message in capsys.readouterr().err
