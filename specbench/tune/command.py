"""`specbench tune`: the fastest setting of one method's size knobs for this device, model and dtype. It searches
(calibrate, predict), verifies the predicted winner against the default in a paired run on another task, and saves
the faster of the two for `run --tuned`."""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import replace
from pathlib import Path

from tabulate import tabulate

from .. import methods, tasks
from ..errors import SpecbenchError
from ..machine import machine
from ..methods import variant_name
from ..report import metrics
from ..run import tuned
from ..run.session import Session
from .calibrate import Tuner, measure
from .cost import Score, geometric_mean
from .space import TuneConfig, space


def tune(cfg: TuneConfig) -> dict:
    """Search, verify, save; returns the saved entry."""
    if cfg.method == "vanilla":
        raise SpecbenchError("vanilla has nothing to tune: name a speculative method, e.g. --method eagle2")
    run_cfg = replace(cfg.run, methods=["vanilla", cfg.method])
    space(cfg.method, cfg.grid)  # a bad grid fails before anything loads
    if cfg.eval_task in run_cfg.tasks:
        raise SpecbenchError(
            f"calibrate on another task than the evaluation task '{cfg.eval_task}' (--tasks), "
            "or the choice is checked on the questions it was fitted to"
        )
    session = Session.open(run_cfg)
    device, dtype = session.device, str(session.dtype).removeprefix("torch.")
    model = session.spec.name  # the name `run --tuned` looks the entry up by (plan.spec.name)
    loaded = [tasks.load(t, run_cfg.data_dir, run_cfg.fields) for t in run_cfg.tasks]
    questions = [q for t in loaded for q in tasks.limit_per_category(t.questions, run_cfg.limit)]
    budget = run_cfg.max_new_tokens or max(t.max_new_tokens or tasks.MAX_NEW_TOKENS for t in loaded)  # as `run`
    tuner = Tuner(cfg, session, questions, budget)
    scores, cut = tuner.search()
    tokenizer = session.tokenizer
    del session, tuner  # the verification run loads its own models
    defaults = dict(methods.preset(cfg.method).params)
    default = next(s for s in scores if s.params == defaults)
    best = max(scores, key=lambda s: s.predicted)
    winner = variant_name(cfg.method, best.params, defaults)
    out = cfg.out or Path("results") / f"tune-{Path(run_cfg.model).name}-{cfg.method}"
    out.mkdir(parents=True, exist_ok=True)
    chosen, note = best, "predicted fastest (not verified)"
    if cfg.verify:
        key = zlib.crc32(json.dumps([winner, cfg.eval_task, run_cfg.limit, run_cfg.max_new_tokens]).encode())
        names = list(dict.fromkeys([cfg.method, winner]))
        measured, vanilla, taus = measure(cfg, names, out / f"verify-{key:08x}", tokenizer)
        assert best.cost is not None  # every calibrated score has one
        vanilla.speed = vanilla.speed_against(best.cost)
        for s in scores:
            s.predicted_eval = geometric_mean(vanilla, s)
        for name, s in zip(names, (default, best), strict=False):
            s.measured = measured[name]
            at_tau = replace(s, by_question={q: (tau, s.step) for q, tau in taus[name].items()}, rows_by_question={})
            s.predicted_at_tau = geometric_mean(vanilla, at_tau, calibration=True)
        chosen, note = best, "measured at least as fast as the default"
        assert best.measured is not None and default.measured is not None  # measured above
        if best.measured.value < default.measured.value:
            chosen, note = default, "the default measured faster than the predicted winner"
    entry = {
        "variant": variant_name(cfg.method, chosen.params, defaults),
        "params": chosen.params,
        "predicted": round(chosen.predicted, 4),
        "predicted_eval": _round(chosen.predicted_eval),
        "predicted_at_measured_tau": _round(chosen.predicted_at_tau),
        "measured": _speedup(chosen.measured),
        "default": {
            "predicted": round(default.predicted, 4),
            "predicted_eval": _round(default.predicted_eval),
            "predicted_at_measured_tau": _round(default.predicted_at_tau),
            "measured": _speedup(default.measured),
        },
        "chosen": note,
        "calibration": {
            "tasks": run_cfg.tasks,
            "questions": len(questions),
            "max_new_tokens": budget,
            "settings_scored": len(scores),
            "cut_by_budget": cut,
        },
        "evaluation_task": cfg.eval_task if cfg.verify else None,
        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "specbench_revision": machine(device)["git_revision"],
    }
    path = cfg.tuned_file or tuned.default_path()
    device_key = tuned.device_key(device)
    tuned.save(path, device_key, model, dtype, cfg.method, entry)
    (out / "scores.json").write_text(json.dumps([_row(s, cfg.method, defaults) for s in scores], indent=1))
    print(summary(cfg.method, scores, default, best, defaults))
    print(f"\n{cfg.method}: kept {entry['variant']} ({note}); saved to {path} for {device_key}")
    return entry


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _speedup(s: metrics.Speedup | None) -> dict | None:
    return None if s is None else {"value": round(s.value, 4), "low": round(s.low, 4), "high": round(s.high, 4)}


def _row(s: Score, method: str, defaults: dict) -> dict:
    return {
        "variant": variant_name(method, s.params, defaults),
        "tau": round(s.tau, 4),
        "rows": round(s.rows, 2),
        "draft_ms": round(s.draft * 1e3, 3),
        "predicted": round(s.predicted, 4),
        "predicted_if_drafting_were_free": round(s.free_draft, 4),
        "predicted_eval": _round(s.predicted_eval),
        "measured": _speedup(s.measured),
    }


def summary(method: str, scores: list[Score], default: Score, best: Score, defaults: dict) -> str:
    """The five best predictions, the default and the winner, with what the verification measured."""
    top = sorted(scores, key=lambda s: -s.predicted)[:5]
    shown = top + [s for s in (default,) if s not in top]
    rows = []
    for s in shown:
        tag = "winner" if s is best else "default" if s is default else ""
        m = s.measured
        measured = metrics.format_ratio(m.value, m.low, m.high) if m is not None else ""
        on_eval, at_tau = (f"{x:.2f}x" if x is not None else "" for x in (s.predicted_eval, s.predicted_at_tau))
        rows.append(
            [
                variant_name(method, s.params, defaults),
                tag,
                f"{s.tau:.2f}",
                f"{s.rows:.1f}",
                f"{s.draft * 1e3:.1f}",
                f"{s.predicted:.2f}x",
                f"{s.free_draft:.2f}x",
                on_eval,
                at_tau,
                measured,
            ]
        )
    header = [
        "setting",
        "",
        "tau",
        "rows/step",
        "draft ms/step",
        "predicted (calibration)",
        "if drafting were free",
        "predicted (evaluation)",
        "predicted at its measured tau",
        "measured (evaluation)",
    ]
    return tabulate(rows, header, tablefmt="github")
