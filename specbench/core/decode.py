"""The one decode loop every method shares: propose -> verify -> accept -> commit -> update, for a batch of
sequences (slots) at once. Each slot has its own turn to answer; the method's one drafter proposes for every slot,
one target forward verifies them all, their verdicts are decided together (greedy inside the forward, sampled
chains in one batch, each slot drawing from its own generator) and committed at once, and a slot whose turn ends
takes the next turn waiting (the batch is refilled, so it stays full while work remains: the batch size a serving
engine holds). `decode` is a batch of one."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from ..errors import SpecbenchError
from . import acceptance
from .cached_lm import CachedLM, Forward
from .one_slot import Target, single
from .proposer import Drafter, Feedback, Proposal, Proposer, Turn, drafter
from .sampling import SparseLaws, inverse_cdf
from .static_lm import Row
from .step import inputs
from .synthetic import Profile
from .transfer import upload
from .tree import DeviceTree, is_chain


@dataclass(frozen=True)
class Step:
    accept_length: int  # tokens this step appended (the target's own token included)
    tested: int  # draft depth examined along the accepted path (see acceptance.Accepted)
    tree_size: int  # tokens sent to the target in the verification forward
    draft_time: float  # this sequence's drafting (its proposer's propose and update; in a batch, its share)
    verify_time: float  # the target's forward, acceptance and cache commit (every slot's, in a batch)
    slots: int = 1  # the slots that shared the step (its drafting phase and forward)
    width: int = 0  # the rows of the widest slot in its forward (each slot's are padded to a bucket of them)
    drafted: int = 0  # tokens drafted (more than tree_size - 1 when a schedule verified fewer)


@dataclass
class Generation:
    tokens: list[int]  # new tokens, up to and including the first stop token
    steps: list[Step] = field(default_factory=list)
    wall_time: float = 0.0
    prefill_draft_time: float = 0.0  # the proposer's own set-up for this turn (e.g. the draft's prefill; its share
    # when turns began together)
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


@dataclass(frozen=True, slots=True)
class StepMarks:
    """One step of a batch: its marks (`Marks` indices: drafting began, the forward began, every slot's verdict was
    committed, the loop's bookkeeping ended and the drafter's update began, it ended), the slots that shared it and
    the widest slot's rows."""

    drafting: int
    forward: int
    committed: int
    updating: int
    updated: int
    slots: int
    width: int


@dataclass(slots=True)  # (not frozen: one a slot a step; a frozen one costs 3x to build)
class Share:
    """A turn's part in one step: the step, the tokens it appended, the draft depth tested, the rows verified and
    the tokens drafted."""

    step: StepMarks
    tokens: int
    tested: int
    rows: int
    drafted: int


@dataclass
class _Turn:
    """A slot's turn in progress: its committed tokens, what it generated, and its part in each step."""

    job: Job
    tokens: list[int]
    gen: Generation
    budget: int
    marks: tuple[int, int, int]  # before the prefill (its slots' together), around their drafting's start
    joined: int  # the turns that began with it (its share of their drafting's start: 1/joined)
    shares: list[Share] = field(default_factory=list)
    picked: list[tuple[int, int, int]] = field(default_factory=list)  # T=0, per step: (its index in the batch's
    # picks, this slot, its new tokens), read at the end
    end: int = 0  # the mark at its last step's end


