"""Expected mistakes get one line on stderr and exit code 2, never a traceback."""

import json

import pytest

from specbench.cli.main import main
from specbench.zoo.tokenizer import train_tokenizer

from .conftest import random_llama


def error_of(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("specbench: error:")
    return last


def base(tiny_models, tmp_path):
    target, draft = tiny_models
    return [
        "run",
        "--model",
        str(target),
        "--draft",
        str(draft),
        "--out",
        str(tmp_path / "run"),
        "--no-report",
        "--max-new-tokens",
        "4",
        "--limit",
        "1",
    ]


def test_unknown_method_lists_valid_names(capsys, tiny_models, tmp_path):
    err = error_of(capsys, [*base(tiny_models, tmp_path), "--methods", "vanila"])
    assert "vanila" in err and "sps" in err and "pld" in err


def test_unknown_model_lists_aliases(capsys):
    err = error_of(capsys, ["run", "--model", "vicuna-7", "--no-report"])
    assert "vicuna-7b" in err and "tiny" in err


def test_unknown_task_lists_tasks(capsys, tiny_models, tmp_path):
    err = error_of(capsys, [*base(tiny_models, tmp_path), "--tasks", "gsm9k"])
    assert "gsm8k" in err and "spec_bench" in err


def test_malformed_jsonl_names_file_and_line(capsys, tiny_models, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hello"}\n{"prompt": "oops"\n')
    err = error_of(capsys, [*base(tiny_models, tmp_path), "--tasks", str(bad)])
    assert f"{bad}:2" in err


def test_jsonl_task_with_field_mapping_runs(capsys, tiny_models, tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text("\n".join(json.dumps({"idx": i, "q": f"Say {w}."}) for i, w in enumerate(["hi", "yes"])) + "\n")
    code = main(
        [
            *base(tiny_models, tmp_path),
            "--tasks",
            str(good),
            "--field",
            "prompt=q",
            "--field",
            "id=idx",
            "--methods",
            "pld",
        ]
    )
    assert code == 0
    assert (tmp_path / "run" / "answers" / "mine" / "pld-temperature-0.jsonl").exists()


def test_prompt_longer_than_context(capsys, tiny_models, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": " ".join(["word"] * 3000)}) + "\n")
    err = error_of(capsys, [*base(tiny_models, tmp_path), "--tasks", str(long)])
    assert "context" in err


def test_draft_with_another_tokenizer(capsys, tiny_models, tmp_path):
    tokenizer = train_tokenizer(["completely different text for another vocabulary"] * 5, vocab_size=300)
    other = tmp_path / "other_draft"
    random_llama(len(tokenizer), layers=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    target, _ = tiny_models
    err = error_of(
        capsys,
        [
            "run",
            "--model",
            str(target),
            "--draft",
            str(other),
            "--methods",
            "sps",
            "--out",
            str(tmp_path / "r"),
            "--no-report",
            "--max-new-tokens",
            "4",
            "--limit",
            "1",
        ],
    )
    assert "different tokenizer" in err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_nonpositive_max_new_tokens(capsys, tiny_models, tmp_path, value):
    argv = base(tiny_models, tmp_path)
    argv[argv.index("--max-new-tokens") + 1] = value
    assert "--max-new-tokens" in error_of(capsys, argv)


def test_list_commands(capsys):
    assert main(["list", "methods"]) == 0
    out = capsys.readouterr().out
    assert "vanilla" in out and "sps" in out and "pld" in out
    assert main(["list", "models"]) == 0
    assert "vicuna-7b" in capsys.readouterr().out
    assert main(["list", "tasks"]) == 0
    assert "spec_bench" in capsys.readouterr().out


def test_verify_command_passes_for_sps(capsys, tiny_models):
    target, draft = tiny_models
    code = main(
        [
            "verify",
            "--method",
            "sps",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--limit",
            "1",
            "--max-new-tokens",
            "12",
            "--samples",
            "300",
            "--horizon",
            "2",
            "--prompts",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "greedy: 6/6 questions token-identical" in out and "verdict: pass" in out


def test_method_variant_runs_beside_its_base_with_its_own_params(capsys, tiny_models, tmp_path):
    argv = [*base(tiny_models, tmp_path), "--methods", "pld,pld[max_ngram_size=1,num_pred_tokens=2]"]
    assert main(argv) == 0, capsys.readouterr().err
    answers = tmp_path / "run" / "answers" / "quick"
    variant = answers / "pld[max_ngram_size=1,num_pred_tokens=2]-temperature-0.jsonl"
    assert variant.is_file() and (answers / "pld-temperature-0.jsonl").is_file()
    record = json.loads(variant.read_text().splitlines()[0])
    assert max(record["choices"][0]["accept_lengths"]) <= 3  # at most 2 drafted tokens + the bonus one
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "report")]) == 0
    assert "pld[max_ngram_size=1,num_pred_tokens=2]" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize(
    "methods, message",
    [
        ("pld[max_ngram]", "key=value"),
        ("pld[bogus=1]", "pld: unknown parameter 'bogus'; its parameters are max_ngram_size, num_pred_tokens"),
        ("pld[", "base["),
    ],
)
def test_bad_method_variant_says_how_to_write_one(capsys, tiny_models, tmp_path, methods, message):
    assert message in error_of(capsys, [*base(tiny_models, tmp_path), "--methods", methods])


def test_a_fresh_process_knows_the_head_families_while_parsing():
    """`--head eagle=DIR` is parsed before any command runs: the parser itself must register the head families."""
    import subprocess
    import sys

    from specbench.zoo import TINY_DIR

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specbench.cli",
            "run",
            "--head",
            f"eagle={TINY_DIR / 'eagle'}",
            "--methods",
            "vanilla,eagle",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "eagle head" in done.stdout


def test_every_training_knob_is_an_option_with_its_default_and_help():
    """`specbench train`'s options are generated from TrainConfig (one definition per knob): every field is an
    option (but --seed, the target parser's) with the field's default, and reaches the config by name."""
    from dataclasses import fields

    from specbench.cli.parser import parser as build_parser
    from specbench.heads.train_config import TrainConfig, train_config

    parser = build_parser()
    args = parser.parse_args(["train", "eagle", "--target", "tiny", "--out", "x"])
    for f in fields(TrainConfig):
        assert getattr(args, f.name) == f.default, f.name
    args = parser.parse_args(
        [
            "train",
            "pard",
            "--target",
            "tiny",
            "--out",
            "x",
            "--drop-ratio",
            "0.5",
            "--medusa-shared-lm-head",
            "--blocks",
            "3",
            "--seed",
            "4",
        ]
    )
    cfg = train_config(args.kind, **{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    assert (cfg.drop_ratio, cfg.medusa_shared_lm_head, cfg.blocks, cfg.seed, cfg.lr) == (0.5, True, 3, 4, 3e-4)
    assert train_config("medusa").lr == 1e-3 and train_config("medusa", lr=0.5).lr == 0.5


def test_every_run_setting_is_an_option_with_its_default_and_reaches_the_run_config(monkeypatch):
    """`specbench run`'s own settings are RunConfig fields declared once (`config.option`, no group): each is an option
    with the field's default, and what is given reaches the RunConfig under the field's name."""
    from dataclasses import fields

    from specbench.cli import handlers
    from specbench.cli.parser import parser as build_parser
    from specbench.config import RunConfig

    options = [f for f in fields(RunConfig) if f.metadata and not f.metadata["group"]]
    assert {f.name for f in options} >= {"methods", "tasks", "temperatures", "warmup", "noise_floor", "graphs"}
    defaults = RunConfig()
    args = build_parser().parse_args(["run"])
    for f in options:
        assert getattr(args, f.name) == getattr(defaults, f.name), f.name
    given = [
        "run",
        "--methods",
        "eagle2[top_k=6,depth=4],pld",
        "--temperatures",
        "0,1",
        "--no-warmup",
        "--repeats",
        "3",
        "--shard",
        "2/4",
        "--graphs",
        "--engine",
        "vllm",
        "--concurrency",
        "1,4",
        "--tuned",
        "t.yaml",
    ]
    made = []

    def stop(cfg):  # the run's config, caught where the handler checks it (nothing loads)
        made.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(handlers, "check", stop)
    with pytest.raises(SystemExit):
        handlers.run(build_parser().parse_args(given))
    cfg = made[0]
    assert cfg.methods == ["eagle2[top_k=6,depth=4]", "pld"] and cfg.temperatures == [0.0, 1.0]
    assert (cfg.warmup, cfg.noise_floor, cfg.repeats, cfg.shard) == (False, True, 3, [2, 4])
    assert (cfg.graphs, cfg.engine, cfg.concurrency, cfg.tuned) == (True, "vllm", [1, 4], "t.yaml")


def test_every_shared_option_is_an_option_of_run_verify_and_tune_and_reaches_the_run_config(monkeypatch):
    """The options `run`, `verify` and `tune` share are RunConfig fields of a group (`option(..., group=...)`, one
    parent parser each): each is an option of the three commands with RunConfig's default, and a command line giving
    every one of them reaches the RunConfig (--head and --field repeated, made its dicts)."""
    from dataclasses import fields

    from specbench.cli import handlers
    from specbench.cli.parser import parser as build_parser
    from specbench.config import RunConfig

    grouped = [f.name for f in fields(RunConfig) if f.metadata.get("group")]
    given = {
        "model": ("--model m", "m"),
        "draft": ("--draft d@abc", "d@abc"),
        "revision": ("--revision r", "r"),
        "trust_remote_code": ("--trust-remote-code", True),
        "heads": ("--head eagle=E --head H", {"eagle": "E", "*": "H"}),
        "data_dir": ("--data-dir D", "D"),
        "fields": ("--field prompt=q --field id=idx", {"prompt": "q", "id": "idx"}),
        "limit": ("--limit 2", 2),
        "max_new_tokens": ("--max-new-tokens 7", 7),
        "device": ("--device cpu", "cpu"),
        "dtype": ("--dtype float16", "float16"),
        "seed": ("--seed 5", 5),
    }
    assert sorted(given) == sorted(grouped), "a shared option without a value here: add one"
    made = []

    def stop(cfg):  # the command's config, caught where its handler checks it (nothing loads)
        made.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(handlers, "check", stop)
    defaults, line = RunConfig(), " ".join(flags for flags, _ in given.values()).split()
    for command in (["run"], ["verify", "--method", "pld"], ["tune", "--method", "pld"]):
        for argv in (command, command + line):
            with pytest.raises(SystemExit):
                getattr(handlers, command[0])(build_parser().parse_args(argv))
        bare, full = made[-2:]
        for name, (_, value) in given.items():
            assert getattr(bare, name) == getattr(defaults, name), (command[0], name)
            assert getattr(full, name) == value, (command[0], name)
