"""One list per concept: the head families are the registry's (each registered by the module that defines it), and
every place that lists them agrees with it: the aliases' bundled families, `specbench train`'s families and help, the
README's command table and the alias table of docs/models-and-tasks.md."""

import re
from pathlib import Path

import pytest

from specbench import methods  # noqa: F401  (registers the head families)
from specbench.cli.parser import parser
from specbench.models import aliases
from specbench.registry import HEADS

ROOT = Path(__file__).parents[1]


def test_the_bundled_tiny_family_has_every_registered_head_family():
    assert set(aliases.HEAD_FAMILIES) == set(HEADS)
    assert set(aliases.ALIASES["tiny"].heads) == set(HEADS)


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