def decode_batch(
    target: Target,
    drafts: Drafter | Proposer | list[Proposer],
    next_job: Callable[[], Job | None],
    finished: Callable[[Job, Generation], None],
    *,
    stop_ids: set[int],
    rule: acceptance.Rule | Profile = acceptance.EXACT,
    reuse_prefill: bool = False,
) -> float:
    """Answer turns in `target.batch` slots, the method's `drafts` drafting for them (its Drafter, or one-sequence
    proposers, one per slot, adapted: `proposer.drafter`), until `next_job` has none left; `finished` gets each
    turn's generation as it ends (so it may queue the conversation's next turn; the timings are filled in when the
    batch ends). Returns the batch's wall seconds (device synchronised). `rule` is the method's acceptance rule (its
    preset's, through `methods.rule`), or a synthetic profile that forces every verdict at every temperature
    (`forced`: cost-only). `reuse_prefill`: the sampling audit's (`BatchedLM.prefill`).

    A step is batch operations: one forward for every slot's rows, at T = 0 every slot's verdict in one
    (`acceptance.greedy_batch`) and one read of the device (accepted lengths, kept rows and new tokens), one commit;
    what remains per slot is its tokens on the host; the drafter proposes and learns once a step for every slot."""
    device = target.device
    drafting = drafter(drafts)
    layers = drafting.feature_layers
    slots: list[_Turn | None] = [None] * target.batch
    done: list[_Turn] = []
    picks: list[tuple[torch.Tensor, torch.Tensor]] = []  # T=0, per step: the target's argmax and margin at every
    # slot's kept rows [B, b] (the greedy check's), read once when the batch ends
    start = clock(device)
    mark = Marks(device)
    mark()

    def begin(joining: list[tuple[int, Job]]) -> None:
        """The joining slots' turns begun: their prompts prefilled together (`prefill`), then their drafting
        started together. A turn's marks: before the prefill they shared, and around their drafting's start."""
        for _, job in joining:
            if job.max_new_tokens <= 0:
                raise SpecbenchError(f"max_new_tokens must be positive, got {job.max_new_tokens}")
            if len(job.prompt) >= target.context_length:
                raise SpecbenchError(
                    f"prompt of {len(job.prompt)} tokens does not fit the model's context of "
                    f"{target.context_length} tokens"
                )
        lanes = [slot for slot, _ in joining]
        m0 = mark()
        prefills = target.prefill(lanes, [job.prompt for _, job in joining], layers, reuse=reuse_prefill)
        m1 = mark()
        drafting.start(
            lanes,
            [
                Turn(job.prompt, job.temperature, job.generator, None if out is None else out.features, job.request)
                for (_, job), out in zip(joining, prefills, strict=True)
            ],
        )
        m2 = mark()
        for slot, job in joining:
            budget = min(job.max_new_tokens, target.context_length - len(job.prompt))
            slots[slot] = _Turn(job, list(job.prompt), Generation([]), budget, (m0, m1, m2), len(joining))

    while True:
        joining = []  # refill: a free slot takes the next turn waiting
        for slot in range(target.batch):
            if slots[slot] is None and (job := next_job()) is not None:
                joining.append((slot, job))
        if joining:
            begin(joining)
        active = [(slot, turn) for slot, turn in enumerate(slots) if turn is not None]
        if not active:
            break
        d0 = mark()  # (a phase's marks, not a slot's: each slot's share of the drafting is the phase over the slots)
        depths = [turn.budget - len(turn.gen.tokens) - 1 for _, turn in active]  # drafts the budget has room for
        lanes_host = [slot for slot, _ in active]
        drafted = drafting.propose(lanes_host, [t.tokens for _, t in active], depths)
        greedy = all(turn.job.temperature == 0 for _, turn in active)
        forcing = isinstance(rule, Profile)  # (the forward's picks read once, no verdict judged with it)
        judged = greedy and not forcing  # (then a tree past the budget is cut on the device, unread)
        proposals = [p.pruned(depth, judged) for p, depth in zip(drafted, depths, strict=True)]
        v0 = mark()
        past = list(target.lengths)
        rows = [verification(slot, turn.tokens[-1], p) for (slot, turn), p in zip(active, proposals, strict=True)]
        whole, judgement = target.verify(rows, layers=layers, greedy=greedy or forcing, judged=judged)
        picked = None  # T=0: the target's argmax and margin at every slot's kept rows [B, b] (the greedy check's)
        if judgement is not None:  # every slot's verdict, computed with the forward: one read
            verdicts = read(judgement.summary, active, proposals)
            picked, features = (judgement.top1, judgement.margin), judgement.features  # [B, b], [B, b, F]
            if isinstance(judgement.summary, torch.Tensor):  # (decided in the forward: a replay writes over them)
                picked = (picked[0].clone(), picked[1].clone())
                features = None if features is None else features.clone()
            picks.append(picked)
        else:
            if isinstance(rule, Profile):
                verdicts = forced(active, proposals, whole, rule)
            else:
                verdicts = sampled(active, proposals, whole, rule)
            features = None
            if whole.features is not None:  # every slot's kept rows gathered at once
                width = len(whole.logits[0])
                padded = [r for v in verdicts for r in v.kept + [0] * (width - len(v.kept))]
                features = whole.features.new_zeros(target.batch, width, whole.features.shape[-1])
                lanes = upload(lanes_host, device)
                features[lanes] = whole.features[lanes[:, None], upload(padded, device).view(len(active), width)]
        target.commit([(slot, past[slot], v.kept) for (slot, _), v in zip(active, verdicts, strict=True)])
        v1 = mark()
        ending: list[int] = []
        appended: list[int] = []
        feedback: list[Feedback] = []
        for (slot, turn), verdict in zip(active, verdicts, strict=True):
            remaining = turn.budget - len(turn.gen.tokens)
            new = verdict.new
            stop_at = None if stop_ids.isdisjoint(new) else next(j for j, t in enumerate(new) if t in stop_ids)
            if stop_at is not None:
                new = new[: stop_at + 1]
            new = new[:remaining]
            turn.tokens.extend(new)
            turn.gen.tokens.extend(new)
            appended.append(len(new))
            if picked is not None:
                turn.picked.append((len(picks) - 1, slot, len(new)))
            if stop_at is not None or len(turn.gen.tokens) >= turn.budget:
                ending.append(slot)
        u0 = mark()  # the loop's own bookkeeping above is no drafter's: drafting resumes here
        if drafting.learns:
            kept: tuple[torch.Tensor, ...] = () if features is None else features.unbind()  # (each slot's: one op)
            for i, ((slot, _), proposal, verdict) in enumerate(zip(active, proposals, verdicts, strict=True)):
                n = len(proposal.tree) + 1
                feedback.append(
                    Feedback(
                        acceptance.Accepted(verdict.kept[1:], verdict.new[-1], verdict.tested),
                        kept[slot][: len(verdict.kept)] if kept else None,
                        whole.logits[slot, n : rows[i].size] if proposal.side else None,
                        verdict.side_picks,
                    )
                )
            drafting.update(lanes_host, [t.tokens for _, t in active], proposals, feedback)
        step = StepMarks(d0, v0, v1, u0, mark(), len(active), max(row.size for row in rows))
        for (_, turn), verdict, row, tokens, p in zip(active, verdicts, rows, appended, proposals, strict=True):
            made = len(p.tree) if p.drafted is None else p.drafted  # (a schedule's cut; the budget's is no schedule)
            turn.shares.append(Share(step, tokens, verdict.tested, row.size, made))
        for slot in ending:
            ended = slots[slot]
            assert ended is not None
            ended.end, slots[slot] = mark(), None
            done.append(ended)
            finished(ended.job, ended.gen)
    wall = clock(device) - start
    at = mark.seconds()
    host: list[tuple[list, list]] = []
    for turn in done:
        m0, m1, m2 = turn.marks
        gen = turn.gen
        gen.started, gen.ended = at[m0], at[turn.end]
        gen.wall_time, gen.prefill_draft_time = at[turn.end] - at[m0], (at[m2] - at[m1]) / turn.joined
        for share in turn.shares:
            mk = share.step
            drafting_share = (at[mk.forward] - at[mk.drafting] + at[mk.updated] - at[mk.updating]) / mk.slots
            verifying = at[mk.committed] - at[mk.forward]
            gen.steps.append(
                Step(
                    share.tokens, share.tested, share.rows, drafting_share, verifying, mk.slots, mk.width, share.drafted
                )
            )
        if turn.picked:  # read after the clock stops, each step's once
            host = host or [(top1.tolist(), margin.tolist()) for top1, margin in picks]
            gen.target_top1 = [t for step, i, k in turn.picked for t in host[step][0][i][:k]]
            gen.target_margin = [m for step, i, k in turn.picked for m in host[step][1][i][:k]]
    return wall


