"""Acceptance rules: which drafted tokens the target keeps, and the token it adds itself. Pure functions.

Each rule takes the proposal's tree and the target's rows for the verification input ([root] + nodes)
and returns the accepted root-to-node path plus the target's own next token (bonus or correction).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import SpecbenchError
from .sampling import SparseLaws, dense, inverse_cdf, probabilities, sample, uniform
from .synthetic import Profile
from .tree import Tree, ancestors_from


@dataclass(frozen=True)
class Accepted:
    rows: list[int]  # input rows of the accepted draft nodes, in path order (root excluded)
    token: int  # the target's own token after the accepted path
    tested: int  # draft depth examined along the path: len(rows), plus 1 if a drafted child was rejected


def greedy(tree: Tree, best: list[int], limit: int | None = None) -> Accepted:
    """Longest path whose every token is the target's argmax at its parent. best: [n+1] the argmax of each input
    row ([root] + nodes). `limit`: nodes deeper are not in the tree (`DeviceTree.limited`)."""
    children = tree.children()
    rows: list[int] = []
    row = 0
    while True:
        kids = children[row] if limit is None or len(rows) < limit else []
        match = next((c for c in kids if tree.tokens[c - 1] == best[row]), None)
        if match is None:
            return Accepted(rows, best[row], len(rows) + (1 if kids else 0))
        rows.append(match)
        row = match


def forced(tree: Tree, best: list[int], profile: Profile, draw: random.Random) -> Accepted:
    """A cost-only verdict (`run --acceptance synthetic:...`): down the tree, at each node its child with the deepest
    subtree (the first such in the tree's order: a chain's next node), the drafted token at depth d is accepted with
    probability `profile.rate(d)` given all before it were, stopping at the first rejection; the target's own token
    is its pick (`best`, the argmax of each input row) after the last accepted node, so the sequence grows as a real
    step's would. The deepest branch is taken so that a path can reach every depth the tree drafted (a first child
    that ends early would cap the acceptance below the profile's). Only the verdict's length is the profile's: the
    tokens are not the target's."""
    children = tree.children()
    height = [0] * (len(tree) + 1)  # per input row: the depth of its subtree below it
    for row in range(len(tree), 0, -1):  # (parents precede children)
        parent = tree.parents[row - 1] + 1
        height[parent] = max(height[parent], height[row] + 1)
    rows: list[int] = []
    row = 0
    while children[row]:
        if draw.random() >= profile.rate(len(rows) + 1):
            return Accepted(rows, best[row], len(rows) + 1)
        row = max(children[row], key=height.__getitem__)
        rows.append(row)
    return Accepted(rows, best[row], len(rows))


@dataclass(frozen=True)
class Verdicts:
    """Every slot's greedy verdict from one batched verification, on the device (`greedy_batch`)."""

    length: torch.Tensor  # [B]: draft tokens accepted
    tested: torch.Tensor  # [B]: `Accepted.tested`
    kept: torch.Tensor  # [B, b]: input rows kept, the root then the accepted path (past length + 1: padding)
    new: torch.Tensor  # [B, b]: tokens appended, the accepted ones then the target's own (past length + 1: padding)


def greedy_batch(
    ids: torch.Tensor,
    seen: torch.Tensor,
    depth: torch.Tensor,
    nodes: torch.Tensor,
    picks: torch.Tensor,
    limit: torch.Tensor | None = None,
) -> Verdicts:
    """`greedy` for a batch's slots at once, in tensor operations (no host read). Each slot's input rows are ids
    [B, b] ([root] + its tree's `nodes` [B] nodes, then side-branch or padding rows, ignored); `seen` [B, b, b] marks
    each tree row's ancestors and itself (other entries of ignored rows may hold anything), `depth` [B, b] its depth
    (the root's 0) and `picks` [B, b] the target's argmax at each row; `limit` [B]: nodes deeper are ignored too
    (`greedy`'s). As `greedy`, a node matches when its token is its parent's pick and no earlier sibling matched;
    the accepted path is the deepest whose nodes all match."""
    b = ids.shape[1]
    row = torch.arange(b, device=ids.device)
    real = row <= nodes[:, None]
    if limit is not None:
        real = real & (depth <= limit[:, None])
    shape = _Shape.of(seen, depth, real)
    match = shape.real & (row >= 1) & (ids == picks.gather(1, shape.parent))
    best, length, on_path, child = shape.walk(match)
    kept = torch.where(on_path, row, b - 1).sort(dim=-1).values  # ancestors come before their descendants
    # the path's tokens are its rows' parents' picks: every kept row's pick, in order, is what is appended
    return Verdicts(length, length + child.long(), kept, picks.gather(1, kept))


