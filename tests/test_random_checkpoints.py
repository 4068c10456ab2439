"""scripts/random_checkpoints.py at miniature shapes: every checkpoint loads through the official-layout loaders and
`specbench run --methods all` answers with each method, greedy outputs identical to vanilla's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specbench.cli.main import main

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "random_checkpoints.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("random_checkpoints", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_checkpoints_run_every_method(script, tmp_path, monkeypatch):
    small = dict(
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=9000,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )
    monkeypatch.setitem(
        script.SHAPES,
        "mini",
        {
            "target": dict(small, hidden_size=64, num_hidden_layers=6),
            "draft": dict(small, hidden_size=32, num_hidden_layers=1),
        },
    )
    monkeypatch.setattr(script, "EAGLE3_DRAFT_VOCAB", 4000)  # a reduced draft vocabulary: d2t and t2d written
    folders = script.write_random("mini", tmp_path / "ck", torch.device("cpu"), torch.float32)
    assert set(folders) == {"target", "draft", "eagle", "eagle3", "medusa", "mtp", "dflash", "pard"}
    assert json.loads((folders["eagle3"] / "config.json").read_text())["draft_vocab_size"] == 4000
    out = tmp_path / "run"
    code = main(
        [
            "run",
            *script.run_options(folders).split(),
            "--methods",
            "all",
            "--tasks",
            "quick",
            "--limit",
            "1",
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
            "--no-report",
            "--no-noise-floor",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    answered = {p.name.split("-temperature")[0] for p in (out / "answers" / "quick").glob("*.jsonl")}
    assert {"vanilla", "sps", "eagle", "eagle2", "eagle3", "medusa", "mtp", "dflash", "pard"} <= answered
    for path in (out / "answers" / "quick").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            check = json.loads(line)["specbench"]["greedy_check"]
            assert check is None or check["match"] or check["near_tie"], (path.name, check)


def test_unknown_shapes_are_one_line(script, tmp_path):
    from specbench.errors import SpecbenchError

    with pytest.raises(SpecbenchError, match="no shapes for 'gpt-5'"):
        script.write_random("gpt-5", tmp_path, torch.device("cpu"))