def verification(slot: int, root: int, proposal: Proposal) -> Row:
    """A slot's rows of the verification: [root] + tree (+ side branch); a tree drafted on the device keeps its ids
    there, the root beside them (`Row.root`)."""
    tree = proposal.tree
    if isinstance(tree, DeviceTree) and tree.on_device and proposal.side is None:
        return Row(slot, tree.ids, tree, root=root)
    return Row(slot, inputs(root, proposal), tree, proposal.side)


@dataclass(slots=True)  # (not frozen: one a slot a step)
class Verdict:
    """One slot's verdict on the host: the rows it keeps (the root, then the accepted path), the tokens it appends
    (the accepted ones, then the target's own), the draft depth tested, and at T = 0 the side branch's picks."""

    kept: list[int]
    new: list[int]
    tested: int
    side_picks: list[int] | None = None


def read(summary: torch.Tensor | list[list[int]], active: list, proposals: list[Proposal]) -> list[Verdict]:
    """The active slots' greedy verdicts from `step.Judged.summary` [B, 2 + 3b], read in one transfer."""
    host = summary if isinstance(summary, list) else summary.tolist()
    b = (len(host[0]) - 2) // 3
    verdicts = []
    for (slot, _), p in zip(active, proposals, strict=True):
        row = host[slot]
        n = row[0] + 1
        side = None
        if p.side is not None:  # (its rows follow the root and the tree's)
            first = 2 + 2 * b + len(p.tree) + 1
            side = row[first : first + len(p.side.tokens)]
        verdicts.append(Verdict(row[2 : 2 + n], row[2 + b : 2 + b + n], row[1], side))
    return verdicts


