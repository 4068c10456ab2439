import hashlib
import json

import pytest

from specbench import presets, tasks
from specbench.errors import SpecbenchError
from specbench.models.chat import VICUNA_SYSTEM, prompt_ids, vicuna_prompt

from .conftest import DATA


def test_quick_task_is_built_in():
    task = tasks.load("quick")
    assert len(task.questions) == 12
    assert {q.group for q in task.questions} == {
        "mt_bench",
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
    }
    assert all(len(q.turns) == 2 for q in task.questions if q.group == "mt_bench")


def test_spec_bench_from_data_dir():
    task = tasks.load("spec_bench", DATA)
    assert len(task.questions) == 480 and sum(len(q.turns) for q in task.questions) == 560
    assert sum(q.group == "mt_bench" for q in task.questions) == 80
    limited = tasks.limit_per_category(task.questions, 3)
    assert len(limited) == 18 and [q.id for q in limited[:3]] == [81, 82, 83]


@pytest.mark.parametrize("name,count", [("mt_bench", 80), ("gsm8k", 40), ("xsum", 40), ("cnn_dm", 40)])
def test_other_tasks_from_data_dir(name, count):
    task = tasks.load(name, DATA)
    assert len(task.questions) == count and all(q.turns[0] for q in task.questions)


def test_download_checks_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "CACHE_DIR", tmp_path / "cache")
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"turns": ["hello"]}) + "\n")
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    source = presets.TaskSource(file="x/q.jsonl", url=data.as_uri(), sha256=digest)
    path = tasks._source_file(source, None)
    assert path == tmp_path / "cache" / "data" / "x" / "q.jsonl" and path.read_bytes() == data.read_bytes()
    data.write_text("changed\n")  # the cached copy is used from now on
    assert tasks._source_file(source, None) == path
    with pytest.raises(SpecbenchError, match="sha256"):
        tasks._source_file(presets.TaskSource(file="y/q.jsonl", url=data.as_uri(), sha256=digest), None)


