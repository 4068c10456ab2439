"""The cost model: a setting's predicted paired speedup from its calibration statistics.

A step costs its verification, T(rows, context) (the target's forward, profiled after a short and a long context)
times the run's measured verification over the profiled one, plus its drafting (the run's propose time scaled by
the setting's own, growing with the context as the calibration steps' did). A question's predicted time is each
turn's fixed cost plus tokens / tau steps; the predicted speedup is the geometric mean over questions of vanilla's
measured time over that. Why each part looks as it does: docs/tuning.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..report import metrics
from ..report.cells import forward_time


@dataclass(frozen=True)
class Cost:
    """T(n, context): the target's forward over n new tokens after `context` cached ones, profiled at a few
    context lengths (n interpolated as `forward_time` does) and linear in the context between and past them:
    attention reads every cached key, so a tree costs more, relative to one token, after a long prompt."""

    profiles: dict[int, dict[int, float]]  # context -> {n: seconds}

    def __call__(self, n: float, context: float) -> float:
        xs = sorted(self.profiles)
        ys = [forward_time(self.profiles[x], n) for x in xs]
        if len(xs) == 1:
            return ys[0]
        i = min(max(int(np.searchsorted(xs, context)) - 1, 0), len(xs) - 2)  # the segment, extended past the ends
        return ys[i] + (ys[i + 1] - ys[i]) * (context - xs[i]) / (xs[i + 1] - xs[i])


@dataclass
class Score:
    """One setting's calibration statistics and predicted speedup."""

    params: dict
    tau: float
    rows: float  # mean rows verified per step, root included
    draft: float  # seconds of drafting per step
    predicted: float  # on the calibration questions
    step: float = 0.0  # predicted seconds per step: verification and drafting
    extra: float = 0.0  # fixed seconds per turn beyond vanilla's (the proposer's start)
    predicted_eval: float | None = None  # the same statistics applied to the evaluation run's vanilla answers
    predicted_at_tau: float | None = None  # ... with the tau it measured there per question: the cost model alone
    free_draft: float = 0.0  # predicted on the calibration questions if drafting cost nothing: what verifying bounds
    measured: metrics.Speedup | None = None
    by_question: dict = field(default_factory=dict)  # calibration question -> (tau, step) on it alone
    groups: dict = field(default_factory=dict)  # calibration question -> its group (Spec-Bench subtask)
    rows_by_question: dict = field(default_factory=dict)  # calibration question -> mean rows verified per step
    verify_scale: float = 1.0  # the calibration run's verification seconds per profiled forward second
    cost: Cost | None = None
    context: float = 0.0  # the calibration steps' mean context (tokens committed before the step)
    draft_slope: float = 0.0  # seconds of drafting more per step for each token of context more (>= 0)
    pace: float | None = None  # `Turns.speed` of the vanilla answers beside the calibration run: the machine's pace

    def predict(
        self,
        fixed: float,
        tokens: float,
        turns: int,
        question=None,
        context: float | None = None,
        speed: float | None = None,
    ) -> float:
        """Seconds of a question whose vanilla answer spent `fixed` seconds outside its steps, for `tokens`
        new tokens over `turns` turns; with the tau and step cost of calibration question `question`. Given the
        question's mean `context`, the step is costed there instead: its verification (with that question's
        rows) and its drafting (a draft model's or head's attention reads the context too). Given the `speed`
        of the vanilla run it is compared with (`Turns.speed_against`), the step moves from the pace of the
        vanilla answered beside the calibration run to that run's: this CPU's pace drifts. Vanilla against
        vanilla: the method's own verification over the profile (`verify_scale`) also holds what its loop adds
        (drafting between forwards evicts the target's weights from cache), which a vanilla run does not show."""
        tau, step = self.by_question.get(question, (self.tau, self.step))
        if context is not None and self.cost is not None:
            rows = self.rows_by_question.get(question, self.rows)
            draft = max(self.draft + self.draft_slope * (context - self.context), 0.0)
            step = draft + self.verify_scale * self.cost(rows, context)
        if speed is not None and self.pace:
            step *= speed / self.pace
        return fixed + turns * self.extra + tokens / tau * step