@dataclass(frozen=True)
class _Shape:
    """A batch of trees over input rows [B, b] (row 0 the root): which rows are real, each one's ancestors and
    itself, parent row, depth, and earlier siblings."""

    real: torch.Tensor  # [B, b]
    anc: torch.Tensor  # [B, b, b]: (i, j) j is i or an ancestor of i
    parent: torch.Tensor  # [B, b]: the parent's row (the root's: 0)
    depth: torch.Tensor  # [B, b]
    earlier: torch.Tensor  # [B, b, b]: (i, j) j is a real sibling of i before it

    @staticmethod
    def of(seen: torch.Tensor, depth: torch.Tensor, real: torch.Tensor) -> _Shape:
        row = torch.arange(real.shape[1], device=real.device)
        anc = seen & real[:, None, :] & real[:, :, None]
        strict = anc & (row[:, None] != row[None, :])
        parent = torch.where(strict, depth[:, None, :] + 1, 0).argmax(-1)  # the deepest strict ancestor
        siblings = (parent[:, :, None] == parent[:, None, :]) & (row[None, :] < row[:, None]) & (row >= 1)
        return _Shape(real, anc, parent, depth, siblings & real[:, None, :])

    @staticmethod
    def of_trees(
        tokens: torch.Tensor, parents: torch.Tensor, counts: torch.Tensor, depth: int
    ) -> tuple[_Shape, torch.Tensor]:
        """The shape of trees given as tokens and parents [B, n] (counts[b] real nodes, none deeper than `depth`),
        and each input row's token [B, n + 1] (the root's unused)."""
        batch, n = tokens.shape
        real = torch.arange(n + 1, device=tokens.device) < (counts + 1)[:, None]  # the root and the nodes
        anc = ancestors_from(torch.where(real[:, 1:], parents, -1), max(depth, 1))  # [B, n + 1, n + 1]
        ids = torch.cat([tokens.new_zeros(batch, 1), tokens], 1)
        return _Shape.of(anc, anc.sum(-1) - 1, real), ids

    def walk(self, match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The path of first-matching children from the root (a node is taken when it matches and no earlier
        sibling does): its deepest row [B, 1], length [B], rows on it [B, b], and whether that row has children."""
        b = match.shape[1]
        row = torch.arange(b, device=match.device)
        first = match & ~(self.earlier & match[:, None, :]).any(-1)
        good = first | (row == 0)
        ok = self.real & ~(self.anc & ~good[:, None, :]).any(-1)  # every node on the row's path is taken
        best = torch.where(ok, self.depth + 1, 0).argmax(-1, keepdim=True)  # its deepest row (the root if none)
        length = self.depth.gather(1, best).squeeze(1)
        on_path = self.anc.gather(1, best[:, :, None].expand(-1, 1, b)).squeeze(1)  # [B, b]
        child = (self.real & (row >= 1) & (self.parent == best)).any(-1)
        return best, length, on_path, child


def speculative_sampling(
    tree: Tree,
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Accepted:
    """Lossless rejection sampling over a tree (Leviathan et al. for chains, SpecInfer for siblings).

    probs: [n+1, V] target distributions per input row. draft_probs: [n, V], row i the distribution node i
    was drawn from; None means every node is a point-mass (deterministic) proposal, as for n-gram drafts.
    At each node the children are tried in order: child x is accepted with probability min(1, p(x)/q(x));
    on rejection p becomes norm(max(0, p - q)). If no child is accepted the token is drawn from the final p;
    past the last accepted node with no children it is drawn from that node's p (the bonus token).
    """
    children = tree.children()
    rows: list[int] = []
    row = 0
    while True:
        p = probs[row]
        for child in children[row]:
            x = tree.tokens[child - 1]
            q = None if draft_probs is None else draft_probs[child - 1]
            px, qx = float(p[x]), 1.0 if q is None else float(q[x])
            if qx > 0 and uniform(generator, p.device) * qx < px:
                rows.append(child)
                row = child
                break
            if q is None:  # a point mass: the residual is p without x (no one-hot of the vocabulary built)
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(p - q, min=0.0)
            total = float(residual.sum())
            p = residual / total if total > 0 else p
        else:
            return Accepted(rows, sample(p, generator), len(rows) + (1 if children[row] else 0))


@dataclass(frozen=True)
class ChainVerdicts:
    """Every chain's verdict from `exact_chains`, on the device: what `Accepted` holds for a chain."""

    length: torch.Tensor  # [B]: draft tokens accepted
    token: torch.Tensor  # [B]: the target's own token after them
    tested: torch.Tensor  # [B]: `Accepted.tested`


def exact_chains(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | SparseLaws | None,
    lengths: torch.Tensor,
    draws: torch.Tensor,
) -> ChainVerdicts:
    """`speculative_sampling` for a batch of chains at once, in tensor operations (no host read). Chain b drafted
    tokens [B, k] (its first lengths[b] real), each drawn from its row of draft_probs [B, k, V] (a one-hot row: a
    point mass; sparse: ids and probs [B, k, K], each row's law over its K candidates; None: every token a point
    mass; the last two build no [B, k, V] laws); probs [B, k + 1, V] are the target's distributions at [root] +
    nodes. draws [B, k + 1] are
    uniforms in [0, 1): position j's acceptance test uses draws[b, j], the target's own token draws[b, lengths[b]]
    (each chain's draws its own: `lengths[b] + 1` of them), by the inverse of its distribution's cumulative sum.
    Token j is kept when every one before it was and draws[b, j] * q(x) < p(x); at the first rejection the token is
    drawn from norm(max(0, p - q)) (p where that is all zero), after the whole chain from its last row (the bonus)."""
    batch, k = tokens.shape
    at = torch.arange(batch, device=tokens.device)
    px = probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)  # [B, k]
    if draft_probs is None:
        qx = torch.ones_like(px)
    elif isinstance(draft_probs, SparseLaws):  # each token's mass among its row's candidates
        qx = (draft_probs.probs * (draft_probs.ids == tokens[..., None])).sum(-1).to(px)
    else:
        qx = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
    real = torch.arange(k, device=tokens.device) < lengths[:, None]
    ok = real & (qx > 0) & (draws[:, :k] * qx < px)
    length = ok.long().cumprod(-1).sum(-1)  # [B]: the accepted prefix
    rejected = length < lengths  # the chain stopped at a drafted token (else every one was kept: the bonus)
    p = probs[at, length]  # [B, V]
    stop = length.clamp(max=max(k - 1, 0))  # the rejected token's position
    if not k:
        q = torch.zeros_like(p)
    elif draft_probs is None:  # the rejected tokens' point masses, one row a chain
        q = torch.nn.functional.one_hot(tokens[at, stop], p.shape[-1]).to(p.dtype)
    elif isinstance(draft_probs, SparseLaws):  # the rejected rows' laws, one row a chain
        q = draft_probs[at, stop].dense(p.shape[-1]).to(p.dtype)
    else:
        q = draft_probs[at, stop]
    residual = (p - q * rejected[:, None]).clamp_min(0)
    law = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    token = inverse_cdf(law, draws.gather(1, lengths[:, None]).squeeze(1))
    return ChainVerdicts(length, token, length + rejected.long())


