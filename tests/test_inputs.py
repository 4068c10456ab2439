"""Every option and variant of a run is checked before anything loads: one line naming the valid choices, exit
status 2, before the plan (and so before torch, the methods' modules or any model); --max-new-tokens is held to
the target's context, `--dry-run` included."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from specbench.cli.main import main
from specbench.config import RunConfig
from specbench.errors import SpecbenchError
from specbench.models import loading, placement
from specbench.models.chat import prompt_ids
from specbench.run import inputs
from specbench.run import plan as planning
from specbench.zoo import TINY_DIR

TOO_LONG = "sequence-length-is-longer-than-the-specified-maximum"  # the flag transformers sets when it warns


@pytest.fixture
def no_plan(monkeypatch):
    """Planning (the methods' modules, checkpoints, then the model) fails the test: a mistake must come first."""

    def planned(*args, **kwargs):
        raise AssertionError("the run was planned before the mistake was reported")

    monkeypatch.setattr(planning, "make", planned)


def one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specbench: error: "), captured.err
    assert not captured.out
    return lines[0].removeprefix("specbench: error: ")


def model_folder(tmp_path, context: int):
    """A target folder with a config.json and an empty weights file: enough for the checks, which list the weights
    and read none."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": context}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    ("method", "message"),
    [
        (
            "eagle2[nonsense=3]",
            "eagle2: unknown parameter 'nonsense'; its parameters are total_tokens, depth, top_k, sampled, "
            "draft_dtype, draft_vocab",
        ),
        ("vanilla[x=1]", "vanilla: unknown parameter 'x'; it has no parameters"),
        ("eagle2[depth=four]", "eagle2: parameter 'depth' takes a whole number (its preset's is 5), got four"),
        ("eagle2[depth=4.5]", "eagle2: parameter 'depth' takes a whole number (its preset's is 5), got 4.5"),
        ("medusa[sampled=1]", "medusa: parameter 'sampled' takes true or false (its preset's is false), got 1"),
        (
            "suffix[min_token_prob=high]",
            "suffix: parameter 'min_token_prob' takes a number (its preset's is 0.1), got high",
        ),
        ("lookahead[layout=3]", "lookahead: parameter 'layout' takes a string (its preset's is reference), got 3"),
        ("eagl2[depth=4]", "unknown method 'eagl2': choose from dflash, dflash2, dspark, eagle, eagle2,"),
        ("eagle[tree=[[0]]", "method 'eagle[tree=[[0]]': cannot read tree=[[0]; give a number, true, false, null"),
    ],
)
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_bad_variant_is_one_line_naming_the_choices(capsys, no_plan, method, message, dry_run):
    assert one_line(capsys, ["run", "--methods", f"vanilla,{method}", *dry_run]).startswith(message)


def test_variants_of_each_kind_pass():
    variants = [
        "eagle2[depth=4,sampled=true,draft_dtype=bfloat16,draft_vocab=0.25]",
        "suffix[max_spec_factor=2]",
        "medusa[nodes=8]",
        "eagle[tree=[[0]]]",
    ]
    inputs.check(RunConfig(methods=["all", *variants]))


@pytest.mark.parametrize("command", ["verify", "tune"])
def test_verify_and_tune_check_their_method_first(capsys, no_plan, command):
    err = one_line(capsys, [command, "--method", "sps[gamma=3]"])
    assert err == "sps: unknown parameter 'gamma'; its parameters are num_draft_tokens"


TASKS = (  # tasks/*.yaml
    "calibrate, cnn_dm, gsm8k, mt_bench, quick, spec_bench, speed_bench, speed_bench_throughput_16k, "
    "speed_bench_throughput_1k, speed_bench_throughput_2k, speed_bench_throughput_32k, speed_bench_throughput_8k, xsum"
)
BAD_OPTIONS = [
    (["--tasks", "quick,nosuch"], f"unknown task 'nosuch': choose from {TASKS}"),
    (
        ["--tasks", "missing.jsonl"],
        f"task file missing.jsonl does not exist: give a .jsonl, .json, .csv, .parquet file or a task ({TASKS})",
    ),
    (["--tasks", __file__], f"{__file__}: a task file is .jsonl, .json, .csv, .parquet"),
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--dtype", "float8"], "bad --dtype 'float8': use auto, float32, float16, bfloat16"),
    (["--device", "tpu"], "bad --device 'tpu': use auto, cpu, cuda, cuda:N, mps"),
    (["--device", "cuda:01"], "bad --device 'cuda:01': use auto, cpu, cuda, cuda:N, mps"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
@pytest.mark.parametrize(
    "command", [["run"], ["run", "--dry-run"], ["verify", "--method", "sps"], ["tune", "--method", "sps"]]
)
def test_a_bad_task_limit_dtype_or_device_is_one_line_naming_the_choices(capsys, no_plan, options, message, command):
    assert one_line(capsys, [*command, *options]) == message


def test_tune_checks_its_evaluation_task_first_unless_it_skips_the_check(capsys, no_plan, monkeypatch):
    """--eval-task is read only after minutes of calibrating: a typo fails before them (--no-verify never reads it)."""
    assert one_line(capsys, ["tune", "--method", "sps", "--eval-task", "quik"]).startswith(
        "unknown task 'quik': choose from calibrate,"
    )
    from specbench.tune import command

    monkeypatch.setattr(command, "tune", lambda cfg: None)
    assert main(["tune", "--method", "sps", "--eval-task", "quik", "--no-verify"]) == 0


def test_the_names_checked_first_are_the_ones_torch_resolves():
    """One list of dtypes serves the early check and the load; every device name the check lets through parses."""
    import torch

    assert list(loading.DTYPES) == list(placement.DTYPES)
    for name in ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"]:
        placement.check_device(name)
        if name != "auto":
            torch.device(name)
    for name in ["CPU", "cuda:", "cuda:N", "cuda:-1", "cuda:007", "cuda:123456", "xla"]:
        with pytest.raises(SpecbenchError, match="bad --device"):
            placement.check_device(name)
    with pytest.raises(SpecbenchError, match="bad --device 'tpu': use auto, cpu, cuda, cuda:N, mps"):
        loading.pick_device("tpu")  # commands without the early check (train, regenerate) say the same


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--methods", "eagle2[nonsense=3]"],
        ["run", "--tasks", "nosuch"],
        ["run", "--tasks", "./missing.jsonl"],
        ["run", "--limit", "0"],
        ["run", "--dtype", "float8"],
        ["run", "--device", "tpu"],
        ["tune", "--method", "sps", "--eval-task", "nosuch"],
        ["run", "--tasks", "speed_bench_throughput_32k"],
    ],
)
def test_a_mistake_costs_no_heavy_import(argv):
    """A fresh process: the error comes before torch, transformers, `datasets` or any method's module is imported."""
    heavy = ["torch", "transformers", "datasets", "specbench.methods", "specbench.run.plan"]
    code = f"""
import sys
from specbench.cli.main import main
code = main({argv!r})
print(code, [m for m in {heavy!r} if m in sys.modules])
"""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert time.perf_counter() - start < 10
    assert done.stdout.split() == ["2", "[]"], done.stderr
    assert done.stderr.startswith("specbench: error: ")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_max_new_tokens_beyond_the_context_is_refused_at_plan_time(capsys, no_plan, tmp_path, dry_run):
    folder = model_folder(tmp_path, 512)
    err = one_line(capsys, ["run", "--model", str(folder), "--max-new-tokens", "600", *dry_run])
    assert err == (
        "--max-new-tokens 600 does not fit model's context of 512 tokens, prompt and answer together: pass at most 511"
    )
    err = one_line(capsys, ["run", "--max-new-tokens", "100000", "--limit", "1", *dry_run])  # the bundled tiny
    assert "tiny's context of 4096 tokens" in err and "pass at most 4095" in err
    inputs.check(RunConfig(model=str(folder), max_new_tokens=511))


def test_graphs_hold_the_budget_to_the_static_cache(tmp_path):
    folder = model_folder(tmp_path, 8192)
    inputs.check(RunConfig(model=str(folder), max_new_tokens=5000))
    with pytest.raises(SpecbenchError, match=r"static KV cache of --graphs \(4096 tokens\).*pass at most 4095"):
        inputs.check(RunConfig(model=str(folder), max_new_tokens=5000, graphs=True))


FITS = "run speed_bench_throughput_1k or speed_bench_throughput_2k"


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_length_bucket_beyond_the_context_is_refused_with_the_buckets_that_fit(capsys, no_plan, dry_run):
    """SPEED-Bench's throughput buckets: a bucket whose prompts and answers cannot fit the target's context is one
    line at once naming the context and the buckets that fit, not a failure at its first question."""
    err = one_line(capsys, ["run", "--tasks", "speed_bench_throughput_32k,quick,speed_bench_throughput_8k", *dry_run])
    assert err == (
        "tasks speed_bench_throughput_8k, speed_bench_throughput_32k: prompts of about 8000 tokens or more and answers "
        f"of up to 1024 do not fit tiny's context of 4096 tokens: {FITS}, or use a model with a longer context"
    )
    err = one_line(capsys, ["run", "--tasks", "speed_bench_throughput_2k", "--max-new-tokens", "2500", *dry_run])
    assert err == (
        "task speed_bench_throughput_2k: prompts of about 2000 tokens and answers of up to 2500 do not fit tiny's "
        "context of 4096 tokens: run speed_bench_throughput_1k, pass --max-new-tokens 2096 or fewer, or use a model "
        "with a longer context"
    )
    inputs.check(RunConfig(tasks=["speed_bench_throughput_1k", "speed_bench_throughput_2k"]))


def test_a_batch_holds_the_length_buckets_to_its_static_cache(tmp_path):
    """At --batch above 1 the target decodes on a static cache of 4096 tokens whatever its context (as --graphs)."""
    folder = model_folder(tmp_path, 131072)
    inputs.check(RunConfig(model=str(folder), tasks=["speed_bench_throughput_32k"], batch=[1]))
    with pytest.raises(SpecbenchError) as refused:
        inputs.check(RunConfig(model=str(folder), tasks=["speed_bench_throughput_8k"], batch=[1, 4]))
    assert str(refused.value) == (
        "task speed_bench_throughput_8k: prompts of about 8000 tokens and answers of up to 1024 do not fit the static "
        f"KV cache of --batch (4096 tokens): {FITS}, or keep --batch at 1"
    )
    inputs.check(RunConfig(model=str(folder), tasks=["speed_bench_throughput_2k"], batch=[1, 4, 16]))


def test_a_hub_config_is_read_from_the_cache_and_a_missing_one_says_nothing(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo, commit = tmp_path / "models--org--cached", "c" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    with pytest.raises(SpecbenchError, match="cached's context of 256 tokens"):
        inputs.check(RunConfig(model="org/cached", max_new_tokens=300))
    inputs.check(RunConfig(model="org/not-cached", max_new_tokens=300))


def test_a_config_that_arrives_only_when_fetched_is_checked_before_any_weights(monkeypatch):
    """A hub target not cached at plan time: its config.json, fetched before the weights, is checked then."""
    monkeypatch.setattr(inputs.hub, "local_file", lambda source, name: None)
    cfg = RunConfig(methods=["vanilla"], max_new_tokens=5000)
    inputs.check(cfg)
    plan = planning.make(cfg)

    def no_weights(ck):
        raise AssertionError(f"{ck.role} fetched before the context was checked")

    monkeypatch.setattr(planning.hub, "fetch", no_weights)
    with pytest.raises(SpecbenchError, match="tiny's context of 4096 tokens"):
        planning.fetch(plan, cfg)


@pytest.mark.parametrize("template", [True, False])
def test_a_long_prompt_gets_no_transformers_warning_before_our_line(template):
    """`fitting_prompt` refuses a prompt longer than the context in one line: transformers' own warning about it
    (it would print first) stays silent, with the chat template and without."""
    tokenizer = loading.load_tokenizer(TINY_DIR / "target")
    tokenizer.model_max_length = 16
    if not template:
        tokenizer.chat_template = None
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "word " * 100}])
    assert len(ids) > 16 and TOO_LONG not in tokenizer.deprecation_warnings
    tokenizer("word " * 100)  # the same length through the plain call warns: the test can see it
    assert TOO_LONG in tokenizer.deprecation_warnings


