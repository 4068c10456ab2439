"""One list per concept: the head families are the registry's (each registered by the module that defines it), the
methods and tasks their presets'. Every place that lists them by hand agrees: the aliases' bundled families, the
README's train row, the alias table and the list of tasks in docs/models-and-tasks.md, the table of docs/methods.md
(with each method's losslessness), and the layouts a --head folder is listed against before torch. `specbench train`
and `--head` read the aliases' list, the registry's without importing the methods."""

import re
from pathlib import Path

import pytest

from specbench import methods, presets, tasks  # (importing the methods registers the head families)
from specbench.cli.parser import parser
from specbench.heads.folder import HEAD_LAYOUTS
from specbench.models import aliases
from specbench.registry import HEADS

ROOT = Path(__file__).parents[1]


def test_the_bundled_tiny_family_has_every_registered_head_family():
    assert set(aliases.HEAD_FAMILIES) == set(HEADS)
    assert set(aliases.ALIASES["tiny"].heads) == set(HEADS)


def test_each_family_lists_its_checkpoint_by_the_layout_read_before_torch():
    """`run` lists a --head folder against `HEAD_LAYOUTS` before the methods (and torch) are imported: each family's
    own layout is that one."""
    assert {family: HEADS[family].layout for family in HEADS} == HEAD_LAYOUTS


def test_specbench_train_trains_every_registered_family_and_says_so():
    train = parser()
    for family in HEADS:
        assert train.parse_args(["train", family, "--out", "x"]).kind == family
    with pytest.raises(SystemExit):
        train.parse_args(["train", "nope", "--out", "x"])
    readme = next(line for line in (ROOT / "README.md").read_text().splitlines() if "`specbench train " in line)
    assert set(re.search(r"`specbench train ([\w\\|]+)", readme).group(1).replace("\\", "").split("|")) == set(HEADS)


def test_the_alias_table_lists_each_aliass_head_families():
    rows = [
        line.split(" | ")
        for line in (ROOT / "docs" / "models-and-tasks.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    listed = {}
    for row in rows:
        name = row[0].strip("| `")
        families = {part.split("@")[0].strip() for part in re.sub(r"\(.*?\)", "", row[3]).strip(" |").split(",")}
        listed[name] = families - {"—", ""}
    for name, alias in aliases.ALIASES.items():
        if name in listed:  # (llama2-chat-7b/13b/70b share a row)
            assert listed[name] == set(alias.heads), name


def test_the_method_table_lists_every_shipped_preset_and_its_losslessness():
    """docs/methods.md's table of methods is the presets' list: a preset added or renamed without it fails here."""
    rows = [
        line.split(" | ")
        for line in (ROOT / "docs" / "methods.md").read_text().splitlines()
        if re.match(r"\| `[\w-]+` \|", line)
    ]
    table = {row[0].strip("| `"): row[-1].strip(" |") for row in rows}
    shipped = sorted(p.stem for p in presets.preset_dir("methods").glob("*.yaml"))  # (not a test's plugin folder)
    assert sorted(table) == shipped
    for name, lossless in table.items():
        assert lossless.startswith("yes") == methods.preset(name).lossless, name


def test_the_task_list_names_every_built_in_task():
    """docs/models-and-tasks.md's list of tasks names each one `specbench list tasks` shows."""
    text = (ROOT / "docs" / "models-and-tasks.md").read_text()
    section = text.split("`--tasks` takes task names")[1].split("`--data-dir DIR`")[0]  # (the list of tasks)
    listed = set(re.findall(r"`(\w+)`", section))
    assert set(tasks.available()) <= listed, set(tasks.available()) - listed