@dataclass(frozen=True)
class TreeVerdicts:
    """Every tree's verdict from `exact_trees`, on the device: `ChainVerdicts`' and the accepted path's rows."""

    length: torch.Tensor  # [B]: draft tokens accepted
    token: torch.Tensor  # [B]: the target's own token after them
    tested: torch.Tensor  # [B]: `Accepted.tested`
    path: torch.Tensor  # [B, d]: the accepted nodes' input rows in path order (past length: 0)


def exact_trees(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    parents: torch.Tensor,
    counts: torch.Tensor,
    draws: torch.Tensor,
    depth: int,
) -> TreeVerdicts:
    """`speculative_sampling` for a batch of trees at once, in tensor operations (no host read). Tree b has counts[b]
    nodes: tokens [B, n] drawn from their rows of draft_probs [B, n, V] (None: every node a point mass), parents
    [B, n] (-1: the root's child; parents precede children; past counts[b]: anything), none deeper than `depth`;
    probs [B, n + 1, V] are the target's laws at [root] + nodes. Node i's test uses draws[b, i], the target's own
    token draws[b, counts[b]] (each tree's draws its own: counts[b] + 1 of them; a chain's are `exact_chains'` and so
    is its verdict). A node is tested when the walk stands on its parent and no earlier sibling was kept.

    Point masses: a node's test depends only on its earlier siblings (all rejected when it is tested: the residual
    is p without their tokens), so every node's verdict-if-tested is computed at once and the walk is greedy's
    (`_Shape.walk`). Drawn nodes: the nodes are visited in order, each residual after the one before; as the walk
    only descends and a node's children come after it, that is `speculative_sampling`'s order too."""
    batch, n = tokens.shape
    device = tokens.device
    row = torch.arange(n + 1, device=device)
    shape, ids = _Shape.of_trees(tokens, parents, counts, depth)
    real = shape.real
    if draft_probs is None:
        vocab = probs.shape[-1]
        p = probs.flatten(1).gather(1, shape.parent * vocab + ids)  # [B, n + 1]: p(x) at the parent's row
        removed = (shape.earlier & (ids[:, :, None] != ids[:, None, :])).float() @ p[..., None]  # earlier siblings'
        repeated = (shape.earlier & (ids[:, :, None] == ids[:, None, :])).any(-1)  # (a token tried already: p 0)
        u = torch.cat([draws.new_ones(batch, 1), draws[:, :n]], 1)  # node i's draw at row i + 1
        match = shape.real & (row >= 1) & ~repeated & (u * (1 - removed.squeeze(-1)).clamp_min(0) < p)
        best, length, on_path, child = shape.walk(match)
        law = probs.gather(1, best[:, :, None].expand(-1, 1, vocab)).squeeze(1)  # [B, V]: the last row's
        rejected = shape.real & (row >= 1) & (shape.parent == best)  # its children, every one rejected
        gone = torch.zeros_like(law).scatter_add_(1, ids, rejected.float()) > 0
        residual = law.masked_fill(gone, 0)
        law = torch.where(residual.sum(-1, keepdim=True) > 0, residual, law)
        token = inverse_cdf(law, draws.gather(1, counts[:, None]).squeeze(1))
        return TreeVerdicts(length, token, length + child.long(), _path(on_path, depth))
    at = torch.arange(batch, device=device)
    stand = torch.zeros(batch, dtype=torch.long, device=device)  # the input row the walk stands on
    length = torch.zeros_like(stand)
    path = torch.zeros(batch, max(depth, 1), dtype=torch.long, device=device)
    p = probs[:, 0].clone()  # [B, V]: the law left at the row (its residual after rejected children)
    for i in range(n):
        x = tokens[:, i]
        q = draft_probs[:, i]
        tested = (i < counts) & (parents[:, i] + 1 == stand)
        px, qx = p.gather(1, x[:, None]).squeeze(1), q.gather(1, x[:, None]).squeeze(1)
        accept = tested & (qx > 0) & (draws[:, i] * qx < px)
        reject = tested & ~accept
        residual = (p - q).clamp_min(0)
        total = residual.sum(-1, keepdim=True)
        rejected = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
        p = torch.where(accept[:, None], probs[:, i + 1], torch.where(reject[:, None], rejected, p))
        place = length.clamp(max=path.shape[1] - 1)
        path[at, place] = torch.where(accept, i + 1, path[at, place])
        length = length + accept.long()
        stand = torch.where(accept, i + 1, stand)
    has_children = (real[:, 1:] & (parents + 1 == stand[:, None])).any(-1)
    token = inverse_cdf(p, draws.gather(1, counts[:, None]).squeeze(1))
    return TreeVerdicts(length, token, length + has_children.long(), path)


