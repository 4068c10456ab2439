"""Our decode loop against transformers' own generation, on the same target, draft and prompts.

vanilla vs generate(), sps vs generate(assistant_model=...), pld vs generate(prompt_lookup_num_tokens=...).
Greedy; checks that both produce the same tokens and reports the speed ratio ours/theirs (tokens/s), the
geometric mean over prompts of per-prompt medians over repeats, runs interleaved so drift hits both sides.

    python scripts/bench_vs_hf.py --model tiny --tasks quick --max-new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specbench import methods, tasks
from specbench.config import RunConfig
from specbench.core.decode import decode
from specbench.machine import machine
from specbench.models.chat import prompt_ids
from specbench.run.session import Session


def hf_generate(model, ids: list[int], n: int, stop: set[int], **kw) -> tuple[list[int], float]:
    x = torch.tensor([ids], device=model.device)
    start = time.perf_counter()
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=sorted(stop),
        pad_token_id=sorted(stop)[0],
        **kw,
    )
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--draft")
    p.add_argument("--tasks", default="quick")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--data-dir")
    args = p.parse_args()

    session = Session.open(
        RunConfig(
            model=args.model,
            methods=["vanilla", "sps", "pld"],
            draft=args.draft,
            device=args.device,
            dtype=args.dtype,
            data_dir=args.data_dir,
        )
    )
    questions = [
        q
        for t in args.tasks.split(",")
        for q in tasks.limit_per_category(tasks.load(t, args.data_dir).questions, args.limit)
    ]
    prompts = [prompt_ids(session.tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    sps, pld = methods.preset("sps").params, methods.preset("pld").params
    draft = session.resources.draft_model()
    pairs = {
        "vanilla": (methods.build("vanilla", session.resources), {}),
        "sps": (
            methods.build("sps", session.resources),
            {
                "assistant_model": draft,
                "num_assistant_tokens": sps["num_draft_tokens"],
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            },
        ),
        "pld": (
            methods.build("pld", session.resources),
            {"prompt_lookup_num_tokens": pld["num_pred_tokens"], "max_matching_ngram_size": pld["max_ngram_size"]},
        ),
    }
    n = args.max_new_tokens
    print(
        f"machine: {machine(session.device)['device_name']}, torch threads {torch.get_num_threads()}, "
        f"model {session.spec.name}, {len(prompts)} prompts, {n} new tokens, {args.repeats} repeats"
    )
    print("| method | same greedy tokens | ours tok/s | transformers tok/s | speed ratio ours/theirs |")
    print("|---|---|---|---|---|")
    for name, (proposer, hf_kwargs) in pairs.items():
        decode(session.target, proposer, prompts[0], max_new_tokens=8, temperature=0, stop_ids=session.stop_ids)
        hf_generate(session.model, prompts[0], 8, session.stop_ids, **hf_kwargs)  # warm-up both
        same, ratios, ours_tps, theirs_tps = 0, [], [], []
        for ids in prompts:
            ours_t, theirs_t = [], []
            for _ in range(args.repeats):
                gen = decode(session.target, proposer, ids, max_new_tokens=n, temperature=0, stop_ids=session.stop_ids)
                ours_t.append(gen.wall_time)
                theirs, t = hf_generate(session.model, ids, n, session.stop_ids, **hf_kwargs)
                theirs_t.append(t)
            same += gen.tokens == theirs
            ours_med, theirs_med = statistics.median(ours_t), statistics.median(theirs_t)
            ours_tps.append(len(gen.tokens) / ours_med)
            theirs_tps.append(len(theirs) / theirs_med)
            ratios.append(ours_tps[-1] / theirs_tps[-1])
        print(
            f"| {name} | {same}/{len(prompts)} | {np.mean(ours_tps):.1f} | {np.mean(theirs_tps):.1f} | "
            f"{float(np.exp(np.mean(np.log(ratios)))):.2f} |"
        )


if __name__ == "__main__":
    main()
