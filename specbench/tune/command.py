"""`specbench tune`: the fastest setting of one method's size knobs for this device, model and dtype.

Calibration, on a task other than the one the choice is checked on: one greedy run of the method for each
setting of its plain knobs (the preset's `tune:` values), with its nested knobs (`registry.Nested`) at their
largest values, each question answered by vanilla just before, as `specbench run` interleaves them (this CPU's
pace drifts by up to a quarter within a minute: only a vanilla answered beside a run prices its steps). At
each step the run keeps what the method's snapshot needs; after each turn, the tree every smaller nested
setting would have proposed at that root is scored against the turn's own output: at T = 0 the target appends
the longest path of the tree that the output follows, plus its own token. So one run scores a whole grid,
exactly, at the roots it visited.

Prediction: a setting's step costs its verification, T(rows, context) (the target's forward, profiled after a
short and a long context, at the step's context) times the run's measured verification time over the profiled
one (acceptance and commit, and the machine's speed during the run against during the profile: a ratio, as a
drift slows a small tree's forward as much as the largest one's the run verified), and its drafting: the
run's measured propose time scaled by the setting's own propose time at one state, plus the run's measured
update cost, growing with the context as the calibration steps' drafting did. A question's predicted time is
each turn's fixed cost (prefill, proposer start) plus tokens / tau steps, with the question's own tau and rows;
the predicted speedup is the geometric mean over questions of vanilla's measured time over that: the paired
speedup, predicted.

Verification: a `specbench run` of vanilla, the default and the winner on the evaluation task; the faster of
default and winner is what the tuned-presets file keeps. Each setting's calibrated tau and step cost are also
applied to that run's vanilla answers (their lengths, contexts and fixed costs; nothing the method did there),
each question with the tau and rows of the calibration questions of its group and T at its own context, which
predicts the evaluation's own speedup: its questions are not the calibration's, nor as long.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import yaml
from tabulate import tabulate

from .. import methods, registry, tasks
from ..config import RunConfig, question_seed
from ..core.decode import clock
from ..core.proposer import Proposal, Proposer, Turn
from ..core.tree import Tree
from ..errors import SpecbenchError
from ..machine import OtherLoad, machine, too_busy
from ..models.chat import turn_prompts
from ..report import frames, metrics
from ..report.cells import forward_time
from ..report.sources import load_sources
from ..run import runner, tuned
from ..run.session import Session
from ..run.worker import forward_profile

PROFILE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)
PROFILE_CONTEXTS = (64, 512)  # cached tokens the forward is profiled after (`Cost`)
CALIBRATION_SHARE = 0.6  # of the budget: no new calibration run starts past it (verification needs the rest)


@dataclass
class TuneConfig:
    method: str
    run: RunConfig  # model, device, dtype, calibration tasks, limit, max_new_tokens, seed, ...
    eval_task: str = "quick"
    budget_minutes: float = 10.0
    grid: dict[str, list] = field(default_factory=dict)  # replaces the preset's `tune:` values for these keys
    verify: bool = True
    tuned_file: Path | None = None  # None: tuned.default_path()
    out: Path | None = None


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
        self, fixed: float, tokens: float, turns: int, question=None, context: float | None = None,
        speed: float | None = None,
    ) -> float:  # fmt: skip
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


def accepted(tree: Tree, continuation: list[int]) -> int:
    """Tokens a greedy target appends verifying `tree` when its own tokens from the root on are `continuation`:
    the longest path of the tree the continuation follows, plus the target's next token (at most what is left)."""
    kids = tree.children()
    row = matched = 0
    while matched < len(continuation):
        row = next((c for c in kids[row] if tree.tokens[c - 1] == continuation[matched]), 0)
        if row == 0:
            break
        matched += 1
    return min(matched + 1, len(continuation))


def _size(value) -> float:
    """A nested knob's value for ordering; None (a preset's "all", e.g. nodes: null) is the largest."""
    return math.inf if value is None else value


