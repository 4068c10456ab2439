"""What a run will do, worked out before anything heavy loads: the methods that run and those skipped (and why),
the tasks and their questions, every checkpoint with its revision, cache status and download size; then fetching
those checkpoints and checking they fit the target, so a bad request fails in seconds, not after loading."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import methods, tasks
from ..config import Plan, RunConfig, TaskPlan
from ..core.static_lm import BUCKETS, MAX_CACHE
from ..engines.translate import needed, restrict, server_flags
from ..errors import SpecbenchError
from ..models import aliases, gguf, hub, loading
from ..models.aliases import ModelSpec
from ..models.hub import Checkpoint, Source
from ..registry import HEADS, Need
from . import inputs, lock

WEIGHTS = (".safetensors", ".bin", ".pt", ".gguf")  # a checkpoint's files that hold its weights
DEFAULT_METHODS = ["vanilla", "sps", "pld"]  # `specbench run` without --methods: those of them the model can run


def _source(override: str | None, default: Source | None) -> Source | None:
    return hub.parse(override) if override else default


def need_source(need: Need, spec: ModelSpec, draft: str | None, heads: dict[str, str]) -> Source | None:
    """Where a need is met: --draft / --head first, then the model alias; None when nothing provides it. A named
    head (`eagle3[head=redhat]`) is met by --head eagle3:redhat=... or the alias's head of that name only."""
    if need.kind == "draft":
        return _source(draft, spec.draft)
    given = heads.get(need.key) or (None if need.name else heads.get("*"))
    return _source(given, spec.heads.get(need.key))


def why_missing(need: Need, spec: ModelSpec) -> str:
    if need.kind == "draft":
        return f"{spec.name} has no draft model; pass --draft PATH_OR_HUB_ID"
    title = HEADS[str(need.family)].title
    if need.name:
        named = sorted(k.partition(":")[2] for k in spec.heads if k.startswith(f"{need.family}:"))
        known = f" (its {title} heads are named {', '.join(named)})" if named else ""
        return f"{spec.name} has no {title} head named '{need.name}'{known}; pass --head {need.key}=PATH_OR_HUB_ID"
    fix = f" ({spec.heads_fix})" if spec.heads_fix else ""
    return f"{spec.name} has no {title} head{fix}; pass --head {need.key}=PATH_OR_HUB_ID"


