"""The YAML presets: where they live (`methods/` and `tasks/` in a checkout, `specbench/_presets/` in a wheel,
plus folders added at run time by `registry.add_methods`) and the keys each kind may hold, read into typed
objects so a misspelt key or a wrong type fails in one line naming the file and the key; and method variants
(`eagle2[top_k=6]`), checked against their preset's params. Nothing here imports torch: a run's methods are
checked before anything heavy loads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import SpecbenchError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


ENGINES = ("vllm", "llamacpp")  # engine mode's engines, each a method preset key of its name


class MethodPreset(Strict):
    implementation: str | None  # a name registered with registry.implementation; null: an engine's method only
    description: str = ""
    color: str | None = Field(None, pattern=r"^#[0-9a-fA-F]{6}$")  # the report's, as #rrggbb (None: its family's)
    lossless: bool = True  # results are labelled from it; must agree with the acceptance rule
    needs: str | list[str] | None = None  # "draft", "eagle head", ... (registry.parse_needs)
    head: str | None = Field(None, pattern=r"^[\w.-]+$")  # a named head of the model alias (`eagle3[head=redhat]`)
    acceptance: str | dict[str, Any] | None = None  # a rule name or {rule: NAME, param: value} (acceptance.rule)
    params: dict[str, Any] = {}  # keyword arguments of the implementation's build
    tune: dict[str, list[Any]] = {}  # param -> the values `specbench tune` tries (the default's value among them)
    vllm: dict[str, Any] | str | None = None  # `run --engine vllm`: its speculative_config, or why vLLM cannot run it
    llamacpp: dict[str, Any] | str | None = None  # `run --engine llamacpp`: llama-server's flags, or why it cannot

    @model_validator(mode="after")
    def _runs_somewhere(self) -> MethodPreset:
        if self.implementation is None and not any(isinstance(x, dict) for x in (self.vllm, self.llamacpp)):
            raise ValueError("implementation: null needs an engine that runs the method (a vllm: or llamacpp: mapping)")
        return self

    def engine_only(self) -> list[str]:
        """The engines that run a method our loop has no implementation of (empty: our loop runs it)."""
        if self.implementation is not None:
            return []
        return [engine for engine in ENGINES if isinstance(getattr(self, engine), dict)]

    def engine_flags(self) -> str:
        """How to ask for the engines that run an engine-only method: "--engine vllm or --engine llamacpp"."""
        return " or ".join(f"--engine {e}" for e in self.engine_only())


class HubDataset(Strict):
    id: str  # a hub dataset repository, read with datasets.load_dataset
    config: str | None = None
    split: str
    revision: str  # the dataset repository's commit (40 hex digits): the data never changes under a run
    fields: dict[str, str] | None = None  # the hub records' field names, when they differ from the file's

    @model_validator(mode="after")
    def _pinned(self) -> HubDataset:
        if len(self.revision) != 40 or any(c not in "0123456789abcdef" for c in self.revision):
            raise ValueError(f"hub.revision must be a 40-hex-digit commit, not '{self.revision}'")
        return self


class TaskSource(Strict):
    file: str  # path under the data dir (and the download cache)
    url: str | None = None  # where to download it, pinned to a commit
    sha256: str | None = None  # of the downloaded file
    hub: HubDataset | None = None  # else from this hub dataset, cached by `datasets`

    @model_validator(mode="after")
    def _one_remote(self) -> TaskSource:
        if self.url and self.hub:
            raise ValueError("give at most one of source.url and source.hub")
        return self


class TaskPreset(Strict):
    description: str = ""
    source: TaskSource | None = None
    questions: list[dict[str, Any]] | None = None  # built-in questions instead of a source
    fields: dict[str, str] | None = None  # question key -> record field or "{field}" template
    category: str | None = None  # the category of every question without one
    category_groups: dict[str, list[str]] = {}  # reporting group -> the category labels it holds, in order
    max_new_tokens: int | None = None
    input_tokens: int | None = None  # a length bucket's prompt tokens: refused where prompt and answer cannot fit
    placeholder: str | None = None  # text standing in for data that is not redistributed: such questions skipped
    thinking: bool = False  # the chat template's enable_thinking (Qwen3's): its published drafters are non-thinking

    @model_validator(mode="after")
    def _one_source(self) -> TaskPreset:
        if (self.source is None) == (self.questions is None):
            raise ValueError("give exactly one of source and questions")
        return self


SCHEMAS: dict[str, type[Strict]] = {"methods": MethodPreset, "tasks": TaskPreset}

_HERE = Path(__file__).resolve().parent
_EXTRA: dict[str, list[Path]] = {}


def preset_dir(kind: str) -> Path:
    for candidate in (_HERE / "_presets" / kind, _HERE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise SpecbenchError(f"the {kind} presets are missing from this installation (reinstall specbench)")


def add_dir(kind: str, folder: Path) -> None:
    """Presets in `folder` join the built-in ones (a name defined twice is an error)."""
    if folder not in _EXTRA.setdefault(kind, []):
        clash = sorted({p.stem for p in folder.glob("*.yaml")} & set(names(kind)))
        if clash:
            raise SpecbenchError(f"{folder}: {kind[:-1]} preset '{clash[0]}' already exists; rename it")
        _EXTRA[kind].append(folder)


def _paths(kind: str) -> dict[str, Path]:
    found = {}
    for folder in (preset_dir(kind), *_EXTRA.get(kind, [])):
        found.update({p.stem: p for p in folder.glob("*.yaml")})
    return found


def names(kind: str) -> list[str]:
    return sorted(_paths(kind))


def path(kind: str, name: str) -> Path:
    found = _paths(kind)
    if name not in found:
        raise SpecbenchError(f"unknown {kind[:-1]} '{name}': choose from {', '.join(sorted(found))}")
    return found[name]


def load(kind: str, name: str) -> Any:
    """The preset as its kind's typed object (MethodPreset, TaskPreset)."""
    where = path(kind, name)
    try:
        with where.open() as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        raise SpecbenchError(f"{where}: not readable YAML ({str(err).splitlines()[0]})") from err
    if not isinstance(raw, dict):
        raise SpecbenchError(f"{where}: a preset is a mapping of keys to values")
    schema = SCHEMAS[kind]
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        raise SpecbenchError(f"{where}: {_first_error(err, schema)}") from None


