"""`run --shard I/N` splits the questions deterministically; `merge` (or `report` given the shards) joins them
into what the unsharded run would hold, and refuses shards that do not belong together."""

import json

import pytest

from specbench.cli.main import main
from specbench.report.sources import load_sources
from specbench.results import read_answers


def run(tiny_models, out, *extra):
    target, draft = tiny_models
    argv = [
        "run",
        "--model",
        str(target),
        "--draft",
        str(draft),
        "--methods",
        "vanilla,pld",
        "--out",
        str(out),
        "--no-report",
        "--no-warmup",
        "--no-noise-floor",
        "--max-new-tokens",
        "4",
        "--limit",
        "1",
        *extra,
    ]
    assert main(argv) == 0


def keys(run_dir):
    return sorted((a.method, str(a.question_id)) for a in read_answers(run_dir))


@pytest.fixture(scope="module")
def shards(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    run(tiny_models, root / "whole")
    for i in (1, 2, 3):
        run(tiny_models, root / f"part-shard{i}of3", "--shard", f"{i}/3")
    return root


def test_shards_split_the_questions_and_merge_back(shards, capsys):
    parts = [shards / f"part-shard{i}of3" for i in (1, 2, 3)]
    ids = [{q for _, q in keys(p)} for p in parts]
    assert all(ids) and not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])  # disjoint, none empty
    assert main(["merge", *map(str, parts), "--out", str(shards / "merged")]) == 0
    assert keys(shards / "merged") == keys(shards / "whole")
    manifest = json.loads((shards / "merged" / "manifest.json").read_text())
    assert manifest["config"]["shard"] is None and [s["shard"] for s in manifest["shards"]] == [[1, 3], [2, 3], [3, 3]]
    whole = {(a.method, a.question_id): a.output_ids for a in read_answers(shards / "whole")}
    merged = {(a.method, a.question_id): a.output_ids for a in read_answers(shards / "merged")}
    assert merged == whole  # the same greedy tokens
    (source,) = load_sources(parts)  # report and export take the shards directly
    assert source.name == "part" and sorted((a.method, str(a.question_id)) for a in source.answers) == keys(
        shards / "whole"
    )


def error(capsys, argv) -> str:
    assert main(argv) != 0
    return capsys.readouterr().err


def test_merge_refuses_what_does_not_belong_together(shards, capsys, tmp_path):
    one, two = shards / "part-shard1of3", shards / "part-shard2of3"
    assert "is not a shard" in error(capsys, ["merge", str(one), str(shards / "whole"), "--out", str(tmp_path / "a")])
    assert "both shard 1/3" in error(capsys, ["merge", str(one), str(one), "--out", str(tmp_path / "b")])
    other = tmp_path / "other"
    other.mkdir()
    manifest = json.loads((two / "manifest.json").read_text())
    manifest["config"]["seed"] = 7
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert "another seed" in error(capsys, ["merge", str(one), str(other), "--out", str(tmp_path / "c")])
    manifest["config"]["seed"], manifest["machine"]["device_name"] = 0, "NVIDIA H100"
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert "different devices" in error(capsys, ["merge", str(one), str(other), "--out", str(tmp_path / "d")])
    assert not any((tmp_path / x).exists() for x in "abcd")  # nothing written half
    with pytest.raises(SystemExit):
        main(["run", "--shard", "4/3"])
    assert "expected I/N with 1 <= I <= N" in capsys.readouterr().err


def test_a_run_answered_on_different_devices_is_pooled_only_when_asked(shards, capsys, tmp_path):
    """Ray workers on two kinds of GPU: report and compare refuse to pool their timings unless told to."""
    import shutil

    mixed = tmp_path / "mixed"
    shutil.copytree(shards / "whole", mixed)
    manifest = json.loads((mixed / "manifest.json").read_text())
    manifest["workers"] = [{**manifest["machine"], "device_name": name} for name in ("NVIDIA H100", "NVIDIA A100")]
    (mixed / "manifest.json").write_text(json.dumps(manifest))
    out = str(tmp_path / "report")
    assert "pass --mixed-devices" in error(capsys, ["report", str(mixed), "--out", out])
    assert "--allow-different-machines" in error(capsys, ["compare", str(shards / "whole"), str(mixed)])
    assert main(["report", str(mixed), "--out", out, "--mixed-devices"]) == 0