def test_missing_local_only_file_says_what_to_do(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(tasks, "CACHE_DIR", tmp_path)
    monkeypatch.delenv("SPECBENCH_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # at once, not after ~20 s of retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SpecbenchError, match="--data-dir"):
        tasks.load("cnn_dm", None)


def test_jsonl_defaults_and_errors(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text(json.dumps({"question": "a?", "category": "c"}) + "\n" + json.dumps({"question": "b?"}) + "\n")
    task = tasks.from_file(good)
    assert [q.turns for q in task.questions] == [["a?"], ["b?"]] and task.questions[1].category == "t"
    with pytest.raises(SpecbenchError, match=r"t\.jsonl:1: no 'nope' field"):
        tasks.from_file(good, {"prompt": "nope"})
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n" + json.dumps({"id": 1, "prompt": "y"}) + "\n")
    with pytest.raises(SpecbenchError, match="not unique"):
        tasks.from_file(dup)


def test_vicuna_fallback_matches_template(tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models[0])
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    with_template = prompt_ids(tokenizer, messages)
    tokenizer.chat_template = None
    assert prompt_ids(tokenizer, messages) == with_template
    assert vicuna_prompt(messages) == f"{VICUNA_SYSTEM} USER: Hi ASSISTANT: Hello</s>USER: Bye ASSISTANT:"


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json"])
def test_csv_parquet_and_json_files_load_like_jsonl(tmp_path, suffix):
    import pandas as pd

    rows = pd.DataFrame({"question": ["What is 2 + 2?", "Name a colour."], "kind": ["math", "qa"], "n": [7, 8]})
    path = tmp_path / f"mine{suffix}"
    {".csv": rows.to_csv, ".parquet": rows.to_parquet, ".json": rows.to_json}[suffix](
        path, **({"index": False} if suffix != ".json" else {"orient": "records", "lines": True})
    )
    task = tasks.load(str(path), field_map={"id": "n", "category": "kind"})
    assert [(q.id, q.category, q.turns) for q in task.questions] == [
        (7, "math", ["What is 2 + 2?"]),
        (8, "qa", ["Name a colour."]),
    ]


def test_a_file_of_another_format_is_a_one_line_error(tmp_path):
    path = tmp_path / "mine.xlsx"
    path.write_text("x")
    with pytest.raises(SpecbenchError, match=r"mine\.xlsx: a task file is \.jsonl, \.json, \.csv, \.parquet"):
        tasks.load(str(path))


def test_hub_tasks_read_the_pinned_revision_and_skip_placeholder_rows(monkeypatch, capsys):
    import datasets

    calls = []

    def load_dataset(repo, config, split, revision):
        calls.append((repo, config, split, revision))
        return datasets.Dataset.from_list(
            [
                {"question_id": 1, "category": "qa", "turns": ["Who wrote Emma?"]},
                {
                    "question_id": 2,
                    "category": "rag",
                    "turns": ["FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE"],
                },
            ]
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    task = tasks.load("speed_bench")
    assert calls == [("nvidia/SPEED-Bench", "qualitative", "test", "487aa718444e816458d1a0a52bfce7a454285cf4")]
    assert [(q.id, q.category, q.turns) for q in task.questions] == [(1, "qa", ["Who wrote Emma?"])]
    assert "1 of 2 questions skipped: their data is not redistributed" in capsys.readouterr().err
    with pytest.raises(tasks.NotDownloaded, match="hub dataset nvidia/SPEED-Bench at 487aa71"):
        tasks.load("speed_bench", download=False)  # a dry run reads nothing


def test_hub_fields_apply_to_hub_records_only(monkeypatch):
    import datasets

    rows = [{"prompt_id": "ab12", "category": "writing", "prompt": ["Write a haiku.", "Now a limerick."]}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kw: datasets.Dataset.from_list(rows))
    (question,) = tasks.load("mt_bench").questions
    assert (question.id, question.group, question.turns) == ("ab12", "writing", ["Write a haiku.", "Now a limerick."])


def test_an_uncached_hub_dataset_offline_is_a_one_line_error(tmp_path):
    """The real `datasets` in offline mode with an empty cache: the error names the dataset and what to do."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("SPECBENCH_DATA_DIR", None)
    code = "from specbench import tasks\ntry:\n    tasks.load('gsm8k')\nexcept tasks.SpecbenchError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = out.stdout.strip()
    assert line.startswith("hub dataset openai/gsm8k (main) at 740312a is not cached"), out
    assert "pass --data-dir" in line and "\n" not in line


def test_bad_hub_revision_is_refused(tmp_path, monkeypatch):
    (tmp_path / "pinned.yaml").write_text("source: {file: a.jsonl, hub: {id: a/b, split: test, revision: main}}\n")
    monkeypatch.setitem(tasks.presets._EXTRA, "tasks", [tmp_path])
    with pytest.raises(SpecbenchError, match="hub.revision must be a 40-hex-digit commit, not 'main'"):
        tasks.load("pinned")


def test_a_bad_jsonl_line_prints_only_our_error(tmp_path, capfd):
    """datasets' own error line (pyarrow's parse error) stays quiet: the user sees one line naming the bad line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n{bad json\n')
    with pytest.raises(SpecbenchError, match=r"bad.jsonl:2: not valid JSON"):
        tasks.read_records(bad)
    captured = capfd.readouterr()
    assert "Failed to load" not in captured.err + captured.out and "pyarrow" not in captured.err + captured.out


BUCKETS = ["1k", "2k", "8k", "16k", "32k"]
SPEED_BENCH = DATA / "speed_bench" / "throughput.jsonl"  # made-up rows in the throughput configs' layout


@pytest.mark.parametrize("bucket", BUCKETS)
def test_speed_bench_throughput_buckets_read_their_config_with_the_tiers_as_categories(
    bucket, monkeypatch, capsys, tmp_path
):
    import datasets

    calls = []

    def load_dataset(repo, config, split, revision):
        calls.append((repo, config, split, revision))
        return datasets.Dataset.from_list(tasks.read_jsonl(SPEED_BENCH))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("SPECBENCH_DATA_DIR", raising=False)
    name = f"speed_bench_throughput_{bucket}"
    task = tasks.load(name)
    assert calls == [("nvidia/SPEED-Bench", f"throughput_{bucket}", "test", "487aa718444e816458d1a0a52bfce7a454285cf4")]
    assert f"{bucket} bucket: 1,536 prompts of about {int(bucket[:-1]) * 1000:,} input tokens" in task.description
    assert [q.group for q in task.questions] == ["low_entropy"] * 2 + ["mixed"] * 2 + ["high_entropy"] * 2
    assert all(q.category == q.group and len(str(q.id)) == 32 and len(q.turns) == 1 for q in task.questions)
    assert f"task {name}: 3 of 9 questions skipped: their data is not redistributed" in capsys.readouterr().err
    with pytest.raises(tasks.NotDownloaded, match="hub dataset nvidia/SPEED-Bench at 487aa71"):
        tasks.load(name, tmp_path, download=False)  # a dry run reads nothing: the data dir has no file of it
    assert len(calls) == 1


def test_a_rebuilt_throughput_file_in_the_data_dir_comes_before_the_hub(monkeypatch, capsys, tmp_path):
    """specdec_bench's prepare_data.py writes the complete parquet (no placeholder left): read instead of the hub."""
    import pandas as pd

    def no_hub(hub):
        raise AssertionError(f"read {hub.id} from the hub although the data dir has the file")

    monkeypatch.setattr(tasks, "hub_records", no_hub)
    rows = pd.read_json(SPEED_BENCH, lines=True)
    rows["turns"] = [[f"Rebuilt prompt {i}."] for i in range(len(rows))]
    path = tmp_path / "speed_bench" / "throughput_8k" / "test.parquet"
    path.parent.mkdir(parents=True)
    rows.to_parquet(path, index=False)
    task = tasks.load("speed_bench_throughput_8k", tmp_path)
    assert [q.turns for q in task.questions] == [[f"Rebuilt prompt {i}."] for i in range(9)]
    assert {q.category for q in task.questions} == {"low_entropy", "mixed", "high_entropy"}
    assert "skipped" not in capsys.readouterr().err