def _first_error(err: ValidationError, schema: type[Strict]) -> str:
    """One line for the first problem: the key (dotted path) and what is wrong with it."""
    first = err.errors()[0]
    key = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
        return f"unknown key '{key}' (allowed: {', '.join(schema.model_fields)})"
    if first["type"] == "extra_forbidden":
        return f"unknown key '{key}'"
    if first["type"] == "missing":
        return f"key '{key}' is missing"
    return f"key '{key}': {first['msg']}" if key else first["msg"].removeprefix("Value error, ")


_VARIANT = re.compile(r"^([\w.-]+)\[(.*)\]$")
# the values a variant may give a parameter, by the type of the preset's value (bool first: a bool is an int)
_KINDS: tuple[tuple[type, tuple[type, ...], str], ...] = (
    (bool, (bool,), "true or false"),
    (int, (int,), "a whole number"),
    (float, (int, float), "a number"),
    (str, (str,), "a string"),
)


def variant(name: str) -> tuple[str, dict]:
    """'eagle2[top_k=6,depth=4]' -> ('eagle2', {'top_k': 6, 'depth': 4}); values are read as YAML scalars."""
    match = _VARIANT.match(name)
    if match is None:
        if "[" in name or "]" in name:
            raise SpecbenchError(f"method '{name}': write a variant as base[key=value,...], e.g. eagle2[top_k=6]")
        return name, {}
    params = {}
    for item in match.group(2).split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key.isidentifier() or not value:
            raise SpecbenchError(f"method '{name}': write parameters as key=value, e.g. eagle2[top_k=6,depth=4]")
        try:
            params[key] = yaml.safe_load(value)
        except yaml.YAMLError:  # e.g. a list cut at its comma: the commas between brackets separate parameters
            raise SpecbenchError(
                f"method '{name}': cannot read {key}={value}; give a number, true, false, null or a word"
            ) from None
    return match.group(1), params


def variant_name(base: str, params: dict, defaults: dict) -> str:
    """What `variant` reads back: 'eagle2[top_k=6,depth=4]', the params that differ from `defaults` in their order;
    a string bare where it reads back as itself ('draft_dtype=bfloat16'). A variant `base` keeps what it names
    that `params` does not change (`eagle3[head=redhat]` -> 'eagle3[head=redhat,top_k=4]')."""
    root, given = variant(base)
    merged = {**given, **{k: v for k, v in params.items() if defaults.get(k) != v}}
    changed = [f"{k}={_scalar(v)}" for k, v in merged.items()]
    return f"{root}[{','.join(changed)}]" if changed else root


def _scalar(value: Any) -> str:
    return value if isinstance(value, str) and yaml.safe_load(value) == value else json.dumps(value, default=str)


def check_params(method: str, defaults: dict[str, Any], params: dict[str, Any]) -> None:
    """Each of `params` must be one of the preset's (`defaults`) and, where the preset's value is a boolean, a whole
    number, a number or a string, of that kind: one line naming the choices before anything loads, rather than a
    builder's TypeError once the target has. Lists (a tree's paths) and params whose preset value is null are left
    to the builder."""
    for key, value in params.items():
        if key not in defaults:
            known = f"its parameters are {', '.join(defaults)}" if defaults else "it has no parameters"
            raise SpecbenchError(f"{method}: unknown parameter '{key}'; {known}")
        default = defaults[key]
        kind = next(((accepted, words) for t, accepted, words in _KINDS if isinstance(default, t)), None)
        if kind is None or isinstance(value, (list, dict)):
            continue
        accepted, words = kind
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            raise SpecbenchError(
                f"{method}: parameter '{key}' takes {words} (its preset's is {_scalar(default)}), got {_scalar(value)}"
            )


def method(name: str) -> MethodPreset:
    """A method's preset; for a variant `base[key=value,...]`, base's with those params changed, each checked
    against base's (`check_params`)."""
    base, overrides = variant(name)
    spec = load("methods", base)
    head = overrides.pop("head", spec.head)  # names one of the alias's heads, not a parameter of the method
    if head is not None and not (isinstance(head, str) and re.match(r"^[\w.-]+$", head)):
        raise SpecbenchError(f"method '{name}': head={head} is not a head's name (a word, e.g. head=redhat)")
    check_params(base, spec.params, overrides)
    if not overrides and head == spec.head:
        return spec
    return spec.model_copy(update={"params": {**spec.params, **overrides}, "head": head})
