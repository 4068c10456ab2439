"""A run's options checked before anything heavy is imported or loaded: the settings (--device and --dtype by
name), each method and variant (from the presets' YAML alone), each task (a preset's name or a file that exists),
every file and folder the command line names (--data-dir, --lock, --tuned, and the local --model, --draft and
--head checkpoints, listed against their layouts), and --max-new-tokens and the tasks of a length bucket against the
target's context (its config.json, where it is on this machine). A mistake is one line and exit status 2 within a
second, before torch is imported, not after the target has loaded; `plan.make` then checks what needs the methods'
code or the hub (what the model can run, the checkpoints), and `fit_prompts` the questions once the target's
tokenizer is on this machine."""

from __future__ import annotations

import json
from pathlib import Path

from .. import presets, tasks
from ..config import RunConfig
from ..core import synthetic
from ..engines import llamacpp_build
from ..errors import SpecbenchError
from ..heads.folder import HEAD_LAYOUTS, read_config
from ..models import aliases, hub, placement
from ..models.aliases import ModelSpec
from . import lock, tuned


def check(cfg: RunConfig) -> None:
    """Every option of `cfg` that can be judged without torch, the methods' modules or the network."""
    _settings(cfg)
    for name in cfg.methods:
        method = presets.method(name) if name not in ("all", "default") else None
        if method and method.engine_only() and cfg.engine not in method.engine_only():
            raise SpecbenchError(f"{name} runs only in an engine: add {method.engine_flags()}")
    for name in cfg.tasks:
        tasks.check(name)
    tasks.data_dir(cfg.data_dir)
    if cfg.engine == "llamacpp":
        llamacpp_build.server()  # built, or one line saying how
    spec = aliases.resolve(cfg.model, cfg.revision)
    if cfg.lock:
        lock.read(cfg.lock, spec.name)
    if cfg.tuned is not None:
        tuned.presets(Path(cfg.tuned), spec.name)
    _checkpoints(cfg, spec)
    fit_context(cfg, spec.name, hub.local_file(spec.target, "config.json"))


def _checkpoints(cfg: RunConfig, spec: ModelSpec) -> None:
    """The checkpoints on this machine that the command line names (a --model folder or GGUF, --draft, --head),
    listed against their layouts as the plan lists them, and their config.json read as the loaders read it: one
    missing, lacking its weights or config.json, or whose config.json is no JSON object, is one line. A bare --head
    PATH, whose family the method decides, has only to exist."""
    named: dict[str, tuple[hub.Source, hub.Layout | None]] = {}
    if cfg.model not in aliases.ALIASES:
        named["target"] = (spec.target, hub.TRANSFORMERS)
    if cfg.draft:
        named["draft"] = (hub.parse(cfg.draft), hub.TRANSFORMERS)
    for key, path in cfg.heads.items():
        family = key.partition(":")[0]
        named["head" if key == "*" else f"{key} head"] = (hub.parse(path), HEAD_LAYOUTS.get(family))  # "*": none
    for role, (source, layout) in named.items():
        hub.check_local(role, source, layout)
        if source.local and not source.gguf and layout is not None and "config.json" in layout.required:
            read_config(source.id, role)


def _context(cfg: RunConfig, model: str, config: Path | None) -> tuple[int, str, str] | None:
    """The tokens prompt and answer may fill together, how to name that limit, and how to get more: config.json's
    max_position_embeddings, as the decode loop reads it (with --graphs or a batch above 1, at most the static
    cache's). None when the config is not on this machine (a hub target not cached), unreadable or without the key:
    the load says more."""
    if config is None:
        return None
    try:
        context = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):  # unreadable, or not a JSON object: the load says why
        return None
    if not isinstance(context, int):
        return None
    where, more = f"{model}'s context of {context} tokens", "use a model with a longer context"
    static = "--graphs" if cfg.graphs else "--batch" if max(cfg.batch, default=1) > 1 else None
    if static:
        from ..core.static_lm import MAX_CACHE  # imports torch: only with a static cache

        if context > MAX_CACHE:
            context, where = MAX_CACHE, f"the static KV cache of {static} ({MAX_CACHE} tokens)"
            more = "drop --graphs" if cfg.graphs else "keep --batch at 1"
    return context, where, more


def fit_context(cfg: RunConfig, model: str, config: Path | None) -> None:
    """Refuse what the target's context (`_context`) cannot hold, rather than cap it: a --max-new-tokens beside a
    one-token prompt, and a length bucket's task (`input_tokens`) beside its answers. Decoding would stop where
    prompt and answer fill the context, so the setting asked for would not be the one measured; and a bucket's
    prompts all have about its length, so a bucket that does not fit is refused at once, with those that do, rather
    than question by question once the target is fetched."""
    buckets = _buckets(cfg, cfg.tasks)
    if cfg.max_new_tokens is None and not buckets:
        return
    limit = _context(cfg, model, config)
    if limit is None:
        return
    context, where, more = limit
    if cfg.max_new_tokens is not None and cfg.max_new_tokens >= context:
        raise SpecbenchError(
            f"--max-new-tokens {cfg.max_new_tokens} does not fit {where}, prompt and answer together: "
            f"pass at most {context - 1}"
        )
    too_long = [name for name, (prompt, answer) in buckets.items() if prompt + answer > context]
    if too_long:
        prompt, answer = buckets[too_long[0]]
        fit = [name for name, (p, a) in _buckets(cfg, tasks.available()).items() if p + a <= context]
        ways = [f"run {' or '.join(fit)}"] if fit else []
        if cfg.max_new_tokens is not None and prompt < context:
            ways.append(f"pass --max-new-tokens {context - prompt} or fewer")
        raise SpecbenchError(
            f"task{'s' * (len(too_long) > 1)} {', '.join(too_long)}: prompts of about {prompt} tokens"
            f"{' or more' * (len(too_long) > 1)} and answers of up to {answer} do not fit {where}: "
            + ", ".join(ways + [f"or {more}" if ways else more])
        )