def sampled(active: list, proposals: list[Proposal], whole: Forward, rule: acceptance.Rule) -> list[Verdict]:
    """At T > 0, each slot's verdict by the method's rule on its rows, drawing from its own generator: the chains
    (empty ones included) and the trees of a rule with batch forms (`Rule.chains`, `Rule.trees`) all at once
    (`batch_verdicts`; a side branch's rows follow its tree's, which are all a verdict reads), a rule without them
    and a T = 0 slot in a batch mixing temperatures slot by slot."""
    verdicts: list[Verdict | None] = [None] * len(active)
    chains, trees = [], []
    for i, ((_, turn), p) in enumerate(zip(active, proposals, strict=True)):
        if turn.job.temperature == 0:
            continue
        # (a drafted shape read from the device: a chain's verdict is the batch's wherever it was drafted)
        if rule.chains is not None and is_chain(p.tree.parents):
            chains.append(i)
        elif rule.trees is not None:
            trees.append(i)
    for group, chained in ((chains, True), (trees, False)):
        if group:
            found = batch_verdicts([active[i] for i in group], [proposals[i] for i in group], whole, rule, chained)
            for i, verdict in zip(group, found, strict=True):
                verdicts[i] = verdict
    for i, ((slot, turn), p) in enumerate(zip(active, proposals, strict=True)):
        if verdicts[i] is not None:
            continue
        tree = p.tree
        if turn.job.temperature == 0:  # (a batch mixing temperatures: this slot's rows read alone)
            best = tree.read_along(whole.logits[slot, : len(tree) + 1].argmax(-1))
            accepted = acceptance.greedy(tree, best)
        else:
            logits = whole.logits[slot, : len(tree) + 1]
            accepted = rule(tree, logits, p.draft_probs, turn.job.temperature, turn.job.generator)
        tokens = tree.tokens
        new = [tokens[r - 1] for r in accepted.rows] + [accepted.token]
        verdicts[i] = Verdict([0, *accepted.rows], new, accepted.tested)
    return [v for v in verdicts if v is not None]


