"""The one decode loop every method shares: propose -> verify -> accept -> commit -> update, for a batch of
sequences (slots) at once. Each slot has its own proposer and its own turn to answer; one target forward verifies
every slot's proposal, each slot accepts and commits on its own, and a slot whose turn ends takes the next turn
waiting (the batch is refilled, so it stays full while work remains: the batch size a serving engine holds).
`decode` is a batch of one."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..errors import SpecbenchError
from . import acceptance
from .cached_lm import CachedLM, Forward
from .proposer import Feedback, Proposer, Turn, batch_drafting
from .static_lm import BatchedLM, Row
from .step import inputs, judge, outcome
from .transfer import upload


@dataclass(frozen=True)
class Step:
    accept_length: int  # tokens this step appended (the target's own token included)
    tested: int  # draft depth examined along the accepted path (see acceptance.Accepted)
    tree_size: int  # tokens sent to the target in the verification forward
    draft_time: float  # this sequence's drafting (its proposer's propose and update; in a batch, its share)
    verify_time: float  # the target's forward, acceptance and cache commit (every slot's, in a batch)
    slots: int = 1  # the slots that shared the step (its drafting phase and forward)
    width: int = 0  # the rows of the widest slot in its forward (each slot's are padded to a bucket of them)


@dataclass
class Generation:
    tokens: list[int]  # new tokens, up to and including the first stop token
    steps: list[Step] = field(default_factory=list)
    wall_time: float = 0.0
    prefill_draft_time: float = 0.0  # the proposer's own set-up for this turn (e.g. the draft's prefill)
    target_top1: list[int] | None = None  # T=0, per new token: the target's argmax in the forward that chose it
    target_margin: list[float] | None = None  # ... and its top-1/top-2 logit margin there
    started: float = 0.0  # in a batch: seconds from the batch's start to this turn's prefill, and to its end
    ended: float = 0.0

    @property
    def accept_lengths(self) -> list[int]:
        return [s.accept_length for s in self.steps]


@dataclass(frozen=True)
class Job:
    """One turn to answer: its prompt, token budget, temperature, random stream and name (`Turn.request`)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    generator: torch.Generator | None = None
    request: tuple[Hashable, int] | None = None