def variant(method: str, params: dict, defaults: dict) -> str:
    """'eagle2[top_k=6,depth=4]': the params that differ from the preset's, in the preset's order; a string
    bare where it reads back as itself ('draft_dtype=bfloat16')."""
    changed = [f"{k}={_scalar(v)}" for k, v in params.items() if defaults.get(k) != v]
    return f"{method}[{','.join(changed)}]" if changed else method


def _scalar(value) -> str:
    return value if isinstance(value, str) and yaml.safe_load(value) == value else json.dumps(value)


class Recorder(Proposer):
    """Wraps the method's proposer: times each propose and keeps (committed length, depth budget, snapshot)."""

    def __init__(self, inner: Proposer, nested: registry.Nested | None, device: torch.device) -> None:
        self.inner, self.nested, self.device = inner, nested, device
        self.feature_layers = inner.feature_layers
        self.records: list[tuple[int, int, object]] = []
        self.propose_times: list[float] = []

    def start(self, turn: Turn) -> None:
        self.inner.start(turn)

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        t0 = clock(self.device)
        proposal = self.inner.propose(tokens, max_depth)
        self.propose_times.append(clock(self.device) - t0)
        snapshot = self.nested.snapshot(self.inner, proposal) if self.nested else None
        self.records.append((len(tokens), max_depth, snapshot))
        return proposal

    def update(self, tokens, proposal, feedback) -> None:
        self.inner.update(tokens, proposal, feedback)

    def clear(self) -> None:
        self.records.clear()
        self.propose_times.clear()


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

    def per_question(self, values: list[float]) -> dict:
        out: dict = {}
        for q, v in zip(self.questions, values, strict=True):
            out[q] = out.get(q, 0.0) + v
        return out


def space(method: str, grid: dict[str, list]) -> tuple[list[dict], list[dict]]:
    """(the plain-knob values of each calibration run, the nested-knob settings each run scores); the preset's
    `tune:` values with `grid` replacing some, the default's value always among them."""
    spec = methods.preset(method)
    defaults = spec.params
    values = {**spec.tune, **grid}
    if not values:
        raise SpecbenchError(f"method '{method}' has nothing to tune: its preset has no `tune:` values; "
                             "pass --grid KEY=V1,V2 with a parameter of its preset")  # fmt: skip
    for key, vals in values.items():
        if key not in defaults:
            raise SpecbenchError(f"'{key}' is not a parameter of method '{method}' (it has {', '.join(defaults)})")
        if defaults[key] not in vals:
            values[key] = [*vals, defaults[key]]
    nested = registry.IMPLEMENTATIONS[spec.implementation].nested
    nested_keys = [k for k in (nested.keys if nested else ()) if k in values]
    plain = [k for k in values if k not in nested_keys]
    runs = [dict(zip(plain, combo, strict=True)) for combo in itertools.product(*(values[k] for k in plain))]
    runs.sort(key=lambda r: any(r[k] != defaults[k] for k in plain))  # the default's run first
    settings = [dict(zip(nested_keys, c, strict=True)) for c in itertools.product(*(values[k] for k in nested_keys))]
    return runs, settings


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
        logs.append(np.mean([math.log(wall[q] / score.predict(fixed[q], tokens[q], int(turns[q]), c, context,
                                                              vanilla.speed))
                             for c in spread or list(score.by_question) or [None]]))  # fmt: skip
    return math.exp(np.mean(logs))


class Unbuildable(SpecbenchError):
    """A grid setting this model cannot run (e.g. `draft_vocab` for a head without token counts): tune goes on
    without it, saying why."""


