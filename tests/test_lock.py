"""Lock files, offline on a miniature hub cache: unpinned hub checkpoints marked by `--dry-run`, `specbench lock`
pinning the cached commit, `run --lock` running the lock's commit over the cache's branch (and over a pinned
revision, with a notice), the lock a run of unpinned checkpoints leaves beside its manifest, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbench.cli.main import main
from specbench.models.hub import Source

from . import minihub

TARGET, DRAFT = "org/tiny-target", "org/tiny-draft"
OLD, NEW = "0" * 39 + "1", "0" * 39 + "2"  # the target's commits in the cache; refs/main names NEW
DRAFT_COMMIT = "d" * 40


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_models) -> Path:
    """The tiny target at two commits (main at the newer) and its draft, as hub repositories no alias pins."""
    cache = tmp_path_factory.mktemp("lock_hub")
    target, draft = ({p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} for folder in tiny_models)
    for commit in (OLD, NEW):
        minihub.add_repo(cache, Source(TARGET, commit), target)
    minihub.add_repo(cache, Source(DRAFT, DRAFT_COMMIT), draft)
    return cache


@pytest.fixture
def offline(monkeypatch, tmp_path, hub_cache) -> Path:
    """The miniature hub cache, HF_HUB_OFFLINE set, in a fresh working folder."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def specbench(capsys, argv: list[str]) -> tuple[str, str]:
    assert main(argv) == 0, capsys.readouterr().err
    done = capsys.readouterr()
    return done.out, done.err


def one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specbench: error:"), err
    return lines[0]


def write_lock(path: Path, commit: str) -> Path:
    checkpoints = {"target": {"repository": TARGET, "commit": commit}}
    path.write_text(json.dumps({"format": 1, "model": "tiny-target", "checkpoints": checkpoints}))
    return path


def test_dry_run_marks_an_unpinned_checkpoint_with_its_cached_commit(capsys, offline):
    out, _ = specbench(capsys, ["run", "--model", TARGET, "--methods", "vanilla", "--dry-run"])
    assert f"target  {TARGET}  [cached; unpinned: cached commit {NEW[:7]}…]" in out
    out, _ = specbench(capsys, ["run", "--model", TARGET, "--revision", "main", "--methods", "vanilla", "--dry-run"])
    assert f"target  {TARGET} @ main  [cached; unpinned: cached commit {NEW[:7]}…]" in out
    out, _ = specbench(capsys, ["run", "--model", f"{TARGET}@{OLD}", "--methods", "vanilla", "--dry-run"])
    assert f"target  {TARGET} @ {OLD}  [cached]" in out and "unpinned" not in out


def test_lock_pins_the_cached_commits_and_run_lock_runs_them(capsys, offline):
    model = ["--model", TARGET, "--draft", DRAFT, "--methods", "vanilla,sps"]
    out, _ = specbench(capsys, ["lock", *model])
    lock = json.loads((offline / "specbench.lock.json").read_text())
    assert lock == {
        "format": 1,
        "model": "tiny-target",
        "checkpoints": {
            "target": {"repository": TARGET, "commit": NEW},
            "draft": {"repository": DRAFT, "commit": DRAFT_COMMIT},
        },
    }
    assert f"target  {TARGET} @ {NEW}" in out and f"draft   {DRAFT} @ {DRAFT_COMMIT}" in out
    out, _ = specbench(capsys, ["run", *model, "--lock", "specbench.lock.json", "--dry-run"])
    assert f"target  {TARGET} @ {NEW}  [cached]" in out and "unpinned" not in out
    out, _ = specbench(capsys, ["run", *model, "--lock", str(write_lock(offline / "old.json", OLD)), "--dry-run"])
    assert f"target  {TARGET} @ {OLD}  [cached]" in out  # the lock's commit, not main's
    assert f"draft   {DRAFT}  [cached; unpinned: cached commit {DRAFT_COMMIT[:7]}…]" in out  # one the lock leaves out


