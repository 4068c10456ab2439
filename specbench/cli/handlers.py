"""One handler per command: it turns parsed arguments into the library's inputs, calls the library, and prints the
outcome. A handler returns the exit status (None: 0)."""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

from ..config import RunConfig
from ..errors import SpecbenchError
from ..run.inputs import check
from ..tasks import check as check_task
from .parser import config_values


def run_config(args, **settings) -> RunConfig:
    """The RunConfig of the options `run`, `tune` and `verify` share (RunConfig's fields of the model and device
    groups, read back by name), with a command's own `settings` on top."""
    shared = config_values(args, RunConfig, "model") | config_values(args, RunConfig, "device")
    return RunConfig(**(shared | settings))


def _tuned_file(value: str | None) -> str | None:
    """--tuned's file: None without the flag, the default file for a bare --tuned."""
    if value is None:
        return None
    from ..run.tuned import default_path

    return value or str(default_path())


def run(args) -> None:
    cfg = run_config(args, **{**config_values(args, RunConfig), "tuned": _tuned_file(args.tuned)})
    check(cfg)  # before the imports below (seconds of torch and every method): a mistake is one line at once
    if args.dry_run:
        from ..run import plan

        print(plan.describe(plan.make(cfg), cfg.engine))
        return
    from ..run.runner import run as run_matrix

    run_dir = run_matrix(cfg)
    print(f"\nresults: {run_dir}")
    if not args.no_report:
        from ..report.build import build_report, summary

        try:
            path = build_report([run_dir], run_dir / "report")
        except SpecbenchError as err:  # the run itself is fine: say why no report, and how to make one
            print(f"specbench: no report: {err} (specbench report {run_dir} --mixed-devices)", file=sys.stderr)
            return
        print(summary([run_dir]))
        print(f"report: {path}")


def lock(args) -> None:
    """Plan as `run --dry-run` does (the model options and --methods), then pin each hub checkpoint's commit."""
    cfg = RunConfig(**config_values(args, RunConfig, "model"), methods=args.methods)
    check(cfg)
    from ..run import lock as locking
    from ..run import plan

    data = locking.write(args.out, plan.make(cfg))
    print(f"locked {data['model']} in {args.out} (`specbench run --lock {args.out}` runs these):")
    print("\n".join(locking.describe(data)))


def tune(args) -> None:
    cfg = run_config(args, methods=["vanilla", args.method], tasks=args.tasks)
    check(cfg)  # before the imports below, as `run` does
    if not args.no_verify:  # read only after the search, minutes later: a typo fails now
        check_task(args.eval_task)
    from ..tune.command import tune as tune_method
    from ..tune.space import TuneConfig, grid_values

    tune_method(
        TuneConfig(
            args.method,
            cfg,
            args.eval_task,
            args.budget,
            grid_values(args.grid),
            not args.no_verify,
            args.tuned_file,
            args.out,
        )
    )


def verify(args) -> int:
    cfg = run_config(args, methods=["vanilla", args.method], tasks=args.tasks, graphs=args.graphs, batch=[args.batch])
    check(cfg)  # before the imports below, as `run` does
    from ..run.audit import audit

    return audit(cfg, args.method, args.mode, args.temperature, args.samples, args.horizon, args.prompts, args.alpha)


def calibrate(args) -> None:
    cfg = run_config(args, methods=[args.method], tasks=args.tasks)
    check(cfg)  # before the imports below, as `run` does
    from ..tune.confidence import calibrate as calibrate_confidence

    result = calibrate_confidence(cfg, args.method, args.temperature, args.batch, args.out)
    print("| row | steps | temperature | ECE of the survival, raw | calibrated |")
    print("|---|---|---|---|---|")
    for j, (t, n, before, after) in enumerate(
        zip(result.temperatures, result.samples, result.ece_before, result.ece_after, strict=True), start=1
    ):
        print(f"| {j} | {n} | {t:.3g} | {before:.4f} | {after:.4f} |")
    print(f"calibrated drafter: {args.out} (--head dspark={args.out})")


def merge(args) -> None:
    from ..run.merge import merge as merge_shards

    out = merge_shards(args.runs, args.out)
    print(f"merged {len(args.runs)} shards into {out}")


