"""The real-model path, proven offline: the aliases' code path on a miniature hub cache, the dry-run plan, pinned
revisions, and one-line errors for every way a checkpoint can be wrong, all before the target loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specbench.cli.main import main
from specbench.core.cached_lm import cache_argument
from specbench.models import aliases, hub
from specbench.models import loading as models
from specbench.models.hub import Layout, Source

from . import minihub

COMMIT_7B = aliases.ALIASES["vicuna-7b"].target.revision
EAGLE3_13B = aliases.ALIASES["vicuna-13b"].heads["eagle3"]


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory) -> Path:
    """HF_HOME with a hub cache holding vicuna-7b's and vicuna-13b's checkpoints, scaled down."""
    home = tmp_path_factory.mktemp("hf_home")
    minihub.build(home / "hub", tmp_path_factory.mktemp("minihub_work"))
    return home


def specbench(args: list[str], home: Path) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, offline, on the hub cache under `home` (as a user's shell would run it)."""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "SPECBENCH_CACHE": str(home / "specbench")}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "specbench.cli", *args], env=env, capture_output=True, text=True)


@pytest.fixture
def offline_cache(monkeypatch, hf_home):
    """In-process runs read the miniature hub, offline; loading any target model fails the test."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the mistake was reported")

    monkeypatch.setattr(models, "load_causal_lm", no_target)
    return hf_home / "hub"


def one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if " skipped: " not in line]  # notes of `default`
    assert len(lines) == 1 and lines[0].startswith("specbench: error:"), err
    return lines[0]


# ---------------------------------------------------------------- pure parts


def test_layout_prefers_safetensors_and_keeps_configs_and_tokenizer():
    names = [
        "config.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model.bin.index.json",
        "model.safetensors",
        "tokenizer.model",
        "README.md",
        "training_args.bin",
    ]
    assert hub.TRANSFORMERS.select(names) == [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin.index.json",
        "tokenizer.model",
    ]
    pickles = [n for n in names if n != "model.safetensors"]
    assert "pytorch_model-00001-of-00002.bin" in hub.TRANSFORMERS.select(pickles)
    assert "training_args.bin" not in hub.TRANSFORMERS.select(pickles)
    eagle = Layout((("pytorch_model.bin",), ("model.safetensors",)))
    both = ["config.json", "pytorch_model.bin", "model.safetensors"]
    assert eagle.select(both) == ["config.json", "pytorch_model.bin"]
    assert eagle.select(["config.json", "README.md"]) is None


def test_parse_sources(tmp_path):
    assert hub.parse("org/name@abc") == Source("org/name", "abc")
    assert hub.parse("org/name", "v2") == Source("org/name", "v2")
    assert hub.parse(str(tmp_path)) == Source(str(tmp_path))
    with pytest.raises(hub.SpecbenchError, match="only applies to a hub id"):
        hub.parse(str(tmp_path), "abc")
    with pytest.raises(hub.SpecbenchError, match="--revision says"):
        hub.parse("org/name@abc", "def")


def test_every_hub_checkpoint_of_an_alias_is_pinned_to_a_commit_or_left_to_the_lock():
    """A commit, or no revision at all (resolved at first use and locked), never a branch that moves; the 2024
    aliases pin every checkpoint."""
    for alias, spec in aliases.ALIASES.items():
        for source in (spec.target, spec.draft, *spec.heads.values()):
            if source is not None and not source.local:
                assert source.revision is None or hub.COMMIT.match(source.revision), (alias, source)
                pinned = alias.startswith(("vicuna", "llama2", "llama3.3")) or source.id.startswith("meta-llama/")
                assert source.revision or not pinned, (alias, source)
    assert "eagle3" not in aliases.ALIASES["vicuna-7b"].heads  # no official EAGLE-3 head exists for it


def test_the_cache_keyword_follows_the_forward_signature():
    """transformers 5.24 renamed past_key_values to cache (the old name goes in 5.40); remote code may keep it."""

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=False): ...

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False): ...

    assert cache_argument(Renamed) == "cache"
    assert cache_argument(Older) == "past_key_values"
    from transformers import LlamaForCausalLM, LlamaModel

    assert cache_argument(LlamaForCausalLM) == cache_argument(LlamaModel)  # one name per version


def test_human_bytes():
    assert [hub.human_bytes(n) for n in (999, 1_000, 13_476_839_424)] == ["999 B", "1.00 KB", "13.48 GB"]


# ---------------------------------------------------------------- the miniature hub, end to end


def _greedy_matches(run: Path, task: str = "quick") -> dict[str, list[bool]]:
    out = {}
    for path in sorted((run / "answers" / task).glob("*-temperature-0.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        method = path.name.split("-temperature")[0]
        if method != "vanilla":
            out[method] = [(r["specbench"].get("greedy_check") or {}).get("match") for r in rows]
    return out


def test_all_methods_on_an_alias_run_from_the_hub_cache(hf_home, tmp_path):
    """vicuna-13b, whose cache holds every head family a 2024 alias has (vicuna-7b's skips: the dry-run test; the
    2026 aliases: test_aliases_2026.py)."""
    alias = "vicuna-13b"
    run, two = tmp_path / "run", tmp_path / "two.jsonl"
    two.write_text('{"id": 1, "prompt": "Name a colour."}\n{"id": 2, "prompt": "Count to three."}\n')
    args = [
        "run",
        "--methods",
        "all",
        "--model",
        alias,
        "--tasks",
        str(two),
        "--max-new-tokens",
        "8",
        "--out",
        str(run),
        "--no-warmup",
        "--no-report",
    ]
    done = specbench(args, hf_home)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((run / "manifest.json").read_text())
    spec = aliases.ALIASES[alias]
    expected = {"vanilla", "sps", "pld", "suffix", "lookahead", "lookahead-shifted", "ouroboros", "medusa"}
    expected |= {"medusa-typical", "eagle", "eagle2", "eagle3"}
    assert set(manifest["skipped"]) == {"mtp", "dflash", "dflash2", "dspark", "pard", "pard2", "peagle"}  # no MTP
    # module or drafters
    assert set(manifest["config"]["methods"]) == expected
    matches = _greedy_matches(run, "two")
    assert set(matches) == expected - {"vanilla"} | {"vanilla-aa"}  # the A/A column: vanilla timed again
    assert all(all(m) and len(m) == 2 for m in matches.values()), matches  # every greedy answer equals vanilla's
    loaded = {role: ck["revision"] for role, ck in manifest["checkpoints"].items()}
    assert loaded["target"] == spec.target.revision and loaded["draft"] == spec.draft.revision
    assert {role: rev for role, rev in loaded.items() if role.endswith(" head")} == {
        f"{family} head": source.revision for family, source in spec.heads.items()
    }


def test_dry_run_on_the_hub_cache_lists_the_plan(hf_home):
    done = specbench(["run", "--methods", "all", "--model", "vicuna-7b", "--dry-run"], hf_home)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "skipped: eagle3: vicuna-7b has no EAGLE-3 head; pass --head eagle3=PATH_OR_HUB_ID" in out
    assert f"target       lmsys/vicuna-7b-v1.3 @ {COMMIT_7B}  [cached]" in out
    assert "task: quick: 12 questions" in out
    assert "to download: nothing" in out
    assert out.count("[cached]") == 4  # target, draft, eagle and medusa heads


def test_dry_run_without_the_cache_lists_what_is_missing(tmp_path):
    done = specbench(["run", "--methods", "all", "--model", "vicuna-7b", "--dry-run"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("not cached: size unknown") == 4
    assert "hub: HF_HUB_OFFLINE is set; cache status only" in done.stdout
    bad = specbench(["run", "--methods", "eagle9", "--model", "vicuna-7b", "--dry-run"], tmp_path)
    assert bad.returncode == 2 and "unknown method 'eagle9'" in bad.stderr and "Traceback" not in bad.stderr


def test_dry_run_reports_download_sizes_from_hub_metadata(monkeypatch, capsys, tmp_path):
    """With the hub reachable, sizes come from its metadata (no weights are downloaded)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import ModelInfo

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    files = {"config.json": 600, "model.safetensors": 2_000_000_000, "tokenizer.json": 1_800_000}

    def model_info(self, repo_id, revision=None, files_metadata=False, **kwargs):
        siblings = [{"rfilename": n, "size": s} for n, s in files.items()]
        return ModelInfo(id=repo_id, sha=revision or "f" * 40, siblings=siblings)

    monkeypatch.setattr(HfApi, "model_info", model_info)
    assert main(["run", "--model", "org/model", "--methods", "vanilla,pld", "--revision", "a" * 40, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"target  org/model @ {'a' * 40}  [not cached: 2.00 GB to download]" in out
    assert "to download: 2.00 GB before the run starts" in out


# ---------------------------------------------------------------- one line, exit 2, before the target loads


def test_naming_a_method_the_model_cannot_run(capsys, offline_cache):
    err = one_line_error(capsys, ["run", "--model", "vicuna-7b", "--methods", "vanilla,eagle3"])
    assert "eagle3 cannot run: vicuna-7b has no EAGLE-3 head; pass --head eagle3=PATH_OR_HUB_ID" in err
    err = one_line_error(capsys, ["run", "--model", "lmsys/vicuna-7b-v1.3", "--methods", "sps"])
    assert "has no draft model; pass --draft" in err


def test_a_head_for_another_hidden_size(capsys, offline_cache):
    err = one_line_error(
        capsys, ["run", "--model", "vicuna-7b", "--methods", "eagle3", "--head", f"eagle3={EAGLE3_13B}"]
    )
    assert "is for hidden size 80" in err and "has 64" in err and "--head eagle3=" in err


def test_a_missing_file_inside_a_head_repo(capsys, offline_cache, monkeypatch, tmp_path):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    shutil.copytree(offline_cache, cache, symlinks=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    eagle = aliases.ALIASES["vicuna-7b"].heads["eagle"]
    (cache / "models--yuhuili--EAGLE-Vicuna-7B-v1.3" / "snapshots" / eagle.revision / "pytorch_model.bin").unlink()
    err = one_line_error(capsys, ["run", "--model", "vicuna-7b", "--methods", "eagle"])
    assert f"eagle head '{eagle}': the hub repository has none of pytorch_model.bin or model.safetensors" in err


def test_a_revision_or_repo_not_in_the_cache_offline(capsys, offline_cache):
    err = one_line_error(capsys, ["run", "--model", "lmsys/vicuna-7b-v1.3", "--revision", "b" * 40])
    assert "is not in the local hub cache and HF_HUB_OFFLINE is set" in err
    err = one_line_error(capsys, ["run", "--model", "nobody/no-such-model"])
    assert "'nobody/no-such-model' is not in the local hub cache" in err
    err = one_line_error(capsys, ["run", "--model", "vicuna-7b", "--revision", "main"])
    assert "aliases" in err or "alias" in err


def _http_error(cls, status: int):
    """A hub error as huggingface_hub raises it (its HTTP client is httpx or its fork, by version)."""
    import importlib

    client = next(c for c in cls.__mro__ if c.__module__.split(".")[0] not in ("huggingface_hub", "builtins"))
    http = importlib.import_module(client.__module__.split(".")[0])
    request = http.Request("GET", "https://huggingface.co/api/models/x")
    return cls(f"{status} Client Error", response=http.Response(status, request=request))


@pytest.mark.parametrize(
    ("error", "status", "says"),
    [
        ("RepositoryNotFoundError", 404, "does not exist on the hub"),
        ("GatedRepoError", 403, "is gated: accept its licence"),
        ("RevisionNotFoundError", 404, "has no revision 'v9'"),
    ],
)
def test_hub_answers_are_one_line(capsys, monkeypatch, offline_cache, error, status, says):
    from huggingface_hub import HfApi, constants, errors

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def model_info(self, *args, **kwargs):
        raise _http_error(getattr(errors, error), status)

    monkeypatch.setattr(HfApi, "model_info", model_info)
    err = one_line_error(capsys, ["run", "--model", "meta-llama/Some-Model", "--revision", "v9"])
    assert says in err and "meta-llama/Some-Model" in err


def test_remote_code_is_off_unless_asked(monkeypatch, tiny_models):
    from transformers import AutoModelForCausalLM

    seen = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    target, _ = tiny_models
    models.load_causal_lm(target, models.pick_device("cpu"), models.DTYPES["float32"])
    models.load_causal_lm(target, models.pick_device("cpu"), models.DTYPES["float32"], trust_remote_code=True)
    assert seen == [False, True]


class _Payload:
    """Pickles as a call that would create a file: what a malicious checkpoint does on an unsafe load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_heads_load_with_weights_only(tmp_path):
    import torch

    from specbench.heads import medusa

    marker = tmp_path / "code-ran"
    folder = tmp_path / "heads"
    folder.mkdir()
    torch.save({"0.0.linear.weight": _Payload(marker)}, folder / "medusa_lm_head.pt")
    with pytest.raises(hub.SpecbenchError, match="cannot read medusa_lm_head.pt"):
        medusa.load(folder)
    assert not marker.exists()


def test_training_commands_load_the_pinned_target(offline_cache):
    """`specbench train` / `regenerate` read a hub target at the alias's commit, from the cache when offline."""
    folder = aliases.target_folder(aliases.resolve("vicuna-7b"))
    assert folder.name == COMMIT_7B and (folder / "config.json").is_file()
    with pytest.raises(hub.SpecbenchError, match="not in the local hub cache"):
        aliases.target_folder(aliases.resolve("llama3.1-8b"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_cuda_keeps_attention_off_cudnn(tiny_models):
    """cuDNN attention re-plans for every new key length (6x slower decode steps on an H100): loading turns it off."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    models.load_causal_lm(tiny_models[0], torch.device("cuda"), torch.float16)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
