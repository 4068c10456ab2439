"""`run --compile` puts the target's decoder, the draft's and the heads through torch.compile (here recorded, not
compiled: compiling costs minutes on a CPU) and the manifest says so."""

import json

import torch

from specbench.cli.main import main
from specbench.models import loading as models
from specbench.run import worker


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


def test_graphs_with_compile_compiles_what_it_captures(capsys, tmp_path, monkeypatch):
    """`--graphs --compile`: the target's and the draft's owned decoders (whole on a CPU, where nothing is
    captured; layer by layer on a GPU), once each, and EAGLE-2's drafting step go through torch.compile (dynamic
    shapes)."""
    compiled = []

    def record(fn, **kwargs):
        compiled.append((getattr(fn, "__self__", None), getattr(fn, "__name__", None), kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    out = tmp_path / "run"
    args = ["--methods", "sps,eagle2", "--limit", "1", "--max-new-tokens", "4", "--no-report", "--no-noise-floor"]
    assert main(["run", *args, "--graphs", "--compile", "--out", str(out)]) == 0, capsys.readouterr().err
    names = [(type(owner).__name__, name) for owner, name, _ in compiled]
    assert names[:2] == [("Decoder", "forward"), ("Decoder", "forward")]  # the target's, then the draft's
    assert names.count(("Decoder", "forward")) == 2  # once per run: every method verifies on the one target
    assert ("StaticDrafting", "_draft") in names
    assert all(kwargs == {"dynamic": True} for _, _, kwargs in compiled)
    config = json.loads((out / "manifest.json").read_text())["config"]
    assert config["compile"] is True and config["graphs"] is True


def test_compile_forward_wraps_a_head_without_a_decoder(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: ("compiled", fn))
    head = torch.nn.Linear(2, 2)
    assert models.compile_forward(head).forward[0] == "compiled"


def test_a_timed_decode_that_compiled_is_timed_again(capsys, tiny_models, tmp_path, monkeypatch):
    """Under --compile a decode during which a new graph was built timed the compiler: it is run again, up to
    RETIMES more times, with a warning when it still compiles."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    decodes, graphs = [], [0]
    real = worker.Worker._decode

    def decode(self, name, unit, target, questions, seeds):
        decodes.append((name, questions[0].id))
        if name == compiling[0]:
            graphs[0] += 1  # this method's decodes always build a new graph
        return real(self, name, unit, target, questions, seeds)

    monkeypatch.setattr(worker.Worker, "_decode", decode)
    monkeypatch.setattr(worker, "compiled_graphs", lambda: graphs[0])
    target, draft = tiny_models
    args = [
        "--model",
        str(target),
        "--draft",
        str(draft),
        "--methods",
        "vanilla,sps",
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
        "--no-report",
        "--no-noise-floor",
        "--no-warmup",
        "--tasks",
        "quick",
    ]
    compiling = ["sps"]
    assert main(["run", *args, "--compile", "--out", str(tmp_path / "a")]) == 0
    questions = {q for _, q in decodes}
    assert sum(n == "vanilla" for n, _ in decodes) == len(questions)  # compiled nothing: timed once
    assert sum(n == "sps" for n, _ in decodes) == len(questions) * (1 + worker.RETIMES)
    assert "sps still compiled new graphs" in capsys.readouterr().err
    decodes.clear()
    compiling = ["none"]
    assert main(["run", *args, "--compile", "--out", str(tmp_path / "b")]) == 0
    assert len(decodes) == 2 * len(questions)
    assert "compiled new graphs" not in capsys.readouterr().err