def clock(device: torch.device) -> float:
    """Seconds, after the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Marks:
    """Moments within a run, marked without waiting on the device: CUDA events on the device's own timeline on a GPU
    (read when the run ends), the host's clock elsewhere (where an op's work is done when it returns). Step, turn
    and drafting times come from these, so timing them adds no wait to the step."""

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


class OneSlot:
    """A CachedLM (the eager cache, or a static one) as the loop's batch of one. `reuse`: a prefill of the prompt
    just prefilled crops back to it (`CachedLM.prefill`; the sampling audit's)."""

    batch = 1
    last = None  # (a batch's whole output: one sequence's is its own)

    def __init__(self, model: CachedLM, reuse: bool = False) -> None:
        self.model, self.reuse = model, reuse
        self.device, self.context_length = model.device, model.context_length

    @property
    def lengths(self) -> list[int]:
        return [self.model.cached]

    def prefill_slot(self, slot: int, prompt: list[int], layers: tuple[int, ...] | None = None) -> Forward | None:
        return self.model.prefill(prompt, layers, reuse=self.reuse)

    def run(
        self, rows: list[Row], *, layers: tuple[int, ...] | None = None, greedy: bool = False, copies: bool = True
    ) -> list[Forward]:
        (row,) = rows
        return [self.model.run(row.tokens, row.tree, layers=layers, side=row.side, greedy=greedy)]

    def commit(self, moves: list[tuple[int, int, list[int]]]) -> None:
        ((_, start, keep),) = moves
        self.model.commit(start, keep)


@dataclass
class _Turn:
    """A slot's turn in progress: its committed tokens, what it generated, and the marks of its steps."""

    job: Job
    tokens: list[int]
    gen: Generation
    budget: int
    marks: tuple[int, int, int]  # before the prefill, after it, after the proposer's start
    steps: list[tuple[int, int, int, tuple[int, int, int, int, int, int]]] = field(default_factory=list)  # with
    # the step's marks: before drafting, before and after the forward, after the updates; the slots that shared it
    # and the widest slot's rows
    picked: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # T=0: the target's picks per step
    end: int = 0  # the mark at its last step's end


def decode_batch(
    target: BatchedLM | OneSlot,
    proposers: list[Proposer],
    next_job: Callable[[], Job | None],
    finished: Callable[[Job, Generation], None],
    *,
    stop_ids: set[int],
    rule: acceptance.Rule = acceptance.EXACT,
) -> float:
    """Answer turns in `target.batch` slots, slot i drafting with `proposers[i]` (one method: they share feature
    layers), until `next_job` has none left; `finished` gets each turn's generation as it ends (so it may queue the
    conversation's next turn; the timings are filled in when the batch ends). Returns the batch's wall seconds
    (device synchronised). `rule` is the method's acceptance rule (its preset's, through `methods.rule`)."""
    device = target.device
    layers = proposers[0].feature_layers
    slots: list[_Turn | None] = [None] * target.batch
    done: list[_Turn] = []
    propose_all = batch_drafting(proposers)  # (a duck-typed one too)
    batched = isinstance(target, BatchedLM)  # (one read and one gather for every slot; views, not copies)
    start = clock(device)
    mark = Marks(device)
    mark()

    def begin(slot: int, job: Job) -> _Turn:
        if job.max_new_tokens <= 0:
            raise SpecbenchError(f"max_new_tokens must be positive, got {job.max_new_tokens}")
        if len(job.prompt) >= target.context_length:
            raise SpecbenchError(
                f"prompt of {len(job.prompt)} tokens does not fit the model's context of {target.context_length} tokens"
            )
        m0 = mark()
        prefill = target.prefill_slot(slot, job.prompt, layers)
        m1 = mark()
        features = prefill.features if prefill is not None else None
        proposers[slot].start(Turn(job.prompt, job.temperature, job.generator, features, job.request))
        budget = min(job.max_new_tokens, target.context_length - len(job.prompt))
        return _Turn(job, list(job.prompt), Generation([]), budget, (m0, m1, mark()))

    def end(slot: int) -> None:
        turn = slots[slot]
        assert turn is not None
        turn.end, slots[slot] = mark(), None
        done.append(turn)
        finished(turn.job, turn.gen)

    while True:
        for slot in range(target.batch):  # refill: a free slot takes the next turn waiting
            if slots[slot] is None and (job := next_job()) is not None:
                slots[slot] = begin(slot, job)
        active = [(slot, turn) for slot, turn in enumerate(slots) if turn is not None]
        if not active:
            break
        d0 = mark()  # (a phase's marks, not a slot's: each slot's share of the drafting is the phase over the slots)
        depths = [turn.budget - len(turn.gen.tokens) - 1 for _, turn in active]  # drafts the budget has room for
        drafted = propose_all([proposers[s] for s, _ in active], [t.tokens for _, t in active], depths)
        proposals = [p.pruned(depth) for p, depth in zip(drafted, depths, strict=True)]
        v0 = mark()
        past = [target.lengths[slot] for slot, _ in active]
        rows = [
            Row(slot, inputs(turn.tokens[-1], p), p.tree, p.side)
            for (slot, turn), p in zip(active, proposals, strict=True)
        ]
        greedy = all(turn.job.temperature == 0 for _, turn in active)
        outs = target.run(rows, layers=layers, greedy=greedy, copies=not batched)
        whole = target.last if batched else None
        host = whole.picks[0].tolist() if whole is not None and whole.picks is not None else None
        verdicts = [
            judge(p, out, rule, turn.job.temperature, turn.job.generator, host and host[row.slot][: len(row.tokens)])
            for (_, turn), p, out, row in zip(active, proposals, outs, rows, strict=True)
        ]
        kept = [[0, *accepted.rows] for accepted, _ in verdicts]
        target.commit([(slot, p0, k) for (slot, _), p0, k in zip(active, past, kept, strict=True)])
        kept_margins, kept_features = [None] * len(active), [None] * len(active)
        if whole is not None:  # every slot's kept rows gathered at once
            index = upload([slot for (slot, _), k in zip(active, kept, strict=True) for _ in k], device)
            rows_kept = upload([r for k in kept for r in k], device)
            sizes = [len(k) for k in kept]
            if whole.picks is not None:
                kept_margins = list(whole.picks[1][index, rows_kept].split(sizes))
            if whole.features is not None:
                kept_features = list(whole.features[index, rows_kept].split(sizes))
        v1 = mark()
        steps: list[tuple[_Turn, int, int, int]] = []
        ending: list[int] = []
        for i, (slot, turn) in enumerate(active):
            proposal, out, (accepted, best) = proposals[i], outs[i], verdicts[i]
            step = outcome(proposal, out, accepted, best, kept_margins[i])
            remaining = turn.budget - len(turn.gen.tokens)
            new = step.new
            stop_at = next((j for j, t in enumerate(new) if t in stop_ids), None)
            if stop_at is not None:
                new = new[: stop_at + 1]
            new = new[:remaining]
            if step.picks is not None:
                turn.picked.append((step.picks[0][: len(new)], step.picks[1][: len(new)]))
            turn.tokens.extend(new)
            turn.gen.tokens.extend(new)
            n = len(proposal.tree) + 1
            features = kept_features[i]
            if whole is None and out.features is not None:
                features = out.features[step.kept_rows]
            feedback = Feedback(
                step.accepted,
                features,
                out.logits[n:] if proposal.side else None,
                step.side_picks if proposal.side else None,
            )
            proposers[slot].update(turn.tokens, proposal, feedback)
            steps.append((turn, len(new), step.accepted.tested, len(out.logits)))
            if stop_at is not None or len(turn.gen.tokens) >= turn.budget:
                ending.append(slot)
        marks = (d0, v0, v1, mark(), len(active), max(len(row.tokens) for row in rows))
        for turn, accepted_length, tested, size in steps:
            turn.steps.append((accepted_length, tested, size, marks))
        for slot in ending:
            end(slot)
    wall = clock(device) - start
    at = mark.seconds()
    for turn in done:
        m0, m1, m2 = turn.marks
        gen = turn.gen
        gen.started, gen.ended = at[m0], at[turn.end]
        gen.wall_time, gen.prefill_draft_time = at[turn.end] - at[m0], at[m2] - at[m1]
        for new_tokens, tested, size, (d0, v0, v1, u1, sharing, width) in turn.steps:
            drafting = (at[v0] - at[d0] + at[u1] - at[v1]) / sharing
            gen.steps.append(Step(new_tokens, tested, size, drafting, at[v1] - at[v0], sharing, width))
        if turn.picked:  # read after the clock stops
            gen.target_top1 = [top1 for p in turn.picked for top1 in p[0]]
            gen.target_margin = torch.cat([p[1] for p in turn.picked]).tolist()
    return wall


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
    """Generate up to max_new_tokens after `prompt`, timing prefill to last token (device synchronised): the loop
    for a batch of one. `request` names what is answered (`Turn.request`); `reuse_prefill`: the target's cache of
    the same prompt is kept from the last call (`CachedLM.prefill`), for the sampling audit only: its prefill time
    would be wrong."""
    jobs = [Job(prompt, max_new_tokens, temperature, generator, request)]
    out: list[Generation] = []
    decode_batch(
        OneSlot(target, reuse_prefill),
        [proposer],
        lambda: jobs.pop() if jobs else None,
        lambda job, gen: out.append(gen),
        stop_ids=stop_ids,
        rule=rule,
    )
    return out[0]
