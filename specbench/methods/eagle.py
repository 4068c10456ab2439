"""EAGLE-1, EAGLE-2 and EAGLE-3: a one-layer draft head autoregresses over the target's features and grows a
token tree level by level. One drafting loop serves all three; the head is pluggable (EAGLE-1/2: the target's
final state and lm_head; EAGLE-3: three fused target states, its own readout over a draft vocabulary whose ids
map to target ids) and an expansion policy (`methods.eagle_trees`: EAGLE-1's static tree of ranks, EAGLE-2/3's
dynamic tree) decides which candidates become nodes, which nodes grow children, and which nodes are sent to the
target.

Candidates are the draft's deterministic top-k, so at T > 0 they go to verification as point masses
(draft_probs None): accept x with probability p(x), else zero p(x) and try the next sibling. That is lossless.

With `sampled` (T > 0 only), each grown node's children are instead drawn from the draft's distribution at
the run's temperature without replacement (`sampling.draw_distinct_padded`), and each is verified against the
law it was drawn from (recursive rejection sampling: the shared exact rule with those rows as draft_probs), which
keeps far more acceptance when sampling. Exactness needs every node's place in the tree to be decided
without looking at its own token: siblings are tested in draw order, a node's children may depend on its
score, but EAGLE-2's final pick of the best-scoring nodes would bias the draws, so a sampled dynamic tree
keeps the first `total_tokens - 1` candidates in the order they were drawn (level by level) instead.

The candidates live in tensors on the head's device (`Draft`), a whole level at a time: no Python runs per node,
and the host waits on the device only for a count that depends on the draft (how many children a sampled level
admits and grows; a static tree of top-k candidates reads its levels from the template, `StaticTree.fixed`) and
once at the end, for the tree handed to the target. Each slot's last candidates stay on its `Lane` as
`drafted`. Under --graphs, top-k candidates draft on a static cache, captured on a GPU (`StaticDrafting`), and the
tree stays on the device for the target to verify and read with its picks (`DeviceTree`). A batch's slots
(`run --batch`) share one static cache and draft together: every tensor of a draft has the slots as its first
dimension, and one head forward per level serves them all (`StaticDrafting.propose`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from ..core import choices
from ..core.proposer import NO_PROPOSAL, Drafter, Feedback, Nested, Proposal, Turn, tree_prefix
from ..core.sampling import draw_distinct_padded, probabilities
from ..core.static_cache import StaticRows
from ..core.transfer import appended
from ..core.tree import Tree, additive, additive_mask
from ..heads import frequencies
from ..heads.eagle import EagleHead
from ..heads.eagle3 import Eagle3Head, feature_layers
from ..registry import implementation, unless_sampled
from .eagle_static import StaticDrafting, rows_of
from .eagle_trees import Ahead, Children, Draft, DynamicTree, StaticTree, level_nodes, level_scores, per_slot
from .resources import Resources

if TYPE_CHECKING:  # (importing heads.mtp registers its family: methods.mtp does)
    from ..heads.mtp import MtpHead


@dataclass
class Lane:
    """One slot's turn."""

    turn: Turn
    sampling: bool  # children drawn (`sampled` at T > 0): on an eager cache of the slot's own
    pending: torch.Tensor  # [c, F]: target states of committed tokens not yet fed to the head
    cache: DynamicCache | None  # the committed pairs' keys (eager); None: in the static drafting's rows
    root: torch.Tensor | None = None  # [H] (eager): the head's output at the root's position
    drafted: Draft | None = None  # the last proposal's candidates, kept or not: the draft of the batch it was
    # drafted in, this slot's row `row` of it (taken when read: `draft`, rarely, not at every step)
    row: int = 0

    def draft(self) -> Draft | None:
        """The last proposal's candidates, this slot's own."""
        return None if self.drafted is None else self.drafted.row(self.row)