def test_a_prompt_beyond_the_context_is_refused_before_the_target_loads(capsys, monkeypatch, tmp_path):
    """The first turns are tokenized with the target's tokenizer alone once it is fetched: one line naming the
    question and the context, no weights loaded and no run folder written."""

    def no_weights(*args, **kwargs):
        raise AssertionError("the target loaded before the prompts were checked")

    monkeypatch.setattr(loading, "load_causal_lm", no_weights)
    questions = tmp_path / "long.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"question_id": qid, "turns": [text]}) + "\n"
            for qid, text in [("short", "hi"), ("long", "word " * 5000)]
        )
    )
    out = tmp_path / "run"
    err = one_line(capsys, ["run", "--tasks", str(questions), "--methods", "vanilla", "--out", str(out)])
    assert err.startswith("question long: its prompt has ") and "more than the model's context of 4096" in err
    assert not out.exists()


BATCH = "--batch above 1 runs in our loop: drop {} (engine mode batches with --concurrency)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--batch", "1,0"], "--batch sizes must be at least 1, got 1,0"),
        (["verify", "--method", "sps", "--batch", "0"], "--batch sizes must be at least 1, got 0"),
        (["run", "--batch", "4", "--engine", "vllm"], BATCH.format("--engine vllm")),
    ],
)
def test_a_batch_size_it_cannot_run_is_one_line(capsys, no_plan, argv, message):
    assert one_line(capsys, argv) == message


def test_a_prompt_past_the_models_vocabulary_is_refused_before_the_target_loads(capsys, monkeypatch, tmp_path):
    """A model folder whose config.json holds fewer tokens than its tokenizer makes (the tiny tokenizer's 8,192
    beside a vocabulary of 512): one line naming the question, the id and the vocabulary, before the weights load,
    instead of an IndexError from the embedding."""

    def no_weights(*args, **kwargs):
        raise AssertionError("the target loaded before the prompts were checked")

    monkeypatch.setattr(loading, "load_causal_lm", no_weights)
    folder = tmp_path / "small"
    shutil.copytree(TINY_DIR / "target", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 512}))
    out = tmp_path / "run"
    err = one_line(capsys, ["run", "--model", str(folder), "--methods", "vanilla", "--limit", "1", "--out", str(out)])
    assert "'s prompt holds token id " in err and "past small's vocabulary of 512" in err
    assert not out.exists()