def _buckets(cfg: RunConfig, names: list[str]) -> dict[str, tuple[int, int]]:
    """The length buckets' tasks among `names` (presets with `input_tokens`), shortest first: name -> (their
    prompts' length, the run's tokens per answer)."""
    out = {}
    for name in names:
        spec = None if tasks.is_file(name) else presets.load("tasks", name)
        if spec is not None and spec.input_tokens is not None:
            out[name] = (spec.input_tokens, cfg.max_new_tokens or spec.max_new_tokens or tasks.MAX_NEW_TOKENS)
    return dict(sorted(out.items(), key=lambda item: item[1]))


def fit_prompts(cfg: RunConfig, model: str, target: Path, questions: list[tasks.Question]) -> None:
    """Refuse a question whose first prompt fills the target's context (`_context`), with the target's tokenizer
    alone: once the target is fetched, before its weights load (a minute for a large one) rather than after. Later
    turns hold the model's own answers, so only the run can tell whether they fit."""
    limit = _context(cfg, model, target / "config.json")
    if limit is None:
        return
    context = limit[0]
    from ..models.chat import fitting_prompt
    from ..models.loading import load_tokenizer  # imports torch: the run has by now

    tokenizer = load_tokenizer(target, cfg.trust_remote_code)
    vocab = _vocabulary(target / "config.json")
    for question in questions:
        ids = fitting_prompt(tokenizer, question.turns, [], context, question.id, question.thinking)
        if vocab is not None and ids and max(ids) >= vocab:
            raise SpecbenchError(
                f"question {question.id}'s prompt holds token id {max(ids)}, past {model}'s vocabulary of {vocab} "
                "(config.json vocab_size): its folder's tokenizer is not the model's; give the model its own"
            )


def _vocabulary(config: Path) -> int | None:
    """config.json's vocab_size (a multimodal model's text config's), or None when it has none or is unreadable."""
    try:
        raw = json.loads(config.read_text())
        vocab = raw.get("vocab_size", (raw.get("text_config") or {}).get("vocab_size"))
    except (OSError, ValueError, AttributeError):  # the load says why
        return None
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _settings(cfg: RunConfig) -> None:
    """The options that are wrong whatever the model: a value out of range, or one that needs another."""
    placement.check_device(cfg.device)
    placement.check_dtype(cfg.dtype)
    if cfg.limit is not None and cfg.limit < 1:
        raise SpecbenchError(f"--limit must be at least 1, got {cfg.limit}")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens <= 0:
        raise SpecbenchError(f"--max-new-tokens must be positive, got {cfg.max_new_tokens}")
    if any(t < 0 for t in cfg.temperatures):
        raise SpecbenchError("temperatures must be >= 0")
    if cfg.repeats < 1:
        raise SpecbenchError(f"--repeats must be at least 1, got {cfg.repeats}")
    if cfg.shard and not 1 <= cfg.shard[0] <= cfg.shard[1]:
        raise SpecbenchError(f"--shard {cfg.shard[0]}/{cfg.shard[1]}: write I/N with 1 <= I <= N, e.g. 2/4")
    if cfg.workers is not None and cfg.workers < 1:
        raise SpecbenchError(f"--workers must be at least 1, got {cfg.workers}")
    if cfg.threads is not None and cfg.threads < 1:
        raise SpecbenchError(f"--threads must be at least 1, got {cfg.threads}")
    if cfg.ray_address and not cfg.workers:
        raise SpecbenchError("--ray-address needs --workers N: how many workers to run on that cluster")
    engine = f"--engine {cfg.engine}"
    if cfg.engine not in ("specbench", "vllm", "llamacpp"):
        raise SpecbenchError(
            f"unknown --engine '{cfg.engine}': use specbench (our loop, the default), vllm or llamacpp"
        )
    if cfg.concurrency and cfg.engine == "specbench":
        raise SpecbenchError("--concurrency applies to engine mode: add --engine vllm or --engine llamacpp")
    if cfg.one_engine_at_a_time and cfg.engine != "vllm":
        raise SpecbenchError("--one-engine-at-a-time applies to vLLM's engine mode: add --engine vllm")
    if cfg.concurrency and cfg.shard:
        raise SpecbenchError("--concurrency needs all of a task's questions in one run: drop --shard")
    if cfg.concurrency and min(cfg.concurrency) < 1:
        raise SpecbenchError(f"--concurrency levels must be at least 1, got {min(cfg.concurrency)}")
    if cfg.engine != "specbench" and (cfg.workers or cfg.repeats > 1):
        raise SpecbenchError(f"--{'workers' if cfg.workers else 'repeats'} applies to our loop, not to {engine}")
    if min(cfg.batch, default=0) < 1:
        raise SpecbenchError(f"--batch sizes must be at least 1, got {','.join(map(str, cfg.batch)) or 'none'}")
    if max(cfg.batch) > 1 and cfg.engine != "specbench":
        raise SpecbenchError(
            f"--batch above 1 runs in our loop: drop {engine} (engine mode batches with --concurrency)"
        )
    if cfg.acceptance is not None:
        synthetic.parse(cfg.acceptance)
        if cfg.engine != "specbench":
            raise SpecbenchError(f"--acceptance synthetic forces our loop's verdicts: drop {engine}")
    if cfg.graphs and cfg.engine != "specbench":
        raise SpecbenchError(f"--graphs captures our loop's own forwards: drop {engine} (one regime per run)")
