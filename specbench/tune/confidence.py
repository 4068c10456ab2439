"""`specbench calibrate`: a DSpark drafter's confidence head calibrated by Sequential Temperature Scaling
(`core.calibration`; the paper's post-hoc step) on held-out questions. The method decodes them in this loop with
every drafted row verified, keeping each step's confidence logits and accepted drafts; the temperatures go into a
new drafter folder's config.json (`confidence_temperatures`, and `confidence_calibration`: what they were
measured on), beside links to the source's weights, for `--head dspark=DIR`."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .. import methods, tasks
from ..config import RunConfig, question_seed
from ..core.calibration import Calibration, row_errors, sts
from ..errors import SpecbenchError
from ..methods.dspark import DSpark
from ..presets import variant
from ..progress import Progress
from ..run.session import Session

TOKENS = 128  # tokens per turn when neither --max-new-tokens nor the task says


def calibrate(cfg: RunConfig, method: str, temperature: float, batch: int, out: Path) -> Calibration:
    """Decode cfg's tasks (cfg.limit questions per category) with `method` (a dspark variant) `batch` at a time
    at `temperature`, calibrate its confidences by STS and write the calibrated drafter folder `out`."""
    base, params = variant(method)
    if base != "dspark":
        raise SpecbenchError(f"calibrate calibrates DSpark's confidence head: --method dspark[...], not '{method}'")
    if params.get("verify", "all") != "all" or params.get("confidence_threshold") or params.get("tree") is not None:
        raise SpecbenchError(
            f"--method {method}: calibrate verifies every row of the chain: drop verify, confidence_threshold and tree"
        )
    if out.exists() and any(out.iterdir()):
        raise SpecbenchError(f"--out {out} is not empty: name a new folder")
    if temperature < 0 or batch < 1:
        raise SpecbenchError("--temperature must be >= 0 and --batch >= 1")
    cfg = replace(cfg, methods=[method], batch=[batch])
    questions = [
        q
        for t in cfg.tasks
        for q in tasks.limit_per_category(tasks.load(t, cfg.data_dir, cfg.fields).questions, cfg.limit)
    ]
    session = Session.open(cfg)
    drafting = methods.build_batch(method, session.resources, batch, {"record": True})
    assert isinstance(drafting, DSpark) and drafting.recorded is not None  # (record: a DSpark recording)
    source = session.resources.head_path("dspark")
    budget = cfg.max_new_tokens or TOKENS
    target = session.target_for(batch, questions, budget)
    bar = Progress(len(questions), f"calibrating {method}", "questions")
    for start in range(0, len(questions), batch):
        group = questions[start : start + batch]
        seeds = [question_seed(cfg.seed, q.id, temperature) for q in group]
        session.answer_batch(method, target, drafting, group, budget, temperature, seeds)
        bar.update(len(group))
    bar.close()
    recorded = drafting.recorded
    if not recorded:
        raise SpecbenchError(f"{method} drafted nothing on {', '.join(cfg.tasks)}: give questions with answers")
    rows = max(len(logits) for logits, _ in recorded)
    logits = torch.zeros(len(recorded), rows)
    for i, (row, _) in enumerate(recorded):
        logits[i, : len(row)] = torch.tensor(row)
    drafted = torch.tensor([len(row) for row, _ in recorded])
    accepted = torch.tensor([a for _, a in recorded])
    result = sts(logits, accepted, drafted)
    present = drafting.draft.temperatures
    if present:  # (a drafter calibrated before: its temperatures scored on these questions too)
        errors = ", ".join(f"{e:.4f}" for e in row_errors(logits, accepted, drafted, present))
        print(f"the drafter's present temperatures {present}: ECE per row {errors} on these questions")
    measured = {
        "method": "sts",
        "tasks": cfg.tasks,
        "questions": len(questions),
        "steps": len(recorded),
        "temperature": temperature,
        "target": session.spec.name,
        **{k: v for k, v in asdict(result).items() if k != "temperatures"},
    }
    write(source, out, result.temperatures, measured)
    return result


def write(source: Path, out: Path, temperatures: list[float], measured: dict) -> None:
    """`out`: the drafter folder `source` with the temperatures in its config.json, its other files linked (one
    folder made whole, then moved into place)."""
    raw = json.loads((source / "config.json").read_text())
    raw["confidence_temperatures"], raw["confidence_calibration"] = temperatures, measured
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".calibrating-", dir=out.parent))
    try:
        (staging / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for path in source.iterdir():
            if path.name != "config.json" and path.is_file():
                os.symlink(path.resolve(), staging / path.name)
        if out.exists():
            out.rmdir()  # (empty: checked above)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