def report(args) -> None:
    from ..report.build import build_report

    out = args.out or Path("reports") / args.sources[0].resolve().name
    print(build_report(args.sources, out, args.title, args.mixed_devices))


def export(args) -> None:
    from ..report.frames import acceptance_table, frame, steps_frame
    from ..report.frames import export as write

    if args.format == "acceptance-csv":
        if args.steps:
            raise SpecbenchError("--format acceptance-csv sums the steps itself: leave out --steps")
        data = acceptance_table(steps_frame(args.sources))
        write(data, args.out, "csv")
        print(f"{args.out}: {len(data)} rows (method x subset) x {len(data.columns)} columns")
        return
    data = (steps_frame if args.steps else frame)(args.sources)
    write(data, args.out, args.format)
    print(f"{args.out}: {len(data)} rows ({'steps' if args.steps else 'turns'}) x {len(data.columns)} columns")


def compare(args) -> int:
    from ..report.compare import Limits, to_json, to_markdown
    from ..report.compare import compare as compare_runs

    limits = Limits(args.max_slowdown, args.min_tau_ratio, args.speedup_only, args.strict)
    result = compare_runs(args.baseline, args.new, limits, args.allow_different_machines)
    print(json.dumps(to_json(result), indent=2, ensure_ascii=False) if args.json else to_markdown(result))
    return 0 if result.passed else 1


def list_(args) -> None:
    """Read from the presets and aliases alone: listing imports no method (and no torch)."""
    from .. import presets

    if args.what == "methods":
        specs = {name: presets.load("methods", name) for name in presets.names("methods")}
        width = max(map(len, specs))
        for name, spec in specs.items():
            print(f"{name:{width}s} {spec.description}{'' if spec.lossless else ' [lossy]'}")
    elif args.what == "models":
        from ..models.aliases import ALIASES
        from ..models.hub import COMMIT

        def shown(source) -> str:
            pinned = source.local or source.gguf or COMMIT.match(source.revision or "")
            return str(source) if pinned else f"{source}  (unpinned: locked at first use)"

        def role(key: str) -> str:
            family, _, name = key.partition(":")
            return f"{family} head '{name}' (as {family}[head={name}])" if name else f"{family} head"

        width = max(map(len, ALIASES))
        for name, spec in ALIASES.items():
            print(f"{name:{width}s} {shown(spec.target)}")
            roles = {"offline": spec.fallback, "draft": spec.draft} | {role(k): v for k, v in spec.heads.items()}
            for what, source in roles.items():
                if source:
                    print(f"{'':{width}s}   {what}: {shown(source)}")
    else:
        from .. import tasks

        width = max(map(len, tasks.available()))
        for name in tasks.available():
            print(f"{name:{width}s} {presets.load('tasks', name).description}")


def _text(given: Path | None, command: str, flag: str) -> Path:
    """A command's training text or prompts: the flag's value, else $SPECBENCH_DATA_DIR."""
    from ..tasks import data_dir

    found = given or data_dir(None)
    if found is None:
        raise SpecbenchError(f"{command} needs text: pass {flag} FILE_OR_FOLDER (or set $SPECBENCH_DATA_DIR)")
    return Path(found)


def _target(name: str) -> None:
    """--target resolves (an alias, a folder that is there, a GGUF file or a hub id), before the heavy imports."""
    from ..models.aliases import resolve

    resolve(name)


def train(args) -> None:
    from ..models import hub
    from ..zoo.text import check_text

    if args.format != "official" and args.kind not in ("eagle3", "peagle", "dflash", "dflash2", "dspark"):
        raise SpecbenchError(
            f"--format {args.format} writes EAGLE-3 and P-EAGLE heads and DFlash, DFlash2 and DSpark drafters only: "
            f"drop it to train {args.kind}"
        )
    data = _text(args.data, "train", "--data")
    check_text(data)
    _target(args.target)
    if args.draft:
        hub.check_local("draft model", hub.parse(args.draft), hub.TRANSFORMERS)
    from ..heads.train import train_head  # imports torch: every input above is there
    from ..heads.train_config import TrainConfig, train_config
    from ..models.loading import device_and_dtype

    knobs = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}  # (every field is an option: cli.parser)
    cfg = train_config(args.kind, args.smoke, **knobs)
    device, dtype = device_and_dtype(args.device, args.dtype)
    result = train_head(
        args.kind, args.target, data, args.out, cfg, device, dtype, args.smoke, args.compact, args.draft, args.format
    )
    accuracy = ", ".join(f"{a:.3f}" for a in result["top1_accuracy_by_depth"])
    print(f"{args.kind} head saved in {args.out}; held-out top-1 accuracy by depth: {accuracy}")


