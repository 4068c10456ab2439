"""Tasks: a YAML preset (or a user's JSONL, JSON, CSV or Parquet file) -> questions with ids, categories and one
or more turns. Files are read through `datasets`."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import presets
from .errors import SpecbenchError

CACHE_DIR = Path(os.environ.get("SPECBENCH_CACHE", Path.home() / ".cache" / "specbench"))
MAX_NEW_TOKENS = 256  # tokens per answer of a task that sets none, without --max-new-tokens


@dataclass(frozen=True)
class Question:
    id: int | str
    category: str  # the label stored in the data (Spec-Bench's 13 labels for spec_bench)
    group: str  # the reporting category (Spec-Bench's six subtasks for spec_bench)
    turns: list[str]
    thinking: bool = False  # its task's `thinking`: the chat template's enable_thinking (Qwen3's)


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    questions: list[Question]
    max_new_tokens: int | None = None
    thinking: bool = False  # the preset's `thinking`, also on each question (whose prompts it renders)


class NotDownloaded(SpecbenchError):
    """The task's data file is neither local nor cached, and downloading was not allowed."""

    def __init__(self, url: str) -> None:
        super().__init__(f"the task's data is not on this machine: it would be read from {url}")
        self.url = url


def available() -> list[str]:
    return presets.names("tasks")