def batch_verdicts(
    active: list, proposals: list[Proposal], whole: Forward, rule: acceptance.Rule, chains: bool
) -> list[Verdict]:
    """Every sampled chain's (`chains`: `rule.chains`) or tree's (`rule.trees`) verdict at once, read in one
    transfer with each one's drafted tokens. Each slot draws its nodes + 1 uniforms from its own generator, so its
    tokens depend on no batch-mate (docs/metrics.md)."""
    logits, device = whole.logits, whole.logits.device
    lengths = [len(p.tree) for p in proposals]
    k, vocab = max(lengths), logits.shape[-1]
    at = upload([slot for slot, _ in active], device)
    temperature = torch.tensor([turn.job.temperature for _, turn in active], device=device)
    probs = torch.softmax(logits[at, : k + 1].float() / temperature[:, None, None], dim=-1)  # [n, k + 1, V]
    if k == 0:  # nothing drafted (vanilla's steps): each token from its root's law, by the slot's one draw
        draws = torch.cat([torch.rand(1, generator=turn.job.generator, device=device) for _, turn in active])
        return [Verdict([0], [token], 0) for token in inverse_cdf(probs[:, 0], draws).tolist()]
    tokens = torch.zeros(len(active), k, dtype=torch.long, device=device)
    parents = torch.full((len(active), k), -2, dtype=torch.long, device=device)  # (-2: no node)
    draws = torch.ones(len(active), k + 1, device=device)
    for i, ((_, turn), p, n) in enumerate(zip(active, proposals, lengths, strict=True)):
        draws[i, : n + 1] = torch.rand(n + 1, generator=turn.job.generator, device=device)
        if n:
            tree = p.tree
            tokens[i, :n] = tree.ids if isinstance(tree, DeviceTree) and tree.on_device else upload(tree.tokens, device)
            if not chains:
                parents[i, :n] = tree.parents_tensor().to(device)
    laws = [p.draft_probs for p in proposals]
    q: torch.Tensor | SparseLaws | None = None  # the laws the nodes were drawn from: [n, k, V] (one-hot rows: point
    # masses), or for chains of sparse laws and point masses [n, k, K] ids and probs; point masses alone need none
    if (
        chains
        and any(isinstance(law, SparseLaws) for law in laws)
        and not any(isinstance(law, torch.Tensor) for law in laws)
    ):
        q = sparse_laws(tokens, laws, lengths)
    elif any(law is not None for law in laws):
        q = torch.nn.functional.one_hot(tokens, vocab).float()
        for i, (law, n) in enumerate(zip(laws, lengths, strict=True)):
            if law is not None and n:
                rows = law[:n].dense(vocab) if isinstance(law, SparseLaws) else law[:n]
                q[i, :n, : rows.shape[-1]] = rows
                q[i, :n, rows.shape[-1] :] = 0
    if chains:
        assert rule.chains is not None
        v = rule.chains(probs, tokens, q, upload(lengths, device), draws)
        host = torch.cat([torch.stack([v.length, v.token, v.tested], 1), tokens], 1).tolist()  # [n, 3 + k]
        return [Verdict(list(range(row[0] + 1)), [*row[3 : 3 + row[0]], row[1]], row[2]) for row in host]
    assert rule.trees is not None
    depth = max(p.tree.depth_bound() for p in proposals)
    t = rule.trees(probs, tokens, q, parents, upload(lengths, device), draws, depth, **rule.params)
    drafted = tokens.gather(1, (t.path - 1).clamp(min=0))  # [n, d]: the path's tokens
    host = torch.cat([torch.stack([t.length, t.token, t.tested], 1), t.path, drafted], 1).tolist()
    return [Verdict([0, *row[3 : 3 + row[0]]], [*row[3 + depth : 3 + depth + row[0]], row[1]], row[2]) for row in host]