class Tuner:
    def __init__(self, cfg: TuneConfig, session: Session, questions: list, budget: int) -> None:
        self.cfg, self.session, self.questions, self.budget = cfg, session, questions, budget
        self.spec = methods.preset(cfg.method)
        self.defaults = dict(self.spec.params)
        self.nested = registry.IMPLEMENTATIONS[self.spec.implementation].nested
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return (time.perf_counter() - self.started) / 60

    def _answer(self, name: str, proposer: Proposer, turns: Turns, vanilla: Turns) -> Iterator[tuple]:
        """Every calibration question answered greedily by vanilla (into `vanilla`) and then by the method, as
        `specbench run` interleaves them (the first question once more before, as a warm-up): this CPU's pace
        drifts by up to a quarter over tens of seconds, so only a vanilla answered beside the method's answers
        tells what the method's steps cost against vanilla's."""
        pairs = ((methods.build("vanilla", self.session.resources), "vanilla", vanilla), (proposer, name, turns))
        for who, label, _ in pairs:
            self.session.answer(label, who, self.questions[0], min(16, self.budget), 0.0, 0)
        if isinstance(proposer, Recorder):
            proposer.clear()
        for q in self.questions:
            seed = question_seed(self.cfg.run.seed, q.id, 0.0)
            for who, label, into in pairs:
                gens, prompts, _ = self.session.answer(label, who, q, self.budget, 0.0, seed)
                for gen, prompt in zip(gens, prompts, strict=True):
                    into.add(q.id, q.group, gen, len(prompt))
                    if who is proposer:
                        yield gen, prompt

    def propose_seconds(self, params: dict, state: list[int]) -> float:
        """Median seconds of one propose of the setting at the committed sequence `state` (after a fresh start),
        each after a one-token target forward, as a decode's proposes come after a verification: the target's
        weights streaming through the CPU's caches evict the draft's (proposes timed back to back ran a tiny
        bfloat16 EAGLE-2 tree 0.2x as long as its 60-token tree; after a forward, 0.26x, as in its runs)."""
        proposer = methods.build(self.cfg.method, self.session.resources, params)
        target = self.session.target
        prefilled = target.prefill(state, proposer.feature_layers or None)
        features = prefilled.features if proposer.feature_layers else None
        times = []
        for _ in range(4):
            proposer.start(Turn(state, 0.0, None, features, None))
            target.forward(state[-1:])
            target.crop(len(state) - 1)
            t0 = clock(self.session.device)
            proposer.propose(state, self.budget)
            times.append(clock(self.session.device) - t0)
        return float(np.median(times[1:]))

    def calibrate(self, plain: dict, settings: list[dict], cost: Cost, state: list[int]) -> list[Score]:
        """One greedy run with the nested knobs at their largest values, beside vanilla; every nested setting
        scored from it."""
        top = {k: max((s[k] for s in settings), key=_size) for k in settings[0]}
        run_params = {**self.defaults, **plain, **top}
        name = variant(self.cfg.method, run_params, self.defaults)
        try:
            built = methods.build(self.cfg.method, self.session.resources, run_params)
        except SpecbenchError as err:
            raise Unbuildable(f"{name}: {err}") from err
        proposer = Recorder(built, self.nested, self.session.device)
        turns, vanilla, steps, asked, contexts = Turns(), Turns(), [], [], []  # each step's question and context
        accepts: dict[int, list[int]] = {i: [] for i in range(len(settings))}
        rows: dict[int, list[int]] = {i: [] for i in range(len(settings))}
        for gen, prompt in self._answer(name, proposer, turns, vanilla):
            full = prompt + gen.tokens
            records = proposer.records[len(steps) : len(steps) + len(gen.steps)]
            steps += gen.steps
            asked += [turns.questions[-1]] * len(gen.steps)
            for (length, depth, snapshot), step in zip(records, gen.steps, strict=True):
                contexts.append(length)
                for i, setting in enumerate(settings):
                    if self.nested is None:
                        accepts[i].append(step.accept_length)
                        rows[i].append(step.tree_size)
                        continue
                    tree = Proposal(self.nested.subtree(snapshot, setting)).pruned(depth).tree
                    accepts[i].append(accepted(tree, full[length:]))
                    rows[i].append(len(tree) + 1)
        vanilla.speed = vanilla.speed_against(cost)
        propose = float(np.mean(proposer.propose_times))
        drafts = [s.draft_time for s in steps]
        update = float(np.mean(drafts)) - propose
        scale = verify_scale(
            [s.verify_time for s in steps], [cost(s.tree_size, c) for s, c in zip(steps, contexts, strict=True)]
        )
        slope = draft_slope(contexts, drafts)
        own = self.propose_seconds(run_params, state) if len(settings) > 1 else None
        asked = np.array(asked)
        mine = {q: asked == q for q in set(asked.tolist())}  # question -> its steps
        scores = []
        for i, setting in enumerate(settings):
            params = {**run_params, **setting}
            draft = propose + update
            if own is not None and setting != top:
                draft = propose * self.propose_seconds(params, state) / own + update
            verify = scale * np.array([cost(n, c) for n, c in zip(rows[i], contexts, strict=True)])  # [steps]
            extra = float(np.mean(turns.fixed) - np.mean(vanilla.fixed))
            score = Score(params, float(np.mean(accepts[i])), float(np.mean(rows[i])), draft, 0.0,
                          float(verify.mean()) + draft, extra, groups=turns.groups, verify_scale=scale,
                          cost=cost, context=float(np.mean(contexts)),
                          draft_slope=slope * draft / (propose + update), pace=vanilla.speed)  # fmt: skip
            accepted_i, rows_i = np.array(accepts[i]), np.array(rows[i])
            for q, steps_q in mine.items():
                score.by_question[q] = (float(accepted_i[steps_q].mean()), float(verify[steps_q].mean()) + draft)
                score.rows_by_question[q] = float(rows_i[steps_q].mean())
            score.predicted = geometric_mean(vanilla, score, calibration=True)
            free = {q: (tau, step - draft) for q, (tau, step) in score.by_question.items()}
            free_score = replace(score, extra=0.0, by_question=free, draft=0.0, draft_slope=0.0)
            score.free_draft = geometric_mean(vanilla, free_score, calibration=True)
            scores.append(score)
        return scores

    def search(self) -> tuple[list[Score], bool]:
        """Every setting scored within the calibration share of the budget; True when the grid was cut short."""
        runs, settings = space(self.cfg.method, self.cfg.grid)
        print(f"tune {self.cfg.method}: {len(runs)} calibration run(s) scoring {len(runs) * len(settings)} settings "
              f"on {len(self.questions)} questions of {', '.join(self.cfg.run.tasks)}", file=sys.stderr)  # fmt: skip
        state = self._state()
        target = self.session.target
        longest = target.context_length - max(PROFILE_SIZES) - 1
        cost = Cost({c: forward_profile(target, context=c, sizes=PROFILE_SIZES)
                     for c in sorted({min(c, longest) for c in PROFILE_CONTEXTS})})  # fmt: skip
        scores: list[Score] = []
        for i, plain in enumerate(runs):
            if i and self.elapsed() > CALIBRATION_SHARE * self.cfg.budget_minutes:
                print(f"tune {self.cfg.method}: budget: {i} of {len(runs)} calibration runs done; raise --budget "
                      "to score the rest", file=sys.stderr)  # fmt: skip
                return scores, True
            try:
                with OtherLoad() as load:
                    found = self.calibrate(plain, settings, cost, state)
            except Unbuildable as err:
                if not scores:  # the default's run comes first and must run
                    raise
                print(f"  [{i + 1}/{len(runs)}] skipped {err}", file=sys.stderr)
                continue
            self._warn_if_busy(load, "the calibration run of " + variant(self.cfg.method, {**self.defaults, **plain},
                                                                         self.defaults))  # fmt: skip
            scores += found
            best = max(found, key=lambda s: s.predicted)
            print(f"  [{i + 1}/{len(runs)}] {variant(self.cfg.method, {**self.defaults, **plain}, self.defaults)}: "
                  f"best {variant(self.cfg.method, best.params, self.defaults)} tau {best.tau:.2f}, predicted "
                  f"{best.predicted:.2f}x ({self.elapsed():.1f} min)", file=sys.stderr)  # fmt: skip
        return scores, False

    def _warn_if_busy(self, load: OtherLoad, what: str) -> None:
        """Predictions are ratios of timings: one taken while other processes ran is wrong, and says so."""
        cpus = os.cpu_count() or 1
        if too_busy(load.value, cpus):
            print(f"tune {self.cfg.method}: warning: other processes kept {load.value:.1f} of {cpus} CPUs busy during "
                  f"{what}: the predictions from its timings are unreliable; tune on an idle machine",
                  file=sys.stderr)  # fmt: skip

    def _state(self) -> list[int]:
        """A realistic committed sequence for the draft-cost timings: the first question's prompt and answer."""
        q = self.questions[0]
        ids = self.session.prompt(q, [])
        gen = self.session.answer("vanilla", methods.build("vanilla", self.session.resources), q, self.budget, 0.0, 0)
        return ids + gen[0][0].tokens