def convert(args) -> None:
    from ..heads.convert import convert as convert_head

    print(convert_head(args.head, args.to, args.out, args.target, args.force))


def engine(args) -> None:
    from ..engines import llamacpp_build

    if args.engine_command == "where":
        try:
            built = str(llamacpp_build.server())
        except SpecbenchError as err:
            built = str(err)
        print(f"llama.cpp {llamacpp_build.VERSION}: {llamacpp_build.home()}\n  llama-server: {built}")
        return
    if args.jobs is not None and args.jobs < 1:
        raise SpecbenchError(f"--jobs must be at least 1, got {args.jobs}")
    print(f"llama-server: {llamacpp_build.build(args.sdist, args.jobs, args.cuda)}")


def token_counts(args) -> None:
    from ..zoo.text import check_text

    if not args.out.is_dir():
        raise SpecbenchError(f"--out {args.out} is not a folder: give the EAGLE head's folder")
    data = _text(args.data, "token-counts", "--data")
    check_text(data)
    _target(args.target)
    from ..heads.frequencies import FILE, count_text  # imports torch: every input above is there

    tokens = count_text(args.target, data, args.out, args.smoke)
    print(f"counted {tokens} tokens of {data} into {args.out / FILE}")


def regenerate(args) -> None:
    from ..zoo.text import check_prompts

    source = _text(args.prompts, "regenerate", "--prompts")
    check_prompts(source)
    _target(args.target)
    from ..zoo.regenerate import regenerate_text  # imports torch: every input above is there

    answered, tokens, skipped = regenerate_text(
        args.target,
        source,
        args.out,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        smoke=args.smoke,
    )
    note = f" ({skipped} prompts longer than the context left out)" if skipped else ""
    print(f"{answered} answered prompts, {tokens} tokens, written to {args.out}{note}")


def zoo(args) -> None:
    from ..tasks import data_dir
    from ..zoo import TINY_DIR, check_family
    from ..zoo.text import check_draft_text

    out = args.out or TINY_DIR
    if args.zoo_command == "card" and not args.measure:
        from ..zoo.card import update_heads_section

        print(update_heads_section(out))
        return
    data = data_dir(args.data_dir)
    if data is None or not data.is_dir():
        what = "zoo card --measure" if args.zoo_command == "card" else "zoo build"
        raise SpecbenchError(f"{what} needs the training text: pass --data-dir (e.g. ../shared/data)")
    if args.zoo_command == "card":
        check_family(out)
        from ..zoo.build import measure_family  # imports torch: the data folder and the family are there

        print(measure_family(out, data, smoke=args.smoke, seed=args.seed))
        return
    for flag, given in (("--tune", args.tune), ("--draft-only", args.draft_only), ("--draft-text", args.draft_text)):
        if given and not args.resume:
            raise SpecbenchError(f"{flag} works on a trained family: use it with --continue")
    if args.tune and args.draft_only:
        raise SpecbenchError("--tune trains the target and --draft-only leaves it as it is: pass one of them")
    if args.draft_text:
        check_draft_text(args.draft_text)
    if args.resume:
        check_family(out)
    from ..zoo.build import build_family, continue_family  # imports torch: every input above is there

    if args.resume:
        stage = "tune" if args.tune else "draft" if args.draft_only else "target"
        print(continue_family(out, data, smoke=args.smoke, seed=args.seed, stage=stage, draft_text=args.draft_text))
    else:
        print(build_family(out, data, smoke=args.smoke, seed=args.seed))