class Eagle(Drafter):
    def __init__(
        self,
        head: EagleHead | Eagle3Head | MtpHead,
        lm_head: Callable[[torch.Tensor], torch.Tensor],  # head output [n, H] -> draft-vocabulary logits [n, V']
        expansion: StaticTree | DynamicTree,
        *,
        feature_layers: tuple[int, ...] = (-1,),  # the target states the head reads (CachedLM.run's `layers`)
        target_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,  # draft ids -> target ids; None: equal
        target_vocab: int | None = None,  # the target's vocabulary size when the draft's differs
        sampled: bool = False,  # at T > 0, draw children from the draft without replacement (module docstring)
        slots: int = 1,
        static: bool = False,  # top-k candidates draft on a static cache (`StaticDrafting`; always for a batch)
        capture: bool = True,  # (captured on a GPU)
        compile: bool = False,  # (its drafting through torch.compile)
    ) -> None:
        self.head = head
        self.lm_head = lm_head
        self.expansion = expansion
        self.feature_layers = feature_layers
        self.target_ids = target_ids
        self.target_vocab = target_vocab
        self.sampled = sampled
        self.device = head.fc.weight.device
        self.dtype = head.fc.weight.dtype  # the head's masks' (additive: 0 where a key is seen, the dtype's min not)
        self.eye = additive(torch.eye(expansion.fed, dtype=torch.bool, device=self.device), self.dtype)  # a level
        # grows at most `fed` nodes; each sees itself
        self.constants: dict[tuple[str, int, int], torch.Tensor] = {}  # `_constant`'s
        self.lanes: dict[int, Lane] = {}
        self.none_drafted = Draft.empty(self.device)  # a lane's draft when it drafted nothing (shared: never written)
        self.static = StaticDrafting(self, slots, capture, compile) if static or slots > 1 else None

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        for slot, turn in zip(slots, turns, strict=True):
            sampling = self.sampled and turn.temperature > 0
            pending = turn.features if turn.features is not None else torch.empty(0, self.head.feature_size)
            if self.static is not None and not sampling:  # the prompt's pairs are fed with the first draft
                self.static.lengths[slot] = 0
                self.lanes[slot] = Lane(turn, sampling, pending, None)
                continue
            self.lanes[slot] = lane = Lane(turn, sampling, pending, DynamicCache(config=self.head.config))
            self._extend(lane, turn.prompt)

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        for slot, committed, fed in zip(slots, tokens, feedback, strict=True):
            assert fed.features is not None  # the target returns the feature_layers' states
            lane = self.lanes[slot]
            lane.pending = appended(lane.pending, fed.features)
            if lane.cache is not None:
                self._extend(lane, committed)

    @torch.inference_mode()
    def _extend(self, lane: Lane, tokens: list[int]) -> None:
        """Feed the committed pairs (feature of token i, token i + 1) the slot's eager cache lacks."""
        assert lane.cache is not None
        past = lane.cache.get_seq_length()
        n = min(len(lane.pending), len(tokens) - 1 - past)
        if n <= 0:
            return
        ids = torch.tensor([tokens[past + 1 : past + 1 + n]], device=self.device)
        positions = torch.arange(past, past + n, device=self.device)[None]
        allowed = torch.ones(n, past + n, dtype=torch.bool).tril(past)  # causal over the cache and the new rows
        mask = additive_mask(allowed, self.head.fc.weight.dtype, self.device)
        out = self.head(lane.pending[None, :n], ids, positions, mask, lane.cache)[0]  # [n, H]
        lane.pending = lane.pending[n:]
        lane.root = out[-1] if past + n == len(tokens) - 1 else None

    @torch.inference_mode()
    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """The slots on the static drafting draft together, one head forward per level for every slot
        (`StaticDrafting.propose`); those on an eager cache (sampled children) one after another. At T = 0 a static
        slot near its token budget drafts the whole depth with the others (the loop cuts its tree on the device),
        so the batch drafts in one group, not one a depth."""
        found = [NO_PROPOSAL] * len(slots)
        top = self.expansion.max_depth
        depths = [
            top if d >= 1 and lane.cache is None and lane.turn.temperature == 0 else min(top, d)
            for d, lane in zip(max_depths, (self.lanes[s] for s in slots), strict=True)
        ]
        static = [i for i, slot in enumerate(slots) if self.lanes[slot].cache is None]
        if static:
            assert self.static is not None  # (a lane without a cache of its own is on it)
            chosen = [slots[i] for i in static]
            for i, drafted in zip(
                static,
                self.static.propose(chosen, [tokens[i] for i in static], [depths[i] for i in static]),
                strict=True,
            ):
                lane = self.lanes[slots[i]]
                lane.drafted, lane.row = (self.none_drafted, 0) if drafted is None else drafted[:2]
                found[i] = NO_PROPOSAL if drafted is None else Proposal(drafted[2])
        for i, slot in enumerate(slots):
            if self.lanes[slot].cache is not None:
                found[i] = self._eager(self.lanes[slot], depths[i])
        return found

    def _eager(self, lane: Lane, depths: int) -> Proposal:
        """One slot's draft on its eager cache."""
        assert lane.cache is not None
        lane.drafted, lane.row = self.none_drafted, 0
        if lane.root is None or depths < 1:
            return NO_PROPOSAL
        batch, fed = self._grow(lane.root[None], depths, lane.cache.get_seq_length(), lane)
        draft = batch.row(0)
        if fed:  # tree keys are discarded, the committed prefix stays
            lane.cache.crop(-fed)  # (transformers 5 crops by minus the count)
        lane.drafted = batch
        keep = self.expansion.select(draft)
        return Proposal(draft.tree(keep), None if draft.laws is None else draft.laws[keep])

    def _grow(
        self, root: torch.Tensor, depths: int, position: int | torch.Tensor, lane: Lane | None = None
    ) -> tuple[Draft, int]:
        """The drafts [B, n] of `depths` levels from the head's outputs at the roots [B, H] (a batch's sequences
        drafted together; B = 1 for one, and for sampled children, whose counts depend on the draws), at the
        positions (the committed pairs in the cache) `position` (an int, or [B]); and how many tree rows went into
        each sequence's cache. `lane`: one slot's on its eager cache (None: the static drafting's)."""
        batch = len(root)
        levels, start = [], 0  # the draft's levels, and the nodes before the newest
        frontier = torch.full((batch, 1), -1, device=self.device)  # the growing nodes [B, F]; -1 is the root
        frontier_places = None  # StaticTree: the growing nodes' template places [F], every sequence's (None: the root)
        reached = torch.zeros(batch, 1, dtype=torch.float64, device=self.device)  # [B, F]: their scores
        hidden = root[:, None]  # [B, F, H]: the head's outputs at their positions
        seen = torch.zeros(batch, 1, 0, dtype=self.dtype, device=self.device)  # [B, F, fed]: their fed
        # ancestors-or-self (additive: 0 where seen)
        laws = []  # per level [1, n, V] when sampled
        ahead = Ahead.of(self.head, hidden, position, depths - 1)
        for depth in range(1, depths + 1):
            children = self._children(self.lm_head(hidden), lane)  # [B, F, k] each
            k = children.tokens.shape[-1]
            places = self.expansion.admits(frontier_places, k, self.device)  # [F, k] or None
            admitted = children.valid  # [1, F, k] or None (all): which candidates become nodes
            fixed = None if children.valid is not None else self.expansion.fixed(depth, k, self.device)
            if places is not None:
                admitted = places >= 0 if admitted is None else admitted & (places >= 0)
            if admitted is None:  # every candidate is a node: the level is the [F, k] top-k as they come
                picked, rows = None, self._constant("rows", frontier.shape[1], k)
            else:  # (the same candidates in every sequence: a template's, or one sequence's draws)
                picked = fixed[0] if fixed is not None else admitted.flatten().nonzero().squeeze(1)
                rows = picked // k  # each node's parent's row in the frontier
            level = Draft(
                level_nodes(children.tokens, picked),
                frontier[:, rows],
                level_scores(reached, children.logps, rows, picked),
                per_slot(self._constant("depths", len(rows), depth), batch),
                None if places is None else per_slot(level_nodes(places, picked), batch),
            )
            if children.laws is not None:
                laws.append(children.laws.flatten(1, 2)[:, picked])
            levels.append(level)
            if depth == depths:
                break
            grown = fixed[1].expand(batch, -1) if fixed is not None else self.expansion.grow(level)  # [B, F']:
            if not grown.shape[-1]:  # positions in the level
                break
            above = rows[grown]  # [B, F']: each grown node's parent's row in the frontier
            eye = self.eye[: grown.shape[-1], : grown.shape[-1]].expand(batch, -1, -1)
            seen = torch.cat([rows_of(seen, above), eye], dim=2)
            hidden = self._feed(
                rows_of(hidden, above), level.tokens.gather(1, grown), seen, position, depth, ahead, lane
            )
            frontier, reached = start + grown, level.scores.gather(1, grown)
            frontier_places = None if level.places is None else level.places[0, grown[0]]
            start += len(level)
        draft = Draft.joined(levels)
        if laws:
            draft.laws = torch.cat(laws, dim=1)
        return draft, seen.shape[-1]

    def _constant(self, kind: str, n: int, value: int) -> torch.Tensor:
        """A level's tensor that depends on its shape only (never written to), made once, so a captured step
        launches nothing for it: "rows" [n * value], each of n parents' `value` candidates' parent row; "depths"
        [n], `value` n times."""
        key = (kind, n, value)
        if key not in self.constants:
            self.constants[key] = (
                torch.arange(n * value, device=self.device) // value
                if kind == "rows"
                else torch.full((n,), value, device=self.device)
            )
        return self.constants[key]

    def _children(self, logits: torch.Tensor, lane: Lane | None) -> Children:
        """The candidate children of each growing node from its row of logits [B, F, V']: the draft's top k, or
        when sampling (one sequence: B = 1) k draws without replacement and their laws."""
        k = min(self.expansion.branch, logits.shape[-1])
        if lane is None or not lane.sampling:
            top = torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(k)  # (the cast inside: one kernel)
            ids = top.indices if self.target_ids is None else self.target_ids(top.indices)
            return Children(ids, top.values, None, None)
        draft_ids = torch.arange(logits.shape[-1], device=logits.device)
        to_target = draft_ids if self.target_ids is None else self.target_ids(draft_ids)  # [V']
        q = probabilities(logits[0], lane.turn.temperature)  # [F, V']
        drawn, laws, real = draw_distinct_padded(q, k, lane.turn.generator)  # [F, k], [F, k, V'], [F] real draws
        if self.target_ids is not None:  # laws move onto the target vocabulary
            assert self.target_vocab is not None  # given with target_ids
            full = laws.new_zeros(*drawn.shape, self.target_vocab)
            full[..., to_target] = laws
            laws = full
        valid = torch.arange(drawn.shape[1], device=drawn.device) < real[:, None]
        return Children(to_target[drawn][None], torch.log(q.gather(1, drawn))[None], valid[None], laws[None])

    def _feed(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        seen: torch.Tensor,
        root: int | torch.Tensor,
        depth: int,
        ahead: Ahead,
        lane: Lane | None,
    ) -> torch.Tensor:
        """One draft forward over a level's growing nodes [B, n] from their parents' outputs features [B, n, H], at
        the position of the root (`root`, the committed pairs) + depth - 1; each row sees the committed prefix and
        what `seen` [B, n, fed + n] marks among the fed nodes and the level's own rows (its ancestors and itself;
        additive, 0 where seen). Returns the head's outputs [B, n, H]."""
        batch, n = tokens.shape
        positions = ahead.positions[:, depth - 1 : depth].expand(batch, n)
        rope = tuple(t[:, depth - 1 : depth].expand(batch, n, -1) for t in ahead.rope)
        cache: StaticRows | DynamicCache
        if lane is None or lane.cache is None:  # tree rows after the committed ones; every key row is masked
            assert self.static is not None  # (its cache)
            mask, cache = self.static.tree_rows(seen, n), self.static.cache
        else:  # (one sequence)
            assert isinstance(root, int)  # (the eager cache's length)
            mask = torch.cat([seen.new_zeros(batch, n, root), seen], dim=2)  # [1, n, committed + fed + n]
            cache = lane.cache
        return self.head(features, tokens, positions, mask[:, None], cache, rope)