def typical(
    tree: Tree,
    probs: torch.Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Medusa's typical acceptance (lossy: it does not preserve the target's distribution).

    Node x under row r is acceptable when p_r(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_r))).
    The deepest path of acceptable nodes wins, ties going to the larger sum of log p along the path; the
    target's own token is then sampled from the distribution at the path's end. probs: [n+1, V].
    """
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)  # [n+1]
    bar = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold).tolist()
    depth = [0] * (len(tree) + 1)  # per input row, 0 when the row is not on an acceptable path
    score = [0.0] * (len(tree) + 1)
    best = 0
    for i, (x, p) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        row, parent = i + 1, p + 1
        px = float(probs[parent, x])
        if px > bar[parent] and (parent == 0 or depth[parent]):
            depth[row] = depth[parent] + 1
            score[row] = score[parent] + math.log(px)
            if (depth[row], score[row]) > (depth[best], score[best]):
                best = row
    rows = tree.path(best)
    return Accepted(rows, sample(probs[best], generator), len(rows) + (1 if tree.children()[best] else 0))


def typical_trees(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    parents: torch.Tensor,
    counts: torch.Tensor,
    draws: torch.Tensor,
    depth: int,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> TreeVerdicts:
    """`typical` for a batch of trees at once (`exact_trees`' arguments; draft_probs unused: point masses by
    nature): every node's acceptability at once, the deepest path of acceptable nodes (ties to the larger sum of
    log p along it, then the earlier row), and the target's token from the law at its end by the tree's last draw,
    draws[b, counts[b]]."""
    shape, ids = _Shape.of_trees(tokens, parents, counts, depth)
    vocab, n = probs.shape[-1], tokens.shape[1]
    row = torch.arange(n + 1, device=tokens.device)
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)  # [B, n + 1]
    bar = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    p = probs.flatten(1).gather(1, shape.parent * vocab + ids)  # [B, n + 1]: p(x) at the parent's row
    good = (shape.real & (row >= 1) & (p > bar.gather(1, shape.parent))) | (row == 0)
    ok = shape.real & ~(shape.anc & ~good[:, None, :]).any(-1)  # every node from the root to the row acceptable
    score = (shape.anc.float() @ torch.where(row >= 1, torch.log(p.clamp_min(1e-30)), 0)[..., None]).squeeze(-1)
    deepest = torch.where(ok, shape.depth, -1).amax(-1, keepdim=True)
    best = torch.where(ok & (shape.depth == deepest), score, -torch.inf).argmax(-1, keepdim=True)  # [B, 1]
    length = shape.depth.gather(1, best).squeeze(1)
    on_path = shape.anc.gather(1, best[:, :, None].expand(-1, 1, n + 1)).squeeze(1)
    law = probs.gather(1, best[:, :, None].expand(-1, 1, vocab)).squeeze(1)
    token = inverse_cdf(law, draws.gather(1, counts[:, None]).squeeze(1))
    child = (shape.real & (row >= 1) & (shape.parent == best)).any(-1)
    return TreeVerdicts(length, token, length + child.long(), _path(on_path, depth))


def _path(on_path: torch.Tensor, depth: int) -> torch.Tensor:
    """The rows [B, depth] of the nodes marked on a path [B, n + 1] (the root's mark ignored), in path order (a
    parent's row before its child's), then 0."""
    n = on_path.shape[1] - 1
    row = torch.arange(n + 1, device=on_path.device)
    path = torch.where(on_path & (row >= 1), row, n + 1).sort(-1).values[:, : max(depth, 1)]
    return torch.where(path > n, 0, path)


@dataclass(frozen=True)
class Rule:
    """An acceptance rule as the decode loop applies it at T > 0 (at T = 0 every rule is `greedy`: `greedy_batch`
    inside the target's forward). A method's preset names it (`acceptance:`); the registry resolves it once and
    hands it to the loop, which decides a batch's chains and trees at once where the rule has batch forms (`chains`,
    `trees`)."""

    name: str
    lossless: bool
    sampled: Callable[..., Accepted]  # (tree, probs [n+1, V], draft_probs [n, V] | None, generator, **params)
    params: dict = field(default_factory=dict)
    chains: Callable[..., ChainVerdicts] | None = None  # the rule for a batch of chains at once (`exact_chains`)
    trees: Callable[..., TreeVerdicts] | None = None  # and for a batch of trees (`exact_trees`, `typical_trees`),
    # called with `params`

    def __call__(
        self,
        tree: Tree,
        logits: torch.Tensor,  # [n+1, V]: the target's rows for [root] + nodes
        draft_probs: torch.Tensor | SparseLaws | None,
        temperature: float,  # > 0
        generator: torch.Generator | None,
    ) -> Accepted:
        laws = dense(draft_probs, logits.shape[-1])
        return self.sampled(tree, probabilities(logits, temperature), laws, generator, **self.params)


def _typical(tree: Tree, probs: torch.Tensor, draft_probs, generator, **params) -> Accepted:
    return typical(tree, probs, **params, generator=generator)  # point masses by nature: draft_probs unused


RULES = {
    "exact": Rule("exact", True, speculative_sampling, chains=exact_chains, trees=exact_trees),
    "typical": Rule(
        "typical", False, _typical, {"posterior_threshold": 0.09, "posterior_alpha": 0.3}, trees=typical_trees
    ),
}
EXACT = RULES["exact"]


def rule(spec: str | dict | None) -> Rule:
    """A preset's `acceptance:` value: a rule name (default exact), or {rule: NAME, param: value, ...}."""
    spec = {"rule": spec or "exact"} if not isinstance(spec, dict) else dict(spec)
    name = spec.pop("rule", "exact")
    if name not in RULES:
        raise SpecbenchError(f"unknown acceptance rule '{name}': use one of {', '.join(RULES)}")
    base = RULES[name]
    unknown = sorted(set(spec) - set(base.params))
    if unknown:
        raise SpecbenchError(f"acceptance rule '{name}' has no parameter '{unknown[0]}'")
    return Rule(base.name, base.lossless, base.sampled, {**base.params, **spec}, base.chains, base.trees)
