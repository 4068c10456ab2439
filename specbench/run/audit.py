"""`specbench verify`: run a method beside vanilla and audit losslessness, greedy and under sampling."""

from __future__ import annotations

from dataclasses import replace

from .. import methods, tasks
from ..config import RunConfig, question_seed
from ..core.losslessness import greedy_check, sampling_test
from ..core.proposer import Drafter
from ..core.static_lm import BUCKETS
from ..errors import SpecbenchError
from ..progress import Progress
from .session import Session

GREEDY_TOKENS = 128  # default per-turn budget of the greedy audit when the task's own is longer


def _greedy(
    session: Session, method: str, drafting: Drafter, vanilla, questions, budget: int, seed: int, batch: int
) -> tuple:
    """Each question answered by vanilla alone and by the method (`batch` questions at a time when above 1), and
    compared token by token."""
    exact = ties = bugs = 0
    seeds = [question_seed(seed, q.id, 0.0) for q in questions]
    batched = None
    if batch > 1:
        target = session.target_for(batch, questions, budget)
        batched = session.answer_batch(method, target, drafting, questions, budget, 0.0, seeds)[0]
    bar = Progress(len(questions), "greedy audit", "questions")
    for i, (q, s) in enumerate(zip(questions, seeds, strict=True)):
        bar.update()
        ref, ref_prompts, _ = session.answer("vanilla", vanilla, q, budget, 0.0, s)
        ours = batched[i][0] if batched is not None else session.answer(method, drafting, q, budget, 0.0, s)[0]
        check = greedy_check(
            session.model,
            [g.tokens for g in ours],
            [g.tokens for g in ref],
            ref_prompts,
            [g.target_top1 or [] for g in ours],  # (always recorded at T = 0)
            [g.target_margin or [] for g in ours],
            [g.target_margin or [] for g in ref],
        )
        if check["match"]:
            exact += 1
            continue
        ties += check["near_tie"]
        bugs += not check["near_tie"]
        kind = "numerical divergence" if check["near_tie"] else "MISMATCH"
        ours_margin = "not recorded" if check["method_margin"] is None else f"{check['method_margin']:.2e}"
        print(
            f"  question {q.id}: {kind} at turn {check['turn'] + 1}, token {check['position']} (top-1/top-2 margin: "
            f"vanilla {check['margin']:.2e}, {method} {ours_margin}; rounding spread {check['spread']:.2e})"
        )
    bar.close()
    return exact, ties, bugs


def audit(
    cfg: RunConfig,
    method: str,
    mode: str = "both",
    temperature: float = 1.0,
    samples: int = 2000,
    horizon: int = 3,
    prompts: int = 2,
    alpha: float = 1e-3,
) -> int:
    """`specbench verify`: print the audit of `method` against vanilla on the first question of each category of
    cfg's tasks (cfg.limit of them); return 0 when it is lossless (or labelled lossy), 1 when it fails. With
    cfg.batch [B] above 1 the method answers B questions (and draws B samples) at a time."""
    if samples < 10 or horizon < 1 or prompts < 1:
        raise SpecbenchError("--samples must be >= 10, --horizon and --prompts >= 1")
    if mode != "greedy" and temperature <= 0:
        raise SpecbenchError("the sampling test needs --temperature > 0")
    lossless = methods.preset(method).lossless
    cfg = replace(cfg, methods=["vanilla", method])
    session = Session.open(cfg)
    batch = max(cfg.batch)
    drafting = methods.build_batch(method, session.resources, batch)
    vanilla = methods.build("vanilla", session.resources)
    questions = [
        q
        for t in cfg.tasks
        for q in tasks.limit_per_category(tasks.load(t, cfg.data_dir, cfg.fields).questions, cfg.limit or 1)
    ]
    failed = False
    at = f", {batch} sequences at a time" if batch > 1 else ""
    print(f"verify {method} on {session.spec.name} ({'lossless rule' if lossless else 'LOSSY rule'}{at})")
    if mode in ("greedy", "both"):
        budget = cfg.max_new_tokens or GREEDY_TOKENS
        exact, ties, bugs = _greedy(session, method, drafting, vanilla, questions, budget, cfg.seed, batch)
        print(
            f"greedy: {exact}/{len(questions)} questions token-identical to vanilla, {ties} numerical divergences "
            f"(margins within the measured rounding spread), {bugs} real mismatches -> {'FAIL' if bugs else 'pass'}"
        )
        failed |= bugs > 0
    if mode in ("sampling", "both"):
        print(
            f"sampling at T={temperature:g}: {samples} samples of {horizon} tokens per prompt, "
            f"chi-square against vanilla's exact law, alpha={alpha:g}"
        )
        for q in questions[:prompts]:
            ids = session.prompt(q, [])
            slots = (session.batched(batch, len(ids) + horizon + BUCKETS[-1]), drafting) if batch > 1 else None
            result = sampling_test(
                session.target,
                drafting,
                ids,
                horizon=horizon,
                samples=samples,
                temperature=temperature,
                stop_ids=session.stop_ids,
                alpha=alpha,
                seed=cfg.seed,
                rule=methods.rule(method),
                batch=slots,
            )
            verdict = "pass" if result.passed else ("FAIL" if lossless else "differs (lossy by design)")
            print(
                f"  question {q.id}: chi2={result.statistic:.1f} over {result.bins} bins, p={result.p_value:.3g}, "
                f"TV={result.tv_distance:.3f} -> {verdict}"
            )
            failed |= lossless and not result.passed
    print("verdict:", "FAIL" if failed else ("pass" if lossless else "pass (lossy rule, labelled lossy)"))
    return 1 if failed else 0
