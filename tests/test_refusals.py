"""Refusals in a second: a path the command line names that cannot serve (a head folder without config.json, a lock
file that is not there, a corrupt speculators config, a `convert --out` that holds files, ...) is refused as a new
user meets it, by a fresh `python -m specbench.cli`: a non-zero exit and one line naming the input, before torch or
transformers is imported (`-X importtime` lists every import), within 1.5 s on an idle machine. The machine may be
busy (other tests, other people): the bound grows with the time a bare `import specbench.cli` takes now over its
idle time, so a slow refusal fails and a slow machine does not."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specbench.cli.main import main
from specbench.zoo import TINY_DIR

LIMIT = 1.5  # seconds a refusal may take on an idle machine
IDLE_IMPORT = 0.5  # seconds `python -c "import specbench.cli"` takes on an idle machine (about 0.3 measured)
HEAVY = ("torch", "transformers")


def _wall(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    return done, time.perf_counter() - start


def refuse(args: list[str], names: str) -> str:
    """Run `specbench ARGS` in a fresh process; assert a refusal as the module says; return its line."""
    _, reference = _wall(["-c", "import specbench.cli"])
    done, took = _wall(["-X", "importtime", "-m", "specbench.cli", *args])
    imports = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    heavy = [m for m in HEAVY if any(line.split("|")[-1].strip() == m for line in imports)]
    assert done.returncode != 0, done.stdout
    assert heavy == [], f"{' '.join(args)}: imported {heavy} before refusing"
    assert len(lines) == 1 and lines[0].startswith("specbench: error: "), lines
    assert names in lines[0]
    limit = LIMIT * max(1.0, reference / IDLE_IMPORT)
    assert took < limit, f"{' '.join(args)}: {took:.2f} s (limit {limit:.2f} s; bare import {reference:.2f} s)"
    return lines[0].removeprefix("specbench: error: ")


@pytest.fixture
def weights_only(tmp_path) -> Path:
    """A head folder with weights and no config.json."""
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def speculators_folder(tmp_path: Path, config: str) -> Path:
    folder = tmp_path / "speculators"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--methods", "eagle3", "--dry-run"],
        ["run", "--methods", "eagle3"],
        ["lock", "--methods", "eagle3"],
        ["verify", "--method", "eagle3"],
        ["tune", "--method", "eagle3"],
    ],
)
def test_a_head_folder_without_config_json(weights_only, command):
    line = refuse([*command, "--head", f"eagle3={weights_only}"], f"eagle3 head '{weights_only}'")
    assert "has no config.json" in line


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--head", "eagle3={missing}"], "eagle3 head '{missing}' does not exist"),
        (["--head", "{missing}"], "head '{missing}' does not exist"),
        (["--methods", "sps", "--draft", "{missing}"], "draft '{missing}' does not exist"),
        (["--lock", "{missing}"], "cannot read lock file {missing}"),
        (["--data-dir", "{missing}"], "--data-dir {missing} is not a folder"),
        (["--tuned", "{missing}"], "no tuned presets in {missing}"),
    ],
)
def test_a_run_path_that_is_not_there(tmp_path, args, names):
    missing = str(tmp_path / "missing")
    refuse(["run", *(a.format(missing=missing) for a in args), "--dry-run"], names.format(missing=missing))


def test_an_empty_head_folder_lacks_its_weights(tmp_path):
    refuse(["run", "--methods", "eagle3", "--head", f"eagle3={tmp_path}", "--dry-run"], "has none of")


@pytest.mark.parametrize("option", ["--head eagle3={}", "--model {}"])
def test_a_checkpoint_whose_config_is_not_json(tmp_path, option):
    folder = speculators_folder(tmp_path, "{not json")
    flag, value = option.format(folder).split()
    refuse(["run", flag, value, "--dry-run"], f"'{folder}': unreadable config.json")


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("{not json", "unreadable config.json"),
        ("[1, 2]", "config.json is not a JSON object"),
        (
            json.dumps({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "qwen2"}}),
            "transformer_layer_config",
        ),
        (json.dumps({"speculators_model_type": "mlp"}), "a speculators 'mlp' checkpoint"),
    ],
)
def test_a_corrupt_speculators_config(tmp_path, config, says):
    folder = speculators_folder(tmp_path, config)
    line = refuse(["convert", str(folder), "--to", "official", "--out", str(tmp_path / "out")], f"'{folder}'")
    assert says in line and not (tmp_path / "out").exists()


def test_convert_of_a_folder_that_is_not_there(tmp_path):
    refuse(["convert", str(tmp_path / "missing"), "--to", "speculators", "--out", str(tmp_path / "out")], "missing")


def test_convert_into_a_folder_that_holds_files_refuses_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = refuse(["convert", str(TINY_DIR / "eagle3"), "--to", "speculators", "--out", str(out)], f"--out {out}")
    assert "--force" in line
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["notes.txt"]


def test_convert_force_replaces_what_the_folder_holds(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["convert", str(TINY_DIR / "eagle3"), "--to", "speculators", "--out", str(out)]
    assert main([*args, "--force"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (TINY_DIR / "eagle3").iterdir())
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*args[:-1], str(empty)]) == 0  # an empty folder needs no --force


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["train", "eagle", "--data", "{missing}", "--out", "{tmp}/head"], "training data '{missing}'"),
        (["train", "eagle", "--target", "{missing}", "--data", "{tmp}", "--out", "{tmp}/head"], "'{missing}'"),
        (["train", "pard", "--draft", "{missing}", "--data", "{tmp}", "--out", "{tmp}/head"], "'{missing}' does not"),
        (["token-counts", "--data", "{tmp}", "--out", "{missing}"], "--out {missing} is not a folder"),
        (["token-counts", "--data", "{missing}", "--out", "{tmp}"], "training data '{missing}'"),
        (["regenerate", "--prompts", "{missing}", "--out", "{tmp}/text.jsonl"], "prompts '{missing}'"),
        (["zoo", "build", "--data-dir", "{missing}", "--out", "{tmp}/family"], "--data-dir {missing}"),
        (["zoo", "card", "--measure", "--data-dir", "{missing}", "--out", "{tmp}"], "--data-dir {missing}"),
        (
            ["zoo", "build", "--continue", "--draft-text", "{missing}", "--data-dir", "{tmp}", "--out", "{tmp}"],
            "--draft-text '{missing}'",
        ),
        (["zoo", "build", "--continue", "--data-dir", "{tmp}", "--out", "{tmp}"], "{tmp} holds no trained tiny family"),
        (["zoo", "card", "--measure", "--data-dir", "{tmp}", "--out", "{tmp}"], "{tmp} holds no trained tiny family"),
    ],
)
def test_a_training_path_that_is_not_there(tmp_path, args, names):
    given = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    refuse([a.format(**given) for a in args], names.format(**given))