def choose_methods(
    requested: list[str], spec: ModelSpec, draft: str | None, heads: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """`all` becomes every method the model can run and `default` the default set it can run (the rest skipped
    with a reason); a method named explicitly that cannot run is an error. Vanilla runs first: every speedup
    needs it."""
    chosen = {"all": methods.available(), "default": DEFAULT_METHODS}
    names = list(dict.fromkeys(n for r in requested for n in chosen.get(r, [r])))
    names = ["vanilla", *[n for n in names if n != "vanilla"]]
    runnable, skipped = [], {}
    for name in names:
        methods.rule(name)  # a preset whose rule contradicts its label fails here, before anything loads
        missing = [n for n in methods.needs(name) if need_source(n, spec, draft, heads) is None]
        if not missing:
            runnable.append(name)
        elif name not in requested:  # chosen through all or default
            skipped[name] = why_missing(missing[0], spec)
        else:
            raise SpecbenchError(f"{name} cannot run: {why_missing(missing[0], spec)}")
    return runnable, skipped


def sources(names: list[str], spec: ModelSpec, draft: str | None, heads: dict[str, str]) -> dict[str, tuple]:
    """role -> (source, layout) of everything the methods load, the target first."""
    out = {"target": (spec.target, hub.TRANSFORMERS)}
    for name in names:
        for need in methods.needs(name):
            source = need_source(need, spec, draft, heads)
            assert source is not None  # (a method whose need nothing meets was skipped: `choose_methods`)
            if need.kind == "draft":
                out["draft"] = (source, hub.TRANSFORMERS)
            else:
                out[f"{need.key} head"] = (source, HEADS[str(need.family)].layout)
    return out


def _task(name: str, cfg: RunConfig) -> TaskPlan:
    try:
        task = tasks.load(name, cfg.data_dir, cfg.fields, download=False)
    except tasks.NotDownloaded as missing:
        return TaskPlan(name, None, f"read from {missing.url} when the run starts")
    budget = cfg.max_new_tokens or task.max_new_tokens or tasks.MAX_NEW_TOKENS
    return TaskPlan(task.name, len(tasks.limit_per_category(task.questions, cfg.limit)), budget=budget)


def free_bytes(device: torch.device) -> int | None:
    """Memory the device has free now: a GPU's, or the host's available memory (Linux); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if device.type != "cpu" or not meminfo.is_file():
        return None
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    return int(fields["MemAvailable"].split()[0]) * 1024 if "MemAvailable" in fields else None


def check_batch(cfg: RunConfig, plan: Plan, free: int | None) -> None:
    """`--batch B` refused before anything loads when the target's static cache for B slots cannot fit the memory
    `free`: each slot holds at least its prompt's last token, a turn's budget and a verification's widest rows
    (`core.static_lm`: plus the rows a forward may pad), so the bound is a lower one; a target whose config is
    not on this machine yet (or a GGUF) is not checked here."""
    batch = max(cfg.batch)
    target = plan.checkpoints["target"]
    config_file = None if target.source.gguf else hub.local_file(target.source, "config.json")
    if batch <= 1 or cfg.engine != "specbench" or free is None or config_file is None:
        return
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    _, dtype = loading.device_and_dtype(cfg.device, cfg.dtype)
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype.itemsize  # keys and values
    budget = min((t.budget for t in plan.tasks if t.budget), default=1)
    context = min(config.get("max_position_embeddings") or MAX_CACHE, MAX_CACHE, 1 + budget + BUCKETS[-1])
    per_slot = (context + BUCKETS[-1]) * per_token
    weights = sum(size or 0 for name, size in target.listing.files.items() if name.endswith(WEIGHTS))
    if weights + batch * per_slot <= free:
        return
    fits = max(0, (free - weights) // per_slot)
    advice = f"the largest batch that fits is {fits}: pass --batch {fits} or less" if fits else "no batch fits"
    raise SpecbenchError(
        f"--batch {batch} does not fit: the target's static cache takes at least {hub.human_bytes(per_slot)} a slot "
        f"({context + BUCKETS[-1]} tokens), {hub.human_bytes(weights + batch * per_slot)} with its weights, and "
        f"{hub.human_bytes(free)} is free on {cfg.device}; {advice}"
    )


def make(cfg: RunConfig) -> Plan:
    """The plan of a RunConfig; lists checkpoints (hub metadata when reachable) but downloads nothing."""
    spec = aliases.resolve(cfg.model, cfg.revision)
    locked = lock.read(cfg.lock, spec.name) if cfg.lock else None
    requested, engine_skipped = cfg.methods, dict[str, str]()
    if cfg.engine != "specbench":  # first: a method the engine cannot run is skipped, whatever it needs
        named, engine_skipped = restrict([r for r in requested if r not in ("all", "default")], {}, cfg.engine)
        requested = [r for r in requested if r in ("all", "default") or r in named]
    names, skipped = choose_methods(requested, spec, cfg.draft, cfg.heads)
    if cfg.engine != "specbench":  # those `all` chose: before the checkpoints are listed, so none is fetched
        names, skipped = restrict(names, {**engine_skipped, **skipped}, cfg.engine)
    # `all` means the methods of this regime: another engine's own methods are left out, not listed as skipped
    elsewhere = {n for n in methods.available() if (e := methods.preset(n).engine_only()) and cfg.engine not in e}
    names = [n for n in names if n not in elsewhere]
    skipped = {n: why for n, why in skipped.items() if n not in elsewhere}
    task_plans = [_task(t, cfg) for t in cfg.tasks]
    checkpoints = {}
    for role, (source, layout) in sources(names, spec, cfg.draft, cfg.heads).items():
        loading.check_bundled(source.id, role)
        if locked and locked.names(source):  # the lock's commit, whatever the source's own revision
            checkpoints[role] = locked.checkpoint(role, source, layout)
        elif role == "target":
            checkpoints[role] = aliases.target_checkpoint(spec)
        else:
            checkpoints[role] = hub.checkpoint(role, source, layout)
    plan = Plan(spec, names, skipped, task_plans, list(cfg.temperatures), checkpoints)
    if max(cfg.batch) > 1:
        check_batch(cfg, plan, free_bytes(loading.device_and_dtype(cfg.device, cfg.dtype)[0]))
    return plan


def _status(ck: Checkpoint) -> str:
    if ck.source.gguf:
        kind = "GGUF, dequantized when the run starts"
        return f"{kind}" if ck.source.local or ck.available else f"{kind}; fetched with pip first"
    if ck.source.local:
        return "local folder"
    if ck.available:
        return "cached"
    size = ck.download_bytes() if ck.files else None
    return f"not cached: {hub.human_bytes(size)} to download" if size is not None else "not cached: size unknown"


def describe(plan: Plan, engine: str = "specbench") -> str:
    """The plan as `--dry-run` prints it; with `--engine llamacpp`, each method's llama-server flags too."""
    lines = [f"plan for model {plan.spec.name} (dry run: nothing loaded, nothing downloaded)"]
    lines.append(f"methods: {', '.join(plan.methods)}")
    lines += [f"skipped: {name}: {why}" for name, why in plan.skipped.items()]
    for t in plan.tasks:
        count = f"{t.questions} questions" if t.questions is not None else "questions not on this machine"
        lines.append(f"task: {t.name}: {count}" + (f" ({t.note})" if t.note else ""))
    lines.append(f"temperatures: {', '.join(f'{x:g}' for x in plan.temperatures)}")
    lines.append("checkpoints:")
    width = max(len(role) for role in plan.checkpoints)
    for role, ck in plan.checkpoints.items():
        revision = ck.source.revision if lock.unpinned(ck.source) else ck.listing.commit or ck.source.revision
        where = f"{ck.source.id} @ {revision}" if revision else ck.source.id
        lines.append(f"  {role:<{width}}  {where}  [{_status(ck)}{lock.unpinned_note(ck)}]")
    pending = [ck for ck in plan.checkpoints.values() if not ck.source.local and not ck.available]
    sizes = [ck.download_bytes() if ck.files else None for ck in pending]
    known = [s for s in sizes if s is not None]
    if not pending:
        lines.append("to download: nothing, every checkpoint is on this machine")
    elif len(known) == len(sizes):
        lines.append(f"to download: {hub.human_bytes(sum(known))} before the run starts")
    else:
        lines.append(f"to download: {len(pending)} checkpoints whose size is known only once fetched")
    notes = sorted({ck.listing.note for ck in pending if ck.listing.note})
    lines += [f"hub: {note}; cache status only" for note in notes]
    if engine == "llamacpp":
        served = "as published" if plan.checkpoints["target"].source.gguf else "converted to F32 GGUF once"
        lines.append(f"llama-server flags (the target {served}; drafts and heads converted to GGUF once):")
        width = max(len(name) for name in plan.methods)
        for name in plan.methods:
            files = {need: Path(f"<{need} as GGUF>") for need in filter(None, [needed(name, engine)])}
            lines.append(f"  {name:<{width}}  {' '.join(server_flags(name, files)) or '(no --spec-type)'}")
    return "\n".join(lines)


def _target_shape(target: Checkpoint, path: Path, trust_remote_code: bool) -> tuple[int, int]:
    """The target's hidden size and vocabulary from its config.json alone (its weights are not fetched yet)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise SpecbenchError(f"target '{target.source}': cannot read its config ({str(err).splitlines()[0]})") from err
    text = config.get_text_config()
    return text.hidden_size, text.vocab_size


def fetch(plan: Plan, cfg: RunConfig) -> dict[str, Path]:
    """Every checkpoint as a local folder (downloads included), checked against the target before it loads:
    --max-new-tokens against its context and heads against its shape (both fail before its weights are fetched),
    the target last."""
    target = plan.checkpoints["target"]
    config = hub.fetch_file(target, "config.json")
    inputs.fit_context(cfg, plan.spec.name, config)  # a hub target's config may reach this machine only now
    hidden, vocab = _target_shape(target, config, cfg.trust_remote_code)
    paths = {}
    for role, ck in plan.checkpoints.items():
        if role == "target":
            continue
        paths[role] = hub.fetch(ck)
        if role.endswith(" head"):
            key = role.removesuffix(" head")
            family = key.partition(":")[0]
            head_hidden, head_vocab = HEADS[family].fits(paths[role])
            if head_hidden not in (None, hidden) or head_vocab not in (None, vocab):
                raise SpecbenchError(
                    f"{HEADS[family].title} head '{ck.source}' is for hidden size {head_hidden} and vocabulary "
                    f"{head_vocab}; target '{target.source.id}' has {hidden} and {vocab}: pass a head trained for "
                    f"this target with --head {key}=PATH_OR_HUB_ID"
                )
    paths["target"] = hub.fetch(target)
    if "draft" in paths:
        draft_tokenizer = loading.load_tokenizer(paths["draft"], cfg.trust_remote_code)
        if not loading.same_tokenizer(draft_tokenizer, loading.load_tokenizer(paths["target"], cfg.trust_remote_code)):
            raise SpecbenchError(
                f"draft '{plan.checkpoints['draft'].source}' uses a different tokenizer from target "
                f"'{target.source}': a draft must share it"
            )
    return dict(sorted(paths.items(), key=lambda kv: kv[0] != "target"))


def revisions(plan: Plan, paths: dict[str, Path]) -> dict[str, dict]:
    """What the manifest records of each checkpoint: its source and the revision actually loaded."""
    out: dict[str, dict] = {}
    for role, ck in plan.checkpoints.items():
        loaded = paths[role].name if not ck.source.local and hub.COMMIT.match(paths[role].name) else None
        out[role] = {"source": ck.source.id, "revision": loaded, "requested_revision": ck.source.revision}
        if ck.source.gguf:
            out[role]["gguf"] = gguf.provenance(paths[role])  # file, sha256, quantization, what it was stored as
    return out
