"""The 2026 aliases (llama3.1-8b, qwen3-8b, qwen3-4b, glm4.7-flash) on a miniature hub cache holding every
repository they name with its publisher's config keys and weight names (scaled down, random): each plans offline,
the unpinned ones marked; the Qwen3 target runs every method its heads allow, both EAGLE-3 layouts among them,
greedy-identical to vanilla; GLM-4.7-Flash's own MTP layer loads and drafts; a method variant names the head it
runs (`eagle3[head=redhat]`), and a head it cannot find is one line."""

import json
from pathlib import Path

import pytest
import torch

from specbench import methods
from specbench.cli.main import main
from specbench.models import aliases, hub
from specbench.models.aliases import TINY_DIR
from specbench.results import read_answers

from . import minihub
from .test_hub import one_line_error

NEW = ("llama3.1-8b", "qwen3-8b", "qwen3-4b", "glm4.7-flash")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub2026")
    (root / "work").mkdir()
    minihub.build_2026(root / "hub", root / "work")
    return root / "hub"


@pytest.fixture
def offline(monkeypatch, cache, tmp_path) -> Path:
    """In-process runs read the miniature cache, offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "specbench-cache"))
    return cache


def snapshot(cache: Path, source: hub.Source) -> Path:
    return cache / f"models--{source.id.replace('/', '--')}" / "snapshots" / minihub.commit_of(source)


def test_list_models_shows_the_new_aliases_with_their_named_heads(capsys):
    assert main(["list", "models"]) == 0
    out = capsys.readouterr().out
    for name in NEW:
        assert f"\n{name} " in out
    assert "eagle3 head 'redhat' (as eagle3[head=redhat]): RedHatAI/Qwen3-8B-speculator.eagle3" in out
    assert "dflash head: z-lab/Qwen3-4B-DFlash-b16  (unpinned: locked at first use)" in out
    assert "mtp head: zai-org/GLM-4.7-Flash" in out
    assert "pard head: amd/PARD-Qwen3-0.6B" in out and "draft: Qwen/Qwen3-0.6B" in out
    assert "eagle3 head 'specforge' (as eagle3[head=specforge]): lmsys/SGLang-EAGLE3-Llama-3.1-8B" in out
    assert (
        "dspark head: deepseek-ai/dspark_qwen3_8b_block7" in out and "peagle head: RedHatAI/Qwen3-8B-speculator" in out
    )
    assert "dspark head 'dflash' (as dspark[head=dflash]): deepseek-ai/dflash_qwen3_4b_block7" in out


@pytest.mark.parametrize("name", NEW)
def test_every_new_alias_plans_offline_with_its_unpinned_checkpoints_marked(capsys, offline, name):
    spec = aliases.resolve(name)
    named = [f"{k.partition(':')[0]}[head={k.partition(':')[2]}]" for k in spec.heads if ":" in k]
    assert main(["run", "--model", name, "--methods", ",".join(["all", *named]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for key, source in spec.heads.items():
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{key} head "))
        assert source.id in line and "[cached" in line, line
        assert ("unpinned: cached commit" in line) == (source.revision is None), line
    assert "to download: nothing" in out and "skipped: medusa" in out
    assert ("skipped: mtp" in out) == ("mtp" not in spec.heads)


def test_qwen3_runs_every_method_its_heads_allow_greedy_identical(capsys, offline, tmp_path):
    questions = tmp_path / "one.jsonl"
    questions.write_text(json.dumps({"id": 0, "turns": ["Name three colours."]}) + "\n")
    out = tmp_path / "run"
    named = "all,eagle3[head=redhat],eagle3[head=deepspec],dspark[head=dflash]"
    argv = ["run", "--model", "qwen3-8b", "--methods", named, "--tasks", str(questions)]
    options = ["--max-new-tokens", "12", "--no-noise-floor", "--no-report", "--no-warmup", "--out", str(out)]
    assert main([*argv, *options]) == 0
    answers = read_answers(out)
    ran = {a.method for a in answers}
    assert {"sps", "eagle3", "eagle3[head=redhat]", "dflash", "pard", "pard2", "pld", "suffix"} <= ran
    assert {"dspark", "dspark[head=dflash]", "eagle3[head=deepspec]", "peagle"} <= ran  # DeepSpec's three; RedHat's
    assert all(a.greedy_check["match"] for a in answers if a.method != "vanilla")
    manifest = json.loads((out / "manifest.json").read_text())
    recorded = json.dumps(manifest)
    assert "RedHatAI/Qwen3-8B-speculator.eagle3" in recorded and "AngelSlim/Qwen3-8B_eagle3" in recorded
    lock = json.loads((out / "specbench.lock.json").read_text())  # every repository unpinned: locked at first use
    assert lock["checkpoints"]["eagle3:redhat head"] == {
        "repository": "RedHatAI/Qwen3-8B-speculator.eagle3",
        "commit": minihub.commit_of(aliases.ALIASES["qwen3-8b"].heads["eagle3:redhat"]),
    }


def test_glm_flash_drafts_with_its_own_mtp_layer(offline, tmp_path):
    """The native-MTP alias: the MTP layer read from the target's own second shard drafts, accepted, lossless."""
    questions = tmp_path / "one.jsonl"
    questions.write_text(json.dumps({"id": 0, "turns": ["Name three colours."]}) + "\n")
    out = tmp_path / "run"
    argv = ["run", "--model", "glm4.7-flash", "--methods", "mtp", "--tasks", str(questions), "--max-new-tokens", "16"]
    assert main([*argv, "--no-noise-floor", "--no-report", "--out", str(out)]) == 0
    (answer,) = [a for a in read_answers(out) if a.method == "mtp"]
    assert answer.greedy_check["match"] and sum(answer.new_tokens) > sum(answer.decoding_steps)


