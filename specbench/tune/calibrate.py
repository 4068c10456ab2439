"""Calibration: one greedy run of the method per plain setting, each question answered by vanilla just before
(as `specbench run` interleaves them), keeping what the method's nested snapshot needs at each step, so one run
scores every smaller nested setting exactly at the roots it visited; then the verification run of the chosen
setting beside the default on the evaluation task."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .. import methods, tasks
from ..config import question_seed
from ..core.decode import Step, clock
from ..core.proposer import Drafter, Feedback, Nested, Proposal, Turn
from ..core.static_lm import Row
from ..core.tree import Tree
from ..errors import SpecbenchError
from ..interference import OtherLoad, too_busy
from ..methods import variant_name
from ..models.chat import turn_prompts
from ..report import frames, metrics
from ..report.sources import load_sources
from ..run import runner
from ..run.session import Session
from ..run.worker import forward_profile
from .cost import Cost, Score, Turns, draft_slope, geometric_mean, verify_scale
from .space import TuneConfig, space

PROFILE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)

PROFILE_CONTEXTS = (64, 512)  # cached tokens the forward is profiled after (`Cost`)

CALIBRATION_SHARE = 0.6  # of the budget: no new calibration run starts past it (verification needs the rest)


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


class Recorder(Drafter):
    """Wraps the method's drafting for a batch of one: times each propose and keeps (committed length, depth
    budget, snapshot)."""

    def __init__(self, inner: Drafter, nested: Nested | None, device: torch.device) -> None:
        self.inner, self.nested, self.device = inner, nested, device
        self.feature_layers = inner.feature_layers
        self.learns = inner.learns
        self.records: list[tuple[int, int, object]] = []
        self.propose_times: list[float] = []

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        self.inner.start(slots, turns)

    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        t0 = clock(self.device)
        (proposal,) = self.inner.propose(slots, tokens, max_depths)
        self.propose_times.append(clock(self.device) - t0)
        snapshot = self.nested.snapshot(self.inner, slots[0], proposal) if self.nested else None
        self.records.append((len(tokens[0]), max_depths[0], snapshot))
        return [proposal]

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        self.inner.update(slots, tokens, proposals, feedback)

    def clear(self) -> None:
        self.records.clear()
        self.propose_times.clear()


class Unbuildable(SpecbenchError):
    """A grid setting this model cannot run (e.g. `draft_vocab` for a head without token counts): tune goes on
    without it, saying why."""


class Tuner:
    def __init__(self, cfg: TuneConfig, session: Session, questions: list, budget: int) -> None:
        self.cfg, self.session, self.questions, self.budget = cfg, session, questions, budget
        self.spec = methods.preset(cfg.method)
        self.defaults = dict(self.spec.params)
        self.nested = methods.registered(cfg.method).nested
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return (time.perf_counter() - self.started) / 60

    def _answer(self, name: str, proposer: Drafter, turns: Turns, vanilla: Turns) -> Iterator[tuple]:
        """Every calibration question answered greedily by vanilla (into `vanilla`) and then by the method, as
        `specbench run` interleaves them (the first question once more before, as a warm-up): this CPU's pace
        drifts by up to a quarter over tens of seconds, so only a vanilla answered beside the method's answers
        tells what the method's steps cost against vanilla's."""
        pairs = ((methods.build_batch("vanilla", self.session.resources), "vanilla", vanilla), (proposer, name, turns))
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
        proposer = methods.build_batch(self.cfg.method, self.session.resources, 1, params)
        target = self.session.target
        (prefilled,) = target.prefill([0], [state], proposer.feature_layers or None)
        features = None
        if proposer.feature_layers:
            assert prefilled is not None  # `state` is a prompt and its answer
            features = prefilled.features
        times = []
        for _ in range(4):
            proposer.start([0], [Turn(state, 0.0, None, features, None)])
            target.verify([Row(0, state[-1:])])
            target.rewind(0, len(state) - 1)
            t0 = clock(self.session.device)
            proposer.propose([0], [state], [self.budget])
            times.append(clock(self.session.device) - t0)
        return float(np.median(times[1:]))

    def calibrate(self, plain: dict, settings: list[dict], cost: Cost, state: list[int]) -> list[Score]:
        """One greedy run with the nested knobs at their largest values, beside vanilla; every nested setting
        scored from it."""
        top = {k: max((s[k] for s in settings), key=_size) for k in settings[0]}
        run_params = {**self.defaults, **plain, **top}
        name = variant_name(self.cfg.method, run_params, self.defaults)
        try:
            built = methods.build_batch(self.cfg.method, self.session.resources, 1, run_params)
        except SpecbenchError as err:
            raise Unbuildable(f"{name}: {err}") from err
        proposer = Recorder(built, self.nested, self.session.device)
        steps: list[Step] = []
        turns, vanilla, asked, contexts = Turns(), Turns(), [], []  # each step's question and context
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
        by_step = np.array(asked)
        mine = {q: by_step == q for q in set(by_step.tolist())}  # question -> its steps
        scores = []
        for i, setting in enumerate(settings):
            params = {**run_params, **setting}
            draft = propose + update
            if own is not None and setting != top:
                draft = propose * self.propose_seconds(params, state) / own + update
            verify = scale * np.array([cost(n, c) for n, c in zip(rows[i], contexts, strict=True)])  # [steps]
            extra = float(np.mean(turns.fixed) - np.mean(vanilla.fixed))
            score = Score(
                params,
                float(np.mean(accepts[i])),
                float(np.mean(rows[i])),
                draft,
                0.0,
                float(verify.mean()) + draft,
                extra,
                groups=turns.groups,
                verify_scale=scale,
                cost=cost,
                context=float(np.mean(contexts)),
                draft_slope=slope * draft / (propose + update),
                pace=vanilla.speed,
            )
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
        print(
            f"tune {self.cfg.method}: {len(runs)} calibration run(s) scoring {len(runs) * len(settings)} settings "
            f"on {len(self.questions)} questions of {', '.join(self.cfg.run.tasks)}",
            file=sys.stderr,
        )
        state = self._state()
        target = self.session.target
        longest = target.context_length - max(PROFILE_SIZES) - 1
        cost = Cost(
            {
                c: forward_profile(target, context=c, sizes=PROFILE_SIZES)
                for c in sorted({min(c, longest) for c in PROFILE_CONTEXTS})
            }
        )
        scores: list[Score] = []
        for i, plain in enumerate(runs):
            if i and self.elapsed() > CALIBRATION_SHARE * self.cfg.budget_minutes:
                print(
                    f"tune {self.cfg.method}: budget: {i} of {len(runs)} calibration runs done; raise --budget "
                    "to score the rest",
                    file=sys.stderr,
                )
                return scores, True
            try:
                with OtherLoad() as load:
                    found = self.calibrate(plain, settings, cost, state)
            except Unbuildable as err:
                if not scores:  # the default's run comes first and must run
                    raise
                print(f"  [{i + 1}/{len(runs)}] skipped {err}", file=sys.stderr)
                continue
            name = variant_name(self.cfg.method, {**self.defaults, **plain}, self.defaults)
            self._warn_if_busy(load, "the calibration run of " + name)
            scores += found
            best = max(found, key=lambda s: s.predicted)
            print(
                f"  [{i + 1}/{len(runs)}] {name}: "
                f"best {variant_name(self.cfg.method, best.params, self.defaults)} tau {best.tau:.2f}, predicted "
                f"{best.predicted:.2f}x ({self.elapsed():.1f} min)",
                file=sys.stderr,
            )
        return scores, False

    def _warn_if_busy(self, load: OtherLoad, what: str) -> None:
        """Predictions are ratios of timings: one taken while other processes ran is wrong, and says so."""
        cpus = os.cpu_count() or 1
        if too_busy(load.value, cpus):
            print(
                f"tune {self.cfg.method}: warning: other processes kept {load.value:.1f} of {cpus} CPUs busy during "
                f"{what}: the predictions from its timings are unreliable; tune on an idle machine",
                file=sys.stderr,
            )

    def _state(self) -> list[int]:
        """A realistic committed sequence for the draft-cost timings: the first question's prompt and answer."""
        q = self.questions[0]
        ids = self.session.prompt(q, [])
        vanilla = methods.build_batch("vanilla", self.session.resources)
        gen = self.session.answer("vanilla", vanilla, q, self.budget, 0.0, 0)
        return ids + gen[0][0].tokens


def measure(cfg: TuneConfig, names: list[str], out: Path, tokenizer) -> tuple[dict[str, metrics.Speedup], Turns, dict]:
    """Paired speedups over vanilla of `names` on the evaluation task (a `specbench run` into `out`), vanilla's
    turns there (with each question's mean context, from its prompts rebuilt), and each name's tau per question."""
    run_cfg = replace(
        cfg.run, methods=["vanilla", *names], tasks=[cfg.eval_task], out=str(out), noise_floor=False, tuned=None
    )
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
            question = asked[answer.question_id]
            prompts = turn_prompts(tokenizer, question.turns, answer.turns, question.thinking)
            before = [len(p) + (n - 1) / 2 for p, n in zip(prompts, answer.new_tokens, strict=True)]
            vanilla.contexts[answer.question_id] = float(np.average(before, weights=answer.new_tokens))
            vanilla.step_contexts += [
                len(p) + i for p, n in zip(prompts, answer.new_tokens, strict=True) for i in range(n)
            ]
            vanilla.verify_seconds += answer.verify_time or 0.0
    return speedups, vanilla, taus
