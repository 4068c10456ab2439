"""`run --workers 2 --ray-address` on a real multi-node Ray cluster on this machine (Ray's own test cluster, every
node bound to 127.0.0.1): a worker node killed mid-run, its question answered on another node, nothing lost or
doubled, the tokens of one process, and the run folder and its report naming the node that answered each answer;
and with no spare node, the run failing in one line naming the dead node once its replacement found no room, what
was written kept. Also, without Ray, the report's account of which node answered what."""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from specbench.cli.main import main
from specbench.report.build import build_report
from specbench.results import Answer, read_answers, read_file

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason='Ray is not installed: pip install "specbench[ray]"'
)

RUN = [
    "run",
    "--model",
    "tiny",
    "--methods",
    "vanilla,sps",
    "--limit",
    "1",
    "--max-new-tokens",
    "12",
    "--no-noise-floor",
    "--no-warmup",
    "--no-report",
]
ANSWERS = 12  # the quick task's 6 questions (one per category) x 2 methods
CLI = [sys.executable, "-c", "from specbench.cli import main; raise SystemExit(main())"]
NODE = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}  # Ray's least store is 75 MiB
# A frozen node misses the GCS's health checks: three missed in a row (2 s each, a second apart) mark it dead, where
# Ray's defaults take up to a minute; a live node would have to stall for 2 s three times running to be taken for dead.
HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 3,
}


def _cluster(monkeypatch, nodes: int):
    """A head node of no CPUs (the driver attaches there) and `nodes` worker nodes of one CPU each. Ray keeps its
    files, and the address a bare `ray.init()` would join, in a folder of its own, so a local Ray started meanwhile
    elsewhere on this machine never joins this cluster."""
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths under it must fit in 107 characters
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=0, include_dashboard=False, _system_config=HEALTH, **NODE)
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, **NODE)
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def cluster(monkeypatch):
    """Three worker nodes: two workers and the spare that takes a killed node's place."""
    yield from _cluster(monkeypatch, 3)


@pytest.fixture
def full_cluster(monkeypatch):
    """Two worker nodes: two workers, and no room for a replacement."""
    yield from _cluster(monkeypatch, 2)


def _wait_for(condition, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)
    return found


def _written_by(run_dir: Path) -> Counter:
    """Node id -> answers on disk so far (a line being written is not read)."""
    return Counter(a.node["id"] for path in run_dir.glob("answers/*/*.jsonl") for a in read_file(path))


def _processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process now."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                found[int(proc.name)] = parent, (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return found


def _raylet(node) -> int:
    return node.all_processes["raylet"][0].process.pid


def _answering(node) -> bool:
    """Whether one of the node's Ray workers (its raylet's children) is inside `Worker.answer` now: Ray titles a
    worker process by the method it runs, from its call until it returns."""
    raylet = _raylet(node)
    return any(parent == raylet and b"Worker.answer" in cmdline for parent, cmdline in _processes().values())


def _freeze_a_busy_node(cluster, out: Path, proc: subprocess.Popen, log: Path):
    """A node that has answered a question and is answering another, stopped (SIGSTOP) in the middle: it falls
    silent at once, as a machine that lost power, and the driver learns of it only from the GCS, which marks it dead
    and places nothing there after. (Killed outright, its workers' closed connections could tell the driver first,
    and a replacement could be sent there before the GCS noticed.)"""
    assert proc.poll() is None, f"the run ended before a node was killed:\n{log.read_text()}"
    written = _written_by(out)
    for node in [n for n in cluster.worker_nodes if written[n.node_id] and _answering(n)]:
        _signal(node, signal.SIGSTOP)
        if _answering(node):  # still: its question did not come back just before
            return node
        _signal(node, signal.SIGCONT)
    return None


def _kill_a_busy_node(cluster, out, proc, log, frozen=lambda node: None):
    """Freeze a node mid-answer (`frozen` told which), wait for the run to retry its question, then kill it and
    wait for the run to end (killed itself if it outlives the test)."""
    try:
        victim = _wait_for(lambda: _freeze_a_busy_node(cluster, out, proc, log))
        frozen(victim)
        _wait_for(lambda: "retrying" in log.read_text())
        _signal(victim, signal.SIGKILL)
        cluster.remove_node(victim, allow_graceful=False)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    return victim