def test_the_lock_wins_over_a_pinned_revision_with_a_notice(capsys, offline):
    lock = write_lock(offline / "new.json", NEW)
    out, err = specbench(capsys, ["run", "--model", f"{TARGET}@{OLD}", "--lock", str(lock), "--dry-run"])
    assert f"target  {TARGET} @ {NEW}  [cached]" in out
    assert f"note: target '{TARGET}' runs at {NEW[:7]}… from {lock}, not at its pinned {OLD[:7]}…" in err


def test_an_unpinned_run_leaves_a_lock_that_runs_it_again(capsys, offline):
    prompts = offline / "one.jsonl"
    prompts.write_text('{"id": 1, "prompt": "Name a colour."}\n')
    args = ["--methods", "vanilla", "--tasks", str(prompts), "--max-new-tokens", "4", "--no-warmup", "--no-noise-floor"]
    _, err = specbench(capsys, ["run", "--model", TARGET, *args, "--no-report", "--out", "first"])
    assert f"target '{TARGET}' is unpinned and HF_HUB_OFFLINE is set: it runs the cached commit {NEW}" in err
    assert "first/specbench.lock.json" in err
    lock = json.loads((offline / "first" / "specbench.lock.json").read_text())
    assert lock["checkpoints"]["target"] == {"repository": TARGET, "commit": NEW}

    old = write_lock(offline / "old.json", OLD)
    _, err = specbench(capsys, ["run", "--model", TARGET, *args, "--no-report", "--out", "again", "--lock", str(old)])
    manifest = json.loads((offline / "again" / "manifest.json").read_text())
    assert manifest["checkpoints"]["target"]["revision"] == OLD and manifest["config"]["lock"] == str(old)
    assert "unpinned" not in err and not (offline / "again" / "specbench.lock.json").exists()  # pinned: no lock
    assert (offline / "again" / "answers" / "one" / "vanilla-temperature-0.jsonl").is_file()


def test_a_lock_naming_a_commit_not_in_the_cache_is_one_line(capsys, offline):
    missing = "b" * 40
    lock = write_lock(offline / "missing.json", missing)
    for dry_run in (["--dry-run"], []):
        err = one_line_error(capsys, ["run", "--model", TARGET, "--methods", "vanilla", "--lock", str(lock), *dry_run])
        assert f"'{TARGET}' is locked at commit {missing}" in err and "HF_HUB_OFFLINE is set" in err
        assert "run once with the hub reachable" in err


def test_a_lock_of_another_model_or_an_unresolvable_one_is_one_line(capsys, offline):
    lock = write_lock(offline / "target.json", NEW)
    err = one_line_error(capsys, ["run", "--model", DRAFT, "--methods", "vanilla", "--lock", str(lock), "--dry-run"])
    assert "is for model 'tiny-target', not 'tiny-draft'" in err
    err = one_line_error(capsys, ["run", "--lock", str(offline / "nowhere.json"), "--dry-run"])
    assert "cannot read lock file" in err and "specbench lock" in err
    err = one_line_error(capsys, ["lock", "--model", "nobody/nothing", "--methods", "vanilla"])
    assert "target 'nobody/nothing' resolves to no commit" in err and "hub reachable" in err
    assert not (offline / "specbench.lock.json").exists()


def test_lock_pins_the_hubs_commit_when_it_answers(capsys, monkeypatch, offline):
    """The hub's commit of the branch (its metadata only: nothing is downloaded), not the cache's."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import ModelInfo

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub_commit = "f" * 40

    def model_info(self, repo_id, revision=None, files_metadata=False, **kwargs):
        siblings = [{"rfilename": n, "size": 1} for n in ("config.json", "model.safetensors")]
        return ModelInfo(id=repo_id, sha=hub_commit, siblings=siblings)

    monkeypatch.setattr(HfApi, "model_info", model_info)
    out, _ = specbench(capsys, ["run", "--model", TARGET, "--methods", "vanilla", "--dry-run"])
    assert f"target  {TARGET}  [not cached: 2 B to download; unpinned: hub commit {hub_commit[:7]}…]" in out
    out, _ = specbench(capsys, ["lock", "--model", TARGET, "--methods", "vanilla", "--out", "hub.json"])
    assert json.loads((offline / "hub.json").read_text())["checkpoints"]["target"]["commit"] == hub_commit