def draft_slope(contexts: list[int], seconds: list[float]) -> float:
    """Seconds of drafting per step more for each token of context more: the least-squares line through the
    calibration steps, never below zero (noise must not make a long context predict cheaper drafting)."""
    if len(set(contexts)) < 2:
        return 0.0
    return max(float(np.polyfit(np.asarray(contexts, dtype=float), np.asarray(seconds), 1)[0]), 0.0)


def verify_scale(measured: list[float], profiled: list[float]) -> float:
    """The calibration steps' verification seconds over their profiled forward seconds (same rows, same context).
    A ratio, not seconds added: the run verifies its largest tree only, and what separates it from the profile is
    mostly the machine's speed drifting between the two (acceptance and commit took ~1 ms of a 74 ms 60-row
    verification on the tiny target), which slows a smaller tree's forward in proportion."""
    return sum(measured) / sum(profiled) if sum(profiled) > 0 else 1.0


@dataclass
class Turns:
    """Per turn of a calibration run: its question, new tokens and fixed seconds (wall minus its steps)."""

    questions: list = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    fixed: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    groups: dict = field(default_factory=dict)  # question -> its group
    contexts: dict = field(default_factory=dict)  # question -> mean tokens before each of its new tokens (if known)
    step_contexts: list[int] = field(default_factory=list)  # tokens before each step, when the prompts are known
    verify_seconds: float = 0.0  # the verification time of those steps, summed
    speed: float | None = None  # `speed_against`: this run's one-token forwards over the profiled ones

    def add(self, question, group: str, gen, prompt_length: int | None = None) -> None:
        self.questions.append(question)
        self.groups[question] = group
        self.tokens.append(len(gen.tokens))
        self.wall.append(gen.wall_time)
        self.fixed.append(gen.wall_time - sum(s.draft_time + s.verify_time for s in gen.steps))
        if prompt_length is not None:
            before = itertools.accumulate((s.accept_length for s in gen.steps), initial=prompt_length)
            self.step_contexts += list(before)[: len(gen.steps)]
            self.verify_seconds += sum(s.verify_time for s in gen.steps)

    def speed_against(self, cost: Cost) -> float | None:
        """Vanilla's verification seconds over what the profile says its one-token steps take: how fast the
        machine ran during this run against during the profile (None: no steps recorded with their context)."""
        profiled = sum(cost(1, c) for c in self.step_contexts)
        return self.verify_seconds / profiled if profiled > 0 else None

    def per_question(self, values: Sequence[float]) -> dict:
        out: dict = {}
        for q, v in zip(self.questions, values, strict=True):
            out[q] = out.get(q, 0.0) + v
        return out


def geometric_mean(vanilla: Turns, score: Score, calibration: bool = False) -> float:
    """The predicted paired speedup: the geometric mean over vanilla's questions of its measured seconds / the
    setting's predicted ones. The geometric mean weighs the questions a setting does badly on, as the measured
    one will: on the calibration questions each gets its own tau and step cost; on other questions (the
    evaluation's) each is predicted with the tau and step cost of every calibration question of its group (the
    Spec-Bench subtask: how draftable answers are depends on it) in turn, or of every one if none shares it."""
    wall, fixed = vanilla.per_question(vanilla.wall), vanilla.per_question(vanilla.fixed)
    tokens, turns = vanilla.per_question(vanilla.tokens), vanilla.per_question([1] * len(vanilla.tokens))
    logs = []  # per question: its predicted log speedup, averaged over the calibration questions it is read by
    for q in wall:
        spread = [q] if calibration else [c for c in score.by_question if score.groups.get(c) == vanilla.groups.get(q)]
        context = vanilla.contexts.get(q)
        logs.append(
            np.mean(
                [
                    math.log(wall[q] / score.predict(fixed[q], tokens[q], int(turns[q]), c, context, vanilla.speed))
                    for c in spread or list(score.by_question) or [None]
                ]
            )
        )
    return math.exp(np.mean(logs))
