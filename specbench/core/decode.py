"""The one decode loop every method shares: propose -> verify -> accept -> commit -> update."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ..errors import SpecbenchError
from . import acceptance
from .cached_lm import CachedLM
from .proposer import Feedback, Proposer, Turn
from .step import verify


@dataclass(frozen=True)
class Step:
    accept_length: int  # tokens this step appended (the target's own token included)
    tested: int  # draft depth examined along the accepted path (see acceptance.Accepted)
    tree_size: int  # tokens sent to the target in the verification forward
    draft_time: float
    verify_time: float  # the target's forward, acceptance and cache commit


@dataclass
class Generation:
    tokens: list[int]  # new tokens, up to and including the first stop token
    steps: list[Step] = field(default_factory=list)
    wall_time: float = 0.0
    prefill_draft_time: float = 0.0  # the proposer's own set-up for this turn (e.g. the draft's prefill)
    target_top1: list[int] | None = None  # T=0, per new token: the target's argmax in the forward that chose it
    target_margin: list[float] | None = None  # ... and its top-1/top-2 logit margin there

    @property
    def accept_lengths(self) -> list[int]:
        return [s.accept_length for s in self.steps]


def clock(device: torch.device) -> float:
    """Seconds, after the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Marks:
    """Moments within a turn, marked without waiting on the device: CUDA events on the device's own timeline on a GPU
    (read when the turn ends), the host's clock elsewhere (where an op's work is done when it returns). A step's
    draft and verification times come from these, so timing them adds no wait to the step."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.marks: list = []

    def __call__(self) -> int:
        """Mark now; the mark's index."""
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        """Each mark's time after the first, once the device has reached the last."""
        if not self.events:
            return [t - self.marks[0] for t in self.marks]
        self.marks[-1].synchronize()
        return [self.marks[0].elapsed_time(event) / 1000 for event in self.marks]


def decode(
    target: CachedLM,
    proposer: Proposer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_ids: set[int],
    generator: torch.Generator | None = None,
    rule: acceptance.Rule = acceptance.EXACT,
    request: tuple[Hashable, int] | None = None,
    reuse_prefill: bool = False,
) -> Generation:
    """Generate up to max_new_tokens after `prompt`, timing prefill to last token (device synchronised).
    `rule` is the method's acceptance rule (its preset's, through `methods.rule`); `request` names what is
    answered (`Turn.request`); `reuse_prefill`: the target's cache of the same prompt is kept from the last call
    (`CachedLM.prefill`), for the sampling audit only: its prefill time would be wrong."""
    if max_new_tokens <= 0:
        raise SpecbenchError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if len(prompt) >= target.context_length:
        raise SpecbenchError(
            f"prompt of {len(prompt)} tokens does not fit the model's context of {target.context_length} tokens"
        )
    budget = min(max_new_tokens, target.context_length - len(prompt))
    device = target.device
    start = clock(device)
    layers = proposer.feature_layers
    prefill = target.prefill(prompt, layers, reuse=reuse_prefill)
    t0 = clock(device)
    features = prefill.features if prefill is not None else None
    proposer.start(Turn(prompt, temperature, generator, features, request))
    tokens = list(prompt)
    gen = Generation([], prefill_draft_time=clock(device) - t0)
    picked: list[tuple[list[int], torch.Tensor]] = []  # T=0: the target's picks per step (margins on the device)
    mark = Marks(device)
    steps: list[tuple[int, int, int, tuple[int, int, int, int]]] = []  # (accepted, tested, tree size, marks)
    while len(gen.tokens) < budget:
        remaining = budget - len(gen.tokens)
        depth = remaining - 1  # drafted tokens the budget has room for after the target's own token
        t0 = mark()
        proposal = proposer.propose(tokens, depth).pruned(depth)
        t1 = mark()
        step = verify(target, tokens[-1], proposal, rule, temperature, generator, layers)
        new = step.new
        stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
        new = new[:remaining]
        if step.picks is not None:
            picked.append((step.picks[0][: len(new)], step.picks[1][: len(new)]))
        tokens.extend(new)
        gen.tokens.extend(new)
        t2 = mark()
        n = len(proposal.tree) + 1
        out = step.output
        feedback = Feedback(
            step.accepted,
            out.features[step.kept_rows] if out.features is not None else None,
            out.logits[n:] if proposal.side else None,
            step.side_picks if proposal.side else None,
        )
        proposer.update(tokens, proposal, feedback)
        steps.append((len(new), step.accepted.tested, len(out.logits), (t0, t1, t2, mark())))
        if stop_at is not None:
            break
    gen.wall_time = clock(device) - start
    at = mark.seconds() if steps else []
    for new_tokens, tested, size, (t0, t1, t2, t3) in steps:
        gen.steps.append(Step(new_tokens, tested, size, at[t1] - at[t0] + at[t3] - at[t2], at[t2] - at[t1]))
    if picked:  # read after the clock stops
        gen.target_top1 = [top1 for p in picked for top1 in p[0]]
        gen.target_margin = torch.cat([p[1] for p in picked]).tolist()
    return gen
