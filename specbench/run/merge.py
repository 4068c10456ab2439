"""Joining the run folders of `specbench run --shard I/N` (one per array job) into one run folder, refusing
shards of different commands or machines, so the merged run reports as if it had run in one process."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import SpecbenchError

SAME = (
    "model",
    "tasks",
    "temperatures",
    "limit",
    "max_new_tokens",
    "dtype",
    "device",
    "seed",
    "repeats",
    "noise_floor",
    "data_dir",
    "fields",
)


def _manifest(run: Path) -> dict:
    path = run / "manifest.json"
    if not path.is_file():
        raise SpecbenchError(f"{run} is not a run folder (no manifest.json)")
    return json.loads(path.read_text())


def merged_manifest(runs: list[Path], manifests: list[dict]) -> dict:
    """The manifest of the shards joined: shard 1's settings, every shard's methods and where each ran. Refuses
    folders that are not shards, two copies of one shard, and shards of different commands or devices."""
    shards = [m["config"].get("shard") for m in manifests]
    for run, shard in zip(runs, shards, strict=True):
        if not shard:
            raise SpecbenchError(f"{run} is not a shard: merge the folders of `specbench run --shard I/N`")
    counts = sorted({n for _, n in shards})
    if len(counts) > 1:
        raise SpecbenchError(f"the shards split the questions {' and '.join(map(str, counts))} ways: merge one split")
    seen: dict[int, Path] = {}
    for run, (index, _) in zip(runs, shards, strict=True):
        if index in seen:
            raise SpecbenchError(f"{run} and {seen[index]} are both shard {index}/{counts[0]}")
        seen[index] = run
    first = manifests[0]
    for run, m in zip(runs[1:], manifests[1:], strict=True):
        differ = [k for k in SAME if m["config"].get(k) != first["config"].get(k)]
        if differ:
            raise SpecbenchError(f"{run} was run with another {differ[0]} than {runs[0]}: merge shards of one command")
    devices = sorted({m["machine"]["device_name"] for m in manifests})
    if len(devices) > 1:
        raise SpecbenchError(
            f"the shards ran on different devices ({', '.join(devices)}): a merged speedup would pool machines; "
            "report the shards as separate runs"
        )
    missing = sorted(set(range(1, counts[0] + 1)) - set(seen))
    if missing:
        print(
            f"specbench: note: shards {', '.join(map(str, missing))} of {counts[0]} are not merged: their "
            "questions are missing",
            file=sys.stderr,
        )
    methods = list(dict.fromkeys(name for m in manifests for name in m["config"]["methods"]))
    return {
        **first,
        "config": {**first["config"], "methods": methods, "shard": None},
        "shards": [
            {"shard": m["config"]["shard"], "path": str(r), "started": m.get("started"), "machine": m["machine"]}
            for r, m in zip(runs, manifests, strict=True)
        ],
    }


def merge(runs: list[Path], out: Path) -> Path:
    """Answer files concatenated per (task, method, temperature) under the merged manifest. Written to a
    temporary folder first: a failure leaves nothing at `out`."""
    if out.exists():
        raise SpecbenchError(f"{out} already exists: merge into a new folder")
    merged = merged_manifest(runs, [_manifest(r) for r in runs])
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for run in runs:
            for path in sorted((run / "answers").rglob("*.jsonl")):
                target = staging / path.relative_to(run)
                target.parent.mkdir(parents=True, exist_ok=True)
                with target.open("a", encoding="utf-8") as f:
                    f.write(path.read_text(encoding="utf-8"))
        if (runs[0] / "forward_profile.json").is_file():
            shutil.copy(runs[0] / "forward_profile.json", staging / "forward_profile.json")
        (staging / "manifest.json").write_text(json.dumps(merged, indent=2))
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