def sparse_laws(tokens: torch.Tensor, laws: list, lengths: list[int]) -> SparseLaws:
    """Chains' laws as ids and probs [n, k, K] (K: the most candidates a row): each sparse law's rows, and a point
    mass's (None) its drafted token with mass 1; the rest zero mass."""
    width = max(law.ids.shape[-1] for law in laws if isinstance(law, SparseLaws))
    ids = tokens[..., None].repeat(1, 1, width)  # [n, k, K]: a point mass's columns all its token, the first with
    probs = torch.zeros(ids.shape, device=tokens.device)  # mass 1
    probs[..., 0] = 1.0
    for i, (law, n) in enumerate(zip(laws, lengths, strict=True)):
        if isinstance(law, SparseLaws) and n:
            count = law.ids.shape[-1]
            ids[i, :n, :count], probs[i, :n, :count], probs[i, :n, count:] = law.ids[:n], law.probs[:n], 0
    return SparseLaws(ids, probs)


def forced(active: list, proposals: list[Proposal], whole: Forward, profile: Profile) -> list[Verdict]:
    """Cost-only verdicts (`acceptance.forced`) from the target's picks, read in one transfer for every slot (one a
    slot, with its tree, where a tree is still on the device). Each slot draws from a generator keyed by its
    question's seed, its request (question and turn) and its step, so its verdicts depend on no batch-mate and on
    no drafter's sampling."""
    assert whole.picks is not None
    top1 = whole.picks[0]
    host = None if any(p.tree.on_device for p in proposals) else top1.tolist()
    verdicts = []
    for (slot, turn), p in zip(active, proposals, strict=True):
        tree, job = p.tree, turn.job
        n = len(tree) + 1 + (0 if p.side is None else len(p.side.tokens))
        best = host[slot][:n] if host is not None else tree.read_along(top1[slot, :n])
        seed = 0 if job.generator is None else job.generator.initial_seed()  # (None at T = 0: the request keys it)
        draw = random.Random(f"{seed}/{job.request}/{len(turn.shares)}")
        accepted = acceptance.forced(tree, best, profile, draw)
        new = [tree.tokens[r - 1] for r in accepted.rows] + [accepted.token]
        side = best[len(tree) + 1 :] if p.side is not None else None
        verdicts.append(Verdict([0, *accepted.rows], new, accepted.tested, side))
    return verdicts


def decode(
    target: CachedLM | Target,
    proposer: Proposer | Drafter,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_ids: set[int],
    generator: torch.Generator | None = None,
    rule: acceptance.Rule | Profile = acceptance.EXACT,
    request: tuple[Hashable, int] | None = None,
    reuse_prefill: bool = False,
) -> Generation:
    """Generate up to max_new_tokens after `prompt`, timing prefill to last token (device synchronised): the loop
    for a batch of one (`target`: a CachedLM, or a model behind the batch interface of one slot). `request` names
    what is answered (`Turn.request`); `reuse_prefill`: the target's cache of the same prompt is kept from the last
    call (`BatchedLM.prefill`), for the sampling audit only: its prefill time would be wrong."""
    jobs = [Job(prompt, max_new_tokens, temperature, generator, request)]
    out: list[Generation] = []
    decode_batch(
        single(target),
        proposer,
        lambda: jobs.pop() if jobs else None,
        lambda job, gen: out.append(gen),
        stop_ids=stop_ids,
        rule=rule,
        reuse_prefill=reuse_prefill,
    )
    return out[0]