def grid_values(pairs: list[str]) -> dict[str, list]:
    """--grid KEY=V1,V2 (repeatable) as {key: [values]}, values read as YAML scalars."""
    out = {}
    for pair in pairs:
        key, sep, values = pair.partition("=")
        if not sep or not key.isidentifier() or not values:
            raise SpecbenchError(f"--grid takes KEY=V1,V2,... (e.g. depth=3,4,5), got '{pair}'")
        out[key] = [yaml.safe_load(v) for v in values.split(",")]
    return out


def measure(cfg: TuneConfig, names: list[str], out: Path, tokenizer) -> tuple[dict[str, metrics.Speedup], Turns, dict]:
    """Paired speedups over vanilla of `names` on the evaluation task (a `specbench run` into `out`), vanilla's
    turns there (with each question's mean context, from its prompts rebuilt), and each name's tau per question."""
    run_cfg = replace(cfg.run, methods=["vanilla", *names], tasks=[cfg.eval_task], out=str(out), noise_floor=False,
                      tuned=None)  # fmt: skip
    run_dir = runner.run(run_cfg)
    sources = load_sources([run_dir])
    turns = frames.from_sources(sources)
    turns = turns[turns.temperature == 0]
    base = turns[turns.method == "vanilla"]
    speedups = {name: metrics.paired_speedup(turns[turns.method == name], base) for name in names}
    sums = turns.groupby(["method", "question_id"])[["new_tokens", "steps"]].sum()
    taus = {name: (sums.loc[name].new_tokens / sums.loc[name].steps).to_dict() for name in names}
    vanilla = Turns()  # an answer's draft and verify times sit on its first turn: sums per question are right
    for row in base.itertuples():
        vanilla.questions.append(row.question_id)
        vanilla.groups[row.question_id] = row.group
        vanilla.tokens.append(int(row.new_tokens))
        vanilla.wall.append(float(row.wall_time))
        vanilla.fixed.append(float(row.wall_time - row.draft_time - row.verify_time))
    asked = {q.id: q for q in tasks.load(cfg.eval_task, cfg.run.data_dir, cfg.run.fields).questions}
    for answer in sources[0].answers:
        if answer.method == "vanilla" and answer.temperature == 0 and answer.question_id in asked:
            prompts = turn_prompts(tokenizer, asked[answer.question_id].turns, answer.turns)
            before = [len(p) + (n - 1) / 2 for p, n in zip(prompts, answer.new_tokens, strict=True)]
            vanilla.contexts[answer.question_id] = float(np.average(before, weights=answer.new_tokens))
            vanilla.step_contexts += [
                len(p) + i for p, n in zip(prompts, answer.new_tokens, strict=True) for i in range(n)
            ]
            vanilla.verify_seconds += answer.verify_time or 0.0
    return speedups, vanilla, taus