def _nested_tree(snapshot: tuple[Draft, int], params: dict) -> Tree:
    """The tree DynamicTree(total_tokens, depth, top_k) proposes, from a deeper draft with the same top_k."""
    draft, top_k = snapshot
    part = draft.upto(params["depth"] + 1)
    return part.tree(DynamicTree(params["total_tokens"], params["depth"], top_k).select(part))


DYNAMIC = Nested(
    ("total_tokens", "depth"),
    snapshot=lambda drafter, slot, proposal: (drafter.lanes[slot].draft(), drafter.expansion.branch),
    subtree=_nested_tree,
)


def _static_paths(drafter: Drafter, slot: int, proposal: Proposal) -> tuple[list[tuple], list[list[int]]]:
    """Each proposed node's path of ranks (the proposal keeps every drafted node, in order) and the tree's paths."""
    assert isinstance(drafter, Eagle) and isinstance(drafter.expansion, StaticTree)  # EAGLE-1's
    tree, drafted = drafter.expansion, drafter.lanes[slot].draft()
    ranks = None if drafted is None else drafted.places
    return [tree.paths[s] for s in (ranks.tolist() if ranks is not None else [])], tree.choices


def _shortlist(
    res: Resources, family: str, draft_vocab: float | None, readable: torch.Tensor, what: str
) -> torch.Tensor | None:
    """Positions in `readable` (the target ids [V'] the head reads out, in its readout's order), ascending, of its
    most frequent tokens by the head's token counts (`heads.frequencies`): `draft_vocab` of them, or that share
    when below 1; None: all of them."""
    if draft_vocab is None:
        return None
    count = len(readable)
    size = round(draft_vocab * count) if isinstance(draft_vocab, float) and 0 < draft_vocab < 1 else draft_vocab
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= count:
        raise ValueError(
            f"draft_vocab must be a token count from 1 to {what} {count}, a share of it between 0 and 1, or null"
        )
    folder = res.head_path(family)
    hint = f"count the text the head was trained on with `specbench token-counts --data TEXT --out {folder}`"
    counts = frequencies.read(folder, res.target_model.config.get_text_config().vocab_size, hint)
    return frequencies.most_frequent(counts[readable.cpu()], size).to(readable.device)


