"""The target's forward timed by rows: T(k), the median seconds of one verification forward over k new rows in every
slot (the roofline's and tune's cost model, a batch's profiled forward, DSpark's adaptive schedule)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..core.one_slot import Target
from ..core.static_lm import Row
from ..machine import warm_gpu


def _median_times(sizes, repeats: int, device: torch.device, forward, reset) -> dict[int, float]:
    """Median seconds of `forward(k)` for each of `sizes`, timed in interleaved rounds, the first discarded, so a
    slow spell of a drifting CPU falls on every size alike rather than on some (docs/cpu-notes.md); `reset()` after
    each. The first round captures and compiles, the GPU idling meanwhile: it is warmed after it."""
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for i in range(repeats + 1):
        if i == 1:
            warm_gpu(device)
        for k in sizes:
            start = time.perf_counter()
            forward(k)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[k].append(time.perf_counter() - start)
            reset()
    return {k: float(np.median(t[1:])) for k, t in times.items()}


@torch.inference_mode()
def forward_profile(
    target: Target,
    context: int = 256,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    repeats: int = 9,
) -> dict[int, float]:
    """Median seconds of one verification forward over k new rows in every slot of `target` after `context` cached
    tokens in each, its verdicts computed with it as a greedy step's are: the T(k) of the roofline and of tune's cost
    model, and at B slots the T(rows) a batch's steps are read against (the report's batch sweep). Timed in
    interleaved rounds (`_median_times`); the slots are emptied after."""
    context = max(1, min(context, target.context_length - max(sizes) - 1))
    generator = torch.Generator().manual_seed(0)
    filler = torch.randint(0, target.model.config.vocab_size, (context + max(sizes),), generator=generator).tolist()
    target.prefill(list(range(target.batch)), [filler[: context + 1]] * target.batch)

    def forward(k: int) -> None:
        target.verify([Row(slot, filler[context : context + k]) for slot in range(target.batch)], judged=True)

    def reset() -> None:
        for slot in range(target.batch):
            target.rewind(slot, context)

    times = _median_times(sizes, repeats, target.device, forward, reset)
    for slot in range(target.batch):
        target.rewind(slot, 0)
    return times