def tune(cfg: TuneConfig) -> dict:
    """Search, verify, save; returns the saved entry."""
    if cfg.method == "vanilla":
        raise SpecbenchError("vanilla has nothing to tune: name a speculative method, e.g. --method eagle2")
    run_cfg = replace(cfg.run, methods=["vanilla", cfg.method])
    space(cfg.method, cfg.grid)  # a bad grid fails before anything loads
    if cfg.eval_task in run_cfg.tasks:
        raise SpecbenchError(f"calibrate on another task than the evaluation task '{cfg.eval_task}' (--tasks), "
                             "or the choice is checked on the questions it was fitted to")  # fmt: skip
    session = Session.open(run_cfg)
    device, dtype = session.device, str(session.dtype).removeprefix("torch.")
    model = session.spec.name  # the name `run --tuned` looks the entry up by (plan.spec.name)
    loaded = [tasks.load(t, run_cfg.data_dir, run_cfg.fields) for t in run_cfg.tasks]
    questions = [q for t in loaded for q in tasks.limit_per_category(t.questions, run_cfg.limit)]
    budget = run_cfg.max_new_tokens or max(t.max_new_tokens or 256 for t in loaded)  # as `specbench run`
    tuner = Tuner(cfg, session, questions, budget)
    scores, cut = tuner.search()
    tokenizer = session.tokenizer
    del session, tuner  # the verification run loads its own models
    defaults = dict(methods.preset(cfg.method).params)
    default = next(s for s in scores if s.params == defaults)
    best = max(scores, key=lambda s: s.predicted)
    winner = variant(cfg.method, best.params, defaults)
    out = cfg.out or Path("results") / f"tune-{Path(run_cfg.model).name}-{cfg.method}"
    out.mkdir(parents=True, exist_ok=True)
    chosen, note = best, "predicted fastest (not verified)"
    if cfg.verify:
        key = zlib.crc32(json.dumps([winner, cfg.eval_task, run_cfg.limit, run_cfg.max_new_tokens]).encode())
        names = list(dict.fromkeys([cfg.method, winner]))
        measured, vanilla, taus = measure(cfg, names, out / f"verify-{key:08x}", tokenizer)
        vanilla.speed = vanilla.speed_against(best.cost)
        for s in scores:
            s.predicted_eval = geometric_mean(vanilla, s)
        for name, s in zip(names, (default, best), strict=False):
            s.measured = measured[name]
            at_tau = replace(s, by_question={q: (tau, s.step) for q, tau in taus[name].items()}, rows_by_question={})
            s.predicted_at_tau = geometric_mean(vanilla, at_tau, calibration=True)
        chosen, note = best, "measured at least as fast as the default"
        if best.measured.value < default.measured.value:
            chosen, note = default, "the default measured faster than the predicted winner"
    entry = {
        "variant": variant(cfg.method, chosen.params, defaults),
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
        },  # fmt: skip
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
    return {"variant": variant(method, s.params, defaults), "tau": round(s.tau, 4), "rows": round(s.rows, 2),
            "draft_ms": round(s.draft * 1e3, 3), "predicted": round(s.predicted, 4),
            "predicted_if_drafting_were_free": round(s.free_draft, 4),
            "predicted_eval": _round(s.predicted_eval), "measured": _speedup(s.measured)}  # fmt: skip


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
        rows.append([variant(method, s.params, defaults), tag, f"{s.tau:.2f}", f"{s.rows:.1f}", f"{s.draft * 1e3:.1f}",
                     f"{s.predicted:.2f}x", f"{s.free_draft:.2f}x", on_eval, at_tau, measured])  # fmt: skip
    header = ["setting", "", "tau", "rows/step", "draft ms/step", "predicted (calibration)", "if drafting were free",
              "predicted (evaluation)", "predicted at its measured tau", "measured (evaluation)"]  # fmt: skip
    return tabulate(rows, header, tablefmt="github")
