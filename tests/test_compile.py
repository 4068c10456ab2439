"""`run --compile` puts the target's decoder, the draft's and the heads through torch.compile (here recorded, not
compiled: compiling costs minutes on a CPU) and the manifest says so."""

import json

import torch

from specbench import models
from specbench.cli import main


def test_compile_flag_reaches_target_draft_and_manifest(capsys, tiny_models, tmp_path, monkeypatch):
    compiled = []

    def record(fn, **kwargs):
        compiled.append((getattr(fn, "__self__", None), kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    target, draft = tiny_models
    out = tmp_path / "run"
    args = ["--methods", "sps", "--limit", "1", "--max-new-tokens", "4", "--no-report", "--no-noise-floor"]
    code = main(["run", "--model", str(target), "--draft", str(draft), *args, "--compile", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    owners = [type(owner).__name__ for owner, _ in compiled]
    assert owners == ["LlamaModel", "LlamaModel"]  # the target's decoder stack, then the draft's
    assert all(kwargs == {"dynamic": True} for _, kwargs in compiled)
    assert json.loads((out / "manifest.json").read_text())["config"]["compile"] is True


def test_compile_forward_wraps_a_head_without_a_decoder(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: ("compiled", fn))
    head = torch.nn.Linear(2, 2)
    assert models.compile_forward(head).forward[0] == "compiled"