def data_dir(explicit: str | Path | None) -> Path | None:
    """--data-dir, else $SPECBENCH_DATA_DIR, else none (then files are downloaded). A --data-dir that is no folder is
    refused, not passed over for a download."""
    if explicit and not Path(explicit).expanduser().is_dir():
        raise SpecbenchError(f"--data-dir {explicit} is not a folder: pass the folder that holds the data files")
    value = explicit or os.environ.get("SPECBENCH_DATA_DIR")
    return Path(value).expanduser() if value else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _download(url: str, sha256: str | None, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, tmp.open("wb") as f:
            f.write(response.read())
    except OSError as err:
        raise SpecbenchError(
            f"could not download {url} ({err}): pass --data-dir with a local copy, or set SPECBENCH_DATA_DIR"
        ) from err
    if sha256 and _sha256(tmp) != sha256:
        tmp.unlink()
        raise SpecbenchError(f"{url} does not match its recorded sha256 {sha256}: the upstream file changed")
    tmp.replace(dest)
    return dest


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failures come back as our one-line errors
    return datasets


def hub_records(hub: presets.HubDataset) -> list[dict]:
    """A hub dataset's split at its pinned revision, through `datasets` (cached in HF_DATASETS_CACHE; offline
    with HF_DATASETS_OFFLINE=1 or HF_HUB_OFFLINE=1, when cached)."""
    datasets = _quiet_datasets()
    name = f"{hub.id}{f' ({hub.config})' if hub.config else ''} at {hub.revision[:7]}"
    try:
        table = datasets.load_dataset(hub.id, hub.config, split=hub.split, revision=hub.revision)
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpecbenchError(
            f"hub dataset {name} is not cached and could not be fetched ({reason}): connect once to cache it, "
            "or pass --data-dir with a local copy"
        ) from err
    return _records(table)


def _records(table) -> list[dict]:
    """A datasets table's rows, fields a row lacks (None) left out, as a JSON line would have them."""
    return [{k: v for k, v in record.items() if v is not None} for record in table.to_list()]


def _source_file(source: presets.TaskSource, data: Path | None, download: bool = True) -> Path:
    """The task's data file: in the data dir, in the download cache, or downloaded now (when `download`)."""
    rel = source.file
    if data is not None and (data / rel).is_file():
        return data / rel
    cached = CACHE_DIR / "data" / rel
    if cached.is_file() and (not source.sha256 or _sha256(cached) == source.sha256):
        return cached
    if not source.url:
        where = f"{data / rel}" if data else f"<data-dir>/{rel}"
        raise SpecbenchError(
            f"this task reads {where}: pass --data-dir (or set SPECBENCH_DATA_DIR) to a folder with it"
        )
    if not download:
        raise NotDownloaded(source.url)
    return _download(source.url, source.sha256, cached)


FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder


def is_file(name: str) -> bool:
    """Whether `name` is a task file (by its suffix, or an existing file) rather than a preset's name."""
    return Path(name).suffix.lower() in FORMATS or Path(name).is_file()


def _builder(path: Path) -> str:
    """The `datasets` builder that reads a task file, by its suffix."""
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise SpecbenchError(f"{path}: a task file is {', '.join(FORMATS)}")
    return kind


def _existing(path: Path) -> Path:
    """A task file that exists; one line naming what a task can be when it does not."""
    if not path.is_file():
        raise SpecbenchError(
            f"task file {path} does not exist: give a {', '.join(FORMATS)} file or a task ({', '.join(available())})"
        )
    return path


def check(name: str) -> None:
    """What `load` would refuse before reading a question, here without `datasets`, torch or the network, so a run
    names a mistake before its heavy imports: an unknown preset, a preset's bad YAML, a task file that is missing
    or of a format not read."""
    if is_file(name):
        _builder(_existing(Path(name)))
    else:
        presets.load("tasks", name)


def read_records(path: Path) -> list[dict]:
    """A local file's records through `datasets` (its Arrow cache makes a second read cheap), fields that a
    record lacks left out. A JSON-lines file `datasets` cannot read is read line by line, which names a bad
    line or reads lines whose field types differ (Arrow needs one type per field)."""
    kind = _builder(path)
    datasets = _quiet_datasets()
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as err:
        if kind == "json":
            return read_jsonl(path)
        raise SpecbenchError(f"{path}: not readable as {kind} ({str(err).splitlines()[0]})") from err
    return _records(table)


def read_jsonl(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecbenchError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise SpecbenchError(f"{path}:{lineno}: expected a JSON object per line")
            records.append(record)
    return records


def _questions(
    records: list[dict], path: Path, fields: dict, default_category: str, groups: dict, thinking: bool = False
) -> list[Question]:
    """Map raw records to questions. fields: id, category, turns (a list field) or prompt (a template or field)."""
    group_of = {label: group for group, labels in groups.items() for label in labels}
    questions = []
    for i, record in enumerate(records, 1):
        where = f"{path}:{i}"
        try:
            if "turns" in fields:
                turns = record[fields["turns"]]
                turns = [turns] if isinstance(turns, str) else list(turns)
            else:
                template = fields.get("prompt", "{prompt}")
                template = template if "{" in template else "{" + template + "}"
                turns = [template.format(**record)]
        except KeyError as err:
            raise SpecbenchError(
                f"{where}: no '{err.args[0]}' field (map the prompt with --field prompt=NAME or turns=NAME)"
            ) from err
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise SpecbenchError(f"{where}: the prompt must be a non-empty string or list of strings")
        qid = record.get(fields.get("id", "question_id"), record.get("id", i))
        category = str(record.get(fields.get("category", "category"), default_category))
        questions.append(Question(qid, category, group_of.get(category, category), turns, thinking))
    if len({q.id for q in questions}) != len(questions):
        raise SpecbenchError(f"{path}: question ids are not unique (map a unique field with --field id=NAME)")
    return questions


def from_file(path: str | Path, field_map: dict[str, str] | None = None) -> Task:
    """A user's file (FORMATS): `turns` (list) or `prompt`/`question`/`instruction`/`text` (string) per record,
    by default."""
    path = _existing(Path(path))
    records = read_records(path)
    if not records:
        raise SpecbenchError(f"{path}: no records")
    fields = dict(field_map or {})
    if "turns" not in fields and "prompt" not in fields:
        first = records[0]
        key = next((k for k in ("turns", "prompt", "question", "instruction", "text") if k in first), None)
        if key is None:
            raise SpecbenchError(f"{path}:1: no turns/prompt/question/instruction/text field: map one with --field")
        fields["turns" if key == "turns" else "prompt"] = key
    return Task(path.stem, f"questions from {path}", _questions(records, path, fields, path.stem, {}))


def load(
    name: str, data: str | Path | None = None, field_map: dict[str, str] | None = None, download: bool = True
) -> Task:
    """A preset name from tasks/, or a path to a task file; `download=False` raises NotDownloaded instead."""
    if is_file(name):
        return from_file(name, field_map)
    spec = presets.load("tasks", name)
    fields = spec.fields or {"turns": "turns"}
    local = data_dir(data)
    hub = spec.source.hub if spec.source else None
    if spec.questions is not None:
        records, path = spec.questions, presets.path("tasks", name)
    elif hub and not (local and (local / spec.source.file).is_file()):
        if not download:
            raise NotDownloaded(f"hub dataset {hub.id} at {hub.revision[:7]} (cached by datasets)")
        records, path = hub_records(hub), Path(f"{hub.id}@{hub.revision[:7]}")
        fields = hub.fields or fields
    else:
        path = _source_file(spec.source, local, download)
        records = read_records(path)
    if spec.placeholder:
        kept = [r for r in records if spec.placeholder not in json.dumps(r, ensure_ascii=False)]
        if len(kept) < len(records):
            print(
                f"task {name}: {len(records) - len(kept)} of {len(records)} questions skipped: their data is not "
                "redistributed (placeholder text)",
                file=sys.stderr,
            )
        records = kept
    fields = {**fields, **(field_map or {})}
    questions = _questions(records, path, fields, spec.category or name, spec.category_groups, spec.thinking)
    return Task(name, spec.description, questions, spec.max_new_tokens, spec.thinking)


def groups(name: str) -> dict[str, list[str]]:
    """A task preset's reporting groups in their order: group -> the category labels it holds."""
    return dict(presets.load("tasks", name).category_groups)


def limit_per_category(questions: list[Question], limit: int | None) -> list[Question]:
    """The first `limit` questions of each reporting category, in file order."""
    if limit is None:
        return questions
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        if seen.get(q.group, 0) < limit:
            seen[q.group] = seen.get(q.group, 0) + 1
            out.append(q)
    return out