def test_a_variant_runs_the_head_it_names(offline):
    """AngelSlim's head (official layout) for eagle3, RedHatAI's (speculators, norm_before_residual) for the variant."""
    from specbench.models import loading

    spec = aliases.ALIASES["qwen3-8b"]
    target = snapshot(offline, spec.target)
    model = loading.load_causal_lm(target, torch.device("cpu"), torch.float32, "target")
    paths = {key: snapshot(offline, source) for key, source in spec.heads.items()}
    res = methods.Resources("qwen3-8b", model, None, torch.device("cpu"), torch.float32, head_paths=paths)
    default, named = methods.build("eagle3", res), methods.build("eagle3[head=redhat]", res)
    assert not default.head.midlayer.norm_before_residual and named.head.midlayer.norm_before_residual
    assert methods.needs("eagle3[head=redhat]")[0].key == "eagle3:redhat"


def test_a_variant_of_a_named_head_keeps_its_head():
    """What `tune` names the settings it tries on a named head."""
    defaults = methods.preset("eagle3[head=redhat]").params
    assert methods.variant_name("eagle3[head=redhat]", {**defaults, "top_k": 4}, defaults) == (
        "eagle3[head=redhat,top_k=4]"
    )
    assert methods.variant_name("eagle3", defaults, defaults) == "eagle3"


def test_a_head_a_variant_cannot_find_is_one_line(capsys, offline):
    line = one_line_error(capsys, ["run", "--model", "qwen3-4b", "--methods", "eagle3[head=redhat]", "--dry-run"])
    assert "qwen3-4b has no EAGLE-3 head named 'redhat' (its EAGLE-3 heads are named deepspec); pass --head " in line
    line = one_line_error(capsys, ["run", "--model", "llama3.1-8b", "--methods", "eagle3[head=nope]", "--dry-run"])
    assert "(its EAGLE-3 heads are named redhat, specforge)" in line
    line = one_line_error(capsys, ["run", "--model", "tiny", "--methods", "pld[head=redhat]", "--dry-run"])
    assert "method 'pld[head=redhat]' drafts with no head: drop head=redhat" in line


def test_a_head_named_on_the_command_line_compares_two_heads_in_one_run(capsys, tmp_path):
    """--head eagle3:mine=DIR is the head eagle3[head=mine] runs, beside the alias's own eagle3 head."""
    mine = tmp_path / "mine"
    assert main(["convert", str(TINY_DIR / "eagle3"), "--to", "speculators", "--out", str(mine)]) == 0
    argv = ["run", "--model", "tiny", "--methods", "eagle3,eagle3[head=mine]", "--head", f"eagle3:mine={mine}"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"eagle3:mine head  {mine}  [local folder]" in out
    assert f"eagle3 head       {TINY_DIR / 'eagle3'}  [local folder]" in out