def _on_target_head(
    res: Resources,
    slots: int,
    expansion: StaticTree | DynamicTree,
    sampled: bool,
    draft_dtype: str | None,
    draft_vocab: float | None,
) -> Eagle:
    """An EAGLE-1/2 head reading out through the target's lm_head, in `draft_dtype`, over the most frequent tokens
    of the head's training text only with `draft_vocab` (`_shortlist`)."""
    dtype = res.draft_dtype(draft_dtype)
    head: EagleHead = res.head("eagle", dtype)
    vocab = head.config.vocab_size
    ids = _shortlist(res, "eagle", draft_vocab, torch.arange(vocab, device=res.device), "the vocabulary's")
    if ids is None:
        return Eagle(head, res.readout(dtype), expansion, sampled=sampled, **batch_drafting(res, slots))
    return Eagle(
        head,
        res.readout(dtype, ids),
        expansion,
        target_ids=lambda drafted: ids[drafted],
        target_vocab=vocab,
        sampled=sampled,
        **batch_drafting(res, slots),
    )


def batch_drafting(res: Resources, slots: int) -> dict:
    """An Eagle's keywords for a batch of `slots`: on a static cache under --graphs (captured on a GPU, compiled
    with --compile), and always for a batch (whose slots draft together)."""
    return dict(slots=slots, static=res.graphs, capture=res.graphs, compile=res.graphs and res.compile)