def _signal(node, sig: int) -> None:
    """`sig` to the node's raylet and its Ray workers."""
    raylet = _raylet(node)
    for pid in [raylet, *(pid for pid, (parent, _) in _processes().items() if parent == raylet)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


@needs_ray
@pytest.mark.skipif(sys.platform != "linux", reason="finds the node mid-answer through /proc")
def test_a_replacement_with_no_room_fails_the_run_in_one_line_naming_the_node(full_cluster, tmp_path):
    """SPECBENCH_PLACEMENT_TIMEOUT=0: the replacement has the time the first workers took to start, while the worker
    left answers a task long enough to outlast it."""
    task, out, log = tmp_path / "many.jsonl", tmp_path / "cluster", tmp_path / "stderr"
    task.write_text("".join(json.dumps({"question": f"Count to {n}.", "category": "c"}) + "\n" for n in range(200)))
    run = [*RUN, "--tasks", str(task), "--limit", "200", "--workers", "2", "--ray-address", full_cluster.address]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "SPECBENCH_PLACEMENT_TIMEOUT": "0"}
    with log.open("w") as stderr:
        proc = subprocess.Popen([*CLI, *run, "--out", str(out)], env=env, stderr=stderr)
    victim = _kill_a_busy_node(full_cluster, out, proc, log)
    err = log.read_text()
    errors = [line for line in err.splitlines() if line.startswith("specbench: error: ")]
    assert proc.returncode == 2 and len(errors) == 1, err
    assert f"({victim.node_id[:8]})" in errors[0] and "no room (1 CPU)" in errors[0] and "--workers 1" in errors[0]
    answers = read_answers(out)
    keys = [(a.method, a.question_id) for a in answers]
    assert 0 < len(keys) == len(set(keys)) < 400  # what was written stays, once each, for the same command to resume


@needs_ray
@pytest.mark.skipif(sys.platform != "linux", reason="finds the node mid-answer through /proc")
def test_a_killed_node_is_replaced_and_each_answer_names_its_node(cluster, tmp_path):
    one, out = tmp_path / "one", tmp_path / "cluster"
    assert main([*RUN, "--out", str(one)]) == 0
    reference = {(a.method, a.question_id): a.output_ids for a in read_answers(one)}
    # Ray turns a loopback address into this machine's outward IP, where these nodes do not listen; its switch for
    # one-machine platforms keeps the driver on 127.0.0.1.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    log = tmp_path / "stderr"
    with log.open("w") as stderr:  # a file, not a pipe: nobody reads a pipe while the test waits
        proc = subprocess.Popen(
            [*CLI, *RUN, "--workers", "2", "--ray-address", cluster.address, "--out", str(out)], env=env, stderr=stderr
        )
    written: list[int] = []
    victim = _kill_a_busy_node(cluster, out, proc, log, lambda node: written.append(_written_by(out)[node.node_id]))
    before = written[0]
    err = log.read_text()
    assert proc.returncode == 0, err
    retried = re.findall(r"worker \d+ failed on question (\S+) \(its worker process died\); retrying", err)
    assert len(retried) == 1, err

    answers = read_answers(out)
    keys = [(a.method, a.question_id) for a in answers]
    assert len(keys) == len(set(keys)) == ANSWERS  # every answer once, none doubled by the retry
    assert {(a.method, a.question_id): a.output_ids for a in answers} == reference
    workers = {node.node_id for node in cluster.worker_nodes} | {victim.node_id}
    by_node = {a.node["id"] for a in answers}
    assert by_node <= workers and len(by_node) >= 2  # every answer names a worker node; more than one answered
    assert all(a.node["ip"] == "127.0.0.1" and a.node["worker"] in (1, 2) for a in answers)
    assert sum(a.node["id"] == victim.node_id for a in answers) == before  # kept, and nothing after it fell silent
    assert all(a.node["id"] != victim.node_id for a in answers if str(a.question_id) == retried[0])

    report = build_report([out], tmp_path / "report").read_text()
    section = report.split("## Which node answered what\n", 1)[1].split("\n## ", 1)[0]
    assert all(f"node `{node_id[:8]}`" in section for node_id in by_node)


def test_the_report_lists_each_nodes_answers_and_questions(tmp_path):
    """Sorted by host; a node's questions in order, the first 20 of them with the count after."""
    nodes = {
        "b": {"worker": 1, "id": "b" * 56, "ip": "10.0.0.2", "host": "gpu-02"},
        "a": {"worker": 2, "id": "a" * 56, "ip": "10.0.0.1", "host": "gpu-01"},
    }
    lines = []
    for qid in range(1, 24):
        node = nodes["b" if qid == 2 else "a"]
        for method, steps in (("vanilla", [1] * 8), ("sps", [3, 3, 2])):
            a = Answer(
                question_id=qid,
                category="qa",
                group="qa",
                method=method,
                temperature=0.0,
                model="tiny",
                task="quick",
                new_tokens=[8],
                wall_time=[0.1 if method == "vanilla" else 0.05],
                decoding_steps=[len(steps)],
                accept_lengths=steps,
                node=node,
            )
            lines.append(json.dumps(a.to_record("tiny")) + "\n")
    (tmp_path / "run" / "answers").mkdir(parents=True)
    (tmp_path / "run" / "answers" / "quick.jsonl").write_text("".join(lines))
    report = build_report([tmp_path / "run"], tmp_path / "report").read_text()
    section = report.split("## Which node answered what\n\n", 1)[1].split("\n\n", 1)[0]
    first = ", ".join(str(q) for q in [1, *range(3, 22)])
    assert section.splitlines() == [
        f"- run: node `aaaaaaaa` (gpu-01, 10.0.0.1), worker 2: 44 answers, questions {first}, … (22 in all)",
        "- run: node `bbbbbbbb` (gpu-02, 10.0.0.2), worker 1: 2 answers, questions 2",
    ]
