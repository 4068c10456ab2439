"""Method and task presets are read into typed objects: a misspelt key or a wrong type is one line naming the
file and the key, before anything runs."""

import pytest

from specbench import methods, presets, tasks
from specbench.errors import SpecbenchError


def test_every_bundled_preset_validates():
    for name in presets.names("methods"):
        assert isinstance(presets.load("methods", name), presets.MethodPreset)
    for name in presets.names("tasks"):
        spec = presets.load("tasks", name)
        assert (spec.source is None) != (spec.questions is None), name


def test_each_method_family_has_a_colour_of_its_own():
    specs = {name: presets.load("methods", name) for name in presets.names("methods")}
    colors = [spec.color for spec in specs.values() if spec.color]
    assert len(colors) == len(set(colors))
    families = {spec.implementation or name for name, spec in specs.items()}  # an engine's own method: itself
    assert families <= {name for name, spec in specs.items() if spec.color}


@pytest.mark.parametrize(
    "text, message",
    [
        ("implementation: pld\nparam:\n  k: 1\n", r"unknown key 'param' \(allowed: implementation, description"),
        ("implementation: pld\nlossless: maybe\n", "key 'lossless': Input should be a valid boolean"),
        ("implementation: pld\nparams: [1, 2]\n", "key 'params': Input should be a valid dictionary"),
        ("description: no implementation\n", "key 'implementation' is missing"),
        ("- implementation: pld\n", "a preset is a mapping"),
        ("implementation: pld\n  bad: [indent\n", "not readable YAML"),
        ("implementation: pld\ncolor: red\n", "key 'color': String should match pattern"),
    ],
    ids=["unknown", "type", "params", "missing", "list", "yaml", "color"],
)
def test_bad_method_presets_name_the_file_and_key(tmp_path, monkeypatch, text, message):
    folder = tmp_path / "own"
    folder.mkdir()
    (folder / "broken-preset.yaml").write_text(text)
    monkeypatch.setitem(presets._EXTRA, "methods", [folder])
    with pytest.raises(SpecbenchError, match=r"broken-preset\.yaml: " + message):
        methods.preset("broken-preset")


@pytest.mark.parametrize(
    "text, message",
    [
        ("source: {file: a.jsonl, sha: x}\n", "unknown key 'source.sha'"),
        ("source: {file: a.jsonl}\nmax_new_tokens: 1.5\n", "key 'max_new_tokens': Input should be a valid integer"),
        ("source: {file: a.jsonl}\nquestions: []\n", "give exactly one of source and questions"),
        ("category_groups: {qa: qa}\nquestions: []\n", "key 'category_groups.qa': Input should be a valid list"),
    ],
    ids=["nested", "type", "both", "groups"],
)
def test_bad_task_presets_name_the_file_and_key(tmp_path, monkeypatch, text, message):
    (tmp_path / "broken-task.yaml").write_text(text)
    monkeypatch.setitem(presets._EXTRA, "tasks", [tmp_path])
    with pytest.raises(SpecbenchError, match=r"broken-task\.yaml: " + message):
        tasks.load("broken-task")