def _draft_params(params: dict) -> dict:
    return {k: params.pop(k, None) for k in ("draft_dtype", "draft_vocab")}


@implementation("eagle", nested=tree_prefix("nodes", _static_paths), graphed=unless_sampled, batched=True)
def build_eagle(params: dict, res: Resources, slots: int) -> Drafter:
    sampled, draft = params.pop("sampled", False), _draft_params(params)
    listed = choices.first(choices.resolve(params.pop("tree", "eagle_mc_sim_7b_63")), params.pop("nodes", None))
    return _on_target_head(res, slots, StaticTree(listed, **params), sampled, **draft)


@implementation("eagle2", nested=DYNAMIC, graphed=unless_sampled, batched=True)
def build_eagle2(params: dict, res: Resources, slots: int) -> Drafter:
    sampled, draft = params.pop("sampled", False), _draft_params(params)
    return _on_target_head(res, slots, DynamicTree(**params), sampled, **draft)


@implementation("eagle3", nested=DYNAMIC, graphed=unless_sampled, batched=True)
def build_eagle3(params: dict, res: Resources, slots: int) -> Drafter:
    sampled, draft = params.pop("sampled", False), _draft_params(params)
    head: Eagle3Head = res.head("eagle3", res.draft_dtype(draft["draft_dtype"]))
    readable = head.target_ids(torch.arange(head.config.draft_vocab_size, device=res.device))
    keep = _shortlist(res, "eagle3", draft["draft_vocab"], readable, "the draft vocabulary's")
    if keep is not None:
        head.restrict(keep)
    text = res.target_model.config.get_text_config()
    return Eagle(
        head,
        head.logits,
        DynamicTree(**params),
        feature_layers=head.layer_ids or feature_layers(text.num_hidden_layers),
        target_ids=head.target_ids,
        target_vocab=text.vocab_size,
        sampled=sampled,
        **batch_drafting(res, slots),
    )
