"""A method's drafting at B = 64 on staggered turns (EAGLE-3's by default): the one-layer, 64-wide model of
scripts/loop_overhead.py, turns of 8 to 64 tokens (random budgets, the batch refilled as turns end, so its slots
stand at different points of their budgets), T = 0. Prints, over the steps with every slot busy, the median step in
ms and, for EAGLE, the drafting groups a step (`StaticDrafting._together` calls: each one forward per tree level,
padded to the whole batch).

    python scripts/drafting_groups.py [--method eagle3|sps] [--batch 64] [--rounds 2]

Never time while anything else runs (docs/cpu-notes.md)."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loop_overhead import PROMPT, _resources  # noqa: E402
from random_checkpoints import write_random  # noqa: E402

from specbench import methods  # noqa: E402
from specbench.core.decode import Job, decode_batch  # noqa: E402
from specbench.core.static_lm import BUCKETS, BatchedLM  # noqa: E402


def one_round(target: BatchedLM, drafting, seed: int) -> list[tuple[float, int]]:
    """Three batches' worth of turns of random budgets answered by `drafting`: (seconds, drafting groups) of each
    step with every slot busy."""
    static = getattr(drafting, "static", None)  # EAGLE's static drafting (none: a chain's drafter)
    verify = target.verify
    budgets, ids = random.Random(seed), torch.Generator().manual_seed(seed)
    jobs = [
        Job(torch.randint(3, 512, (PROMPT,), generator=ids).tolist(), budgets.randint(8, 64), 0.0, None, (i, 0))
        for i in range(3 * target.batch)
    ]
    calls, starts = [0], []  # per verify: (moment, drafting groups so far, slots in it)

    def counted(members, depths):
        calls[0] += 1
        return together(members, depths)

    if static is not None:
        together = static._together
        static._together = counted

    def timed(rows, **options):
        starts.append((time.perf_counter(), calls[0], len(rows)))
        return verify(rows, **options)

    target.verify = timed
    try:
        decode_batch(target, drafting, lambda: jobs.pop() if jobs else None, lambda job, gen: None, stop_ids=set())
    finally:
        del target.verify
        if static is not None:
            del static._together
    pairs = zip(starts, starts[1:], strict=False)
    return [(b[0] - a[0], b[1] - a[1]) for a, b in pairs if a[2] == b[2] == target.batch]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="eagle3", help="eagle3 or sps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (one more, discarded, warms up)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        res, owned = _resources(write_random("loop", Path(folder), torch.device("cpu"), torch.float32))
        target = BatchedLM(owned, args.batch, capture=False, context=PROMPT + 64 + BUCKETS[-1])
        drafting = methods.build_batch(args.method, res, args.batch)
        eagle = hasattr(drafting, "static")
        for round_ in range(args.rounds + 1):
            full = one_round(target, drafting, round_)
            if round_:
                groups = statistics.mean(g for _, g in full)
                step = statistics.median(s for s, _ in full) * 1e3
                grouped = f"drafting groups a step {groups:.2f} (mean); " if eagle else ""
                print(
                    f"{args.method} round {round_}: {len(full)} steps with all {args.batch} slots busy; {grouped}"
                    f"step {step:.1f} ms (median)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
