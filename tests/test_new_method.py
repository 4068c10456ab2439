"""A method added from outside the package: one module and one preset in a folder, registered through the public
registry (`SPECBENCH_METHODS`), runs, verifies and reports with no file of the project touched."""

from __future__ import annotations

import json
import sys

from specbench import presets, registry
from specbench.cli.main import main

MODULE = '''
"""repeat: proposes the root token k more times (a point-mass chain, so the exact rule keeps it lossless)."""

from specbench.methods.base import Proposal, Proposer
from specbench.registry import implementation
from specbench.tree import chain


class Repeat(Proposer):
    def __init__(self, length: int = 2) -> None:
        self.length = length

    def propose(self, tokens, max_depth):
        return Proposal(chain([tokens[-1]] * min(self.length, max_depth)))


@implementation("repeat")
def build(params, resources):
    return Repeat(**params)
'''

PRESET = """implementation: repeat
description: the root token proposed again (a toy method)
color: "#000000"
lossless: true
params:
  length: 3
"""


def test_a_method_from_a_plugin_folder_runs_verifies_and_reports(tmp_path, monkeypatch, capsys, tiny_models):
    folder = tmp_path / "my_methods"
    folder.mkdir()
    (folder / "repeat.py").write_text(MODULE)
    (folder / "repeat.yaml").write_text(PRESET)
    monkeypatch.setenv("SPECBENCH_METHODS", str(folder))
    monkeypatch.setattr(presets, "_EXTRA", {})
    monkeypatch.setattr(registry, "IMPLEMENTATIONS", dict(registry.IMPLEMENTATIONS))
    target, _ = tiny_models
    run = tmp_path / "run"
    argv = [
        "run",
        "--model",
        str(target),
        "--methods",
        "vanilla,repeat",
        "--limit",
        "1",
        "--max-new-tokens",
        "8",
        "--out",
        str(run),
    ]
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "answers" / "quick" / "repeat-temperature-0.jsonl").open()]
    assert len(rows) == 6 and all(r["specbench"]["greedy_check"]["match"] for r in rows)
    assert "repeat" in (run / "report" / "report.md").read_text()
    capsys.readouterr()
    argv = [
        "verify",
        "--method",
        "repeat",
        "--model",
        str(target),
        "--limit",
        "1",
        "--max-new-tokens",
        "8",
        "--samples",
        "300",
        "--horizon",
        "2",
        "--prompts",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "greedy: 6/6 questions token-identical" in out and "verdict: pass" in out
    assert main(["list", "methods"]) == 0
    assert "the root token proposed again" in capsys.readouterr().out


BATCHED = '''
"""repeat_all: `repeat` written for a whole batch: one Drafter for every slot."""

from specbench.methods import Drafter, Proposal
from specbench.registry import implementation
from specbench.tree import chain


class RepeatAll(Drafter):
    learns = False

    def __init__(self, slots: int, length: int = 2) -> None:
        self.slots, self.length = slots, length

    def propose(self, slots, tokens, max_depths):
        assert all(0 <= s < self.slots for s in slots)
        return [Proposal(chain([t[-1]] * min(self.length, d))) for t, d in zip(tokens, max_depths)]


@implementation("repeat_all", batched=True)
def build(params, resources, slots):
    return RepeatAll(slots, **params)
'''


def test_plugins_for_one_sequence_and_for_a_batch_run_at_batch_4(tmp_path, monkeypatch, capsys, tiny_models):
    """A one-sequence plug-in (adapted once, at the edge) and a plug-in Drafter for the whole batch answer four
    questions at a time, each answer token-identical to vanilla's at the same batch size."""
    folder = tmp_path / "my_methods"
    folder.mkdir()
    (folder / "repeat.py").write_text(MODULE)
    (folder / "repeat.yaml").write_text(PRESET)
    (folder / "repeat_all.py").write_text(BATCHED)
    (folder / "repeat_all.yaml").write_text(PRESET.replace("implementation: repeat", "implementation: repeat_all"))
    for name in ("repeat", "repeat_all"):  # (imported again: registered into this test's registry)
        monkeypatch.delitem(sys.modules, f"specbench_user_methods.{name}", raising=False)
    monkeypatch.setenv("SPECBENCH_METHODS", str(folder))
    monkeypatch.setattr(presets, "_EXTRA", {})
    monkeypatch.setattr(registry, "IMPLEMENTATIONS", dict(registry.IMPLEMENTATIONS))
    target, _ = tiny_models
    run = tmp_path / "run"
    argv = ["run", "--model", str(target), "--methods", "vanilla,repeat,repeat_all", "--batch", "4", "--limit", "1"]
    argv += ["--max-new-tokens", "8", "--no-report", "--no-noise-floor", "--no-warmup", "--out", str(run)]
    assert main(argv) == 0, capsys.readouterr().err
    for name in ("repeat", "repeat_all"):
        rows = [json.loads(line) for line in (run / "answers" / "quick" / f"{name}-temperature-0-batch-4.jsonl").open()]
        assert len(rows) == 6 and all(r["specbench"]["greedy_check"]["match"] for r in rows), name
        assert max(size for r in rows for size in r["specbench"]["tree_size"]) == 4  # (its drafts were verified)


def test_a_missing_plugin_folder_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECBENCH_METHODS", str(tmp_path / "nowhere"))
    monkeypatch.setattr(presets, "_EXTRA", {})
    assert main(["list", "methods"]) == 2
    assert "method folder" in capsys.readouterr().err


def test_the_plug_in_api_keeps_its_names():
    """What a method folder outside the package imports: from `specbench.methods`, and under the earlier names
    `specbench.methods.base` and `specbench.tree`, the same objects as the core's."""
    from specbench import methods, tree
    from specbench.core import proposer
    from specbench.core import tree as core_tree
    from specbench.methods import base

    names = ("Proposer", "Proposal", "Feedback", "Turn", "NO_PROPOSAL", "Nested", "chain_prefix", "tree_prefix")
    for name in names:
        assert getattr(methods, name) is getattr(proposer, name) is getattr(base, name), name
    assert methods.Drafter is proposer.Drafter is base.Drafter  # (a method drafting for a whole batch)
    assert methods.implementation is registry.implementation
    for name in ("Tree", "chain", "trie", "EMPTY", "from_choices", "attention_mask", "position_ids"):
        assert getattr(tree, name) is getattr(core_tree, name), name
