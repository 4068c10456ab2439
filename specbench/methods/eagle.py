"""EAGLE-1, EAGLE-2 and EAGLE-3: a one-layer draft head autoregresses over the target's features and grows a
token tree level by level. One drafting loop serves all three; the head is pluggable (EAGLE-1/2: the target's
final state and lm_head; EAGLE-3: three fused target states, its own readout over a draft vocabulary whose ids
map to target ids) and an expansion policy decides which candidates become nodes, which nodes grow children,
and which nodes are sent to the target:

- StaticTree (EAGLE-1): the published tree of ranks; a node's children are its parent's top-ranked guesses.
- DynamicTree (EAGLE-2 and EAGLE-3): every grown node offers top_k children scored by cumulative draft
  log-probability; the top_k best of each level grow, and the best `total_tokens - 1` of all candidates are
  verified with the root: `total_tokens` counts the verified rows, root included, as the reference's total_token.

Candidates are the draft's deterministic top-k, so at T > 0 they go to verification as point masses
(draft_probs None): accept x with probability p(x), else zero p(x) and try the next sibling. That is lossless.

With `sampled` (T > 0 only), each grown node's children are instead drawn from the draft's distribution at
the run's temperature without replacement (`sampling.draw_distinct`), and each is verified against the law it
was drawn from (recursive rejection sampling: the shared exact rule with those rows as draft_probs), which
keeps far more acceptance when sampling. Exactness needs every node's place in the tree to be decided
without looking at its own token: siblings are tested in draw order, a node's children may depend on its
score, but EAGLE-2's final pick of the best-scoring nodes would bias the draws, so a sampled dynamic tree
keeps the first `total_tokens - 1` candidates in the order they were drawn (level by level) instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .. import choices
from ..heads.eagle import EagleHead
from ..heads.eagle3 import Eagle3Head, feature_layers
from ..registry import implementation
from ..sampling import draw_distinct, probabilities
from ..tree import Tree, additive_mask
from .base import NO_PROPOSAL, Feedback, Proposal, Proposer, Turn
from .resources import Resources


@dataclass
class Candidates:
    """Drafted tokens in creation order (parents first); parent -1 is the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability
    ranks: list[tuple[int, ...]] = field(default_factory=list)  # rank of each node on the path from the root
    laws: list[torch.Tensor] = field(default_factory=list)  # when sampled: the law each token was drawn from [V]

    def path(self, parent: int, rank: int) -> tuple[int, ...]:
        """The ranks from the root to the `rank`-th child of `parent`."""
        return (*(self.ranks[parent] if parent >= 0 else ()), rank)

    def add(self, token: int, parent: int, logp: float, rank: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append((self.scores[parent] if parent >= 0 else 0.0) + logp)
        self.ranks.append(self.path(parent, rank))
        return len(self.tokens) - 1

    def ancestors(self, node: int) -> set[int]:
        out = set()
        while (node := self.parents[node]) >= 0:
            out.add(node)
        return out


def best(nodes: list[int], scores: list[float], k: int) -> list[int]:
    """The k highest-scoring nodes, ties to the earlier one (a parent before its child), in ascending order."""
    return sorted(sorted(nodes, key=lambda i: (-scores[i], i))[:k])


class StaticTree:
    def __init__(self, choices: list[list[int]]) -> None:
        self.paths = {tuple(p) for p in choices}
        self.branch = 1 + max(r for p in self.paths for r in p)
        self.max_depth = max(len(p) for p in self.paths)
        self.inner = {p[:-1] for p in self.paths}

    def admits(self, ranks: tuple[int, ...]) -> bool:
        return ranks in self.paths

    def grow(self, level: list[int], found: Candidates) -> list[int]:
        return [i for i in level if found.ranks[i] in self.inner]

    def select(self, found: Candidates) -> list[int]:
        return list(range(len(found.tokens)))


class DynamicTree:
    def __init__(self, total_tokens: int, depth: int, top_k: int) -> None:
        if total_tokens < 2 or depth < 0 or top_k < 1:
            raise ValueError("a dynamic tree needs total_tokens >= 2 (the root and a draft), depth >= 0, top_k >= 1")
        self.drafts = total_tokens - 1  # total_tokens counts the root, as EAGLE's total_token does
        self.branch = top_k
        self.max_depth = depth + 1  # EAGLE's `depth` counts the expansions after the first level

    def admits(self, ranks: tuple[int, ...]) -> bool:
        return True

    def grow(self, level: list[int], found: Candidates) -> list[int]:
        return best(level, found.scores, self.branch)

    def select(self, found: Candidates) -> list[int]:
        if found.laws:  # sampled: which nodes are verified must not depend on their own draws
            return list(range(min(self.drafts, len(found.tokens))))
        return best(list(range(len(found.tokens))), found.scores, self.drafts)


class Eagle(Proposer):

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        lm_head: Callable[[torch.Tensor], torch.Tensor],  # head output [n, H] -> draft-vocabulary logits [n, V']
        expansion: StaticTree | DynamicTree,
        *,
        feature_layers: tuple[int, ...] = (-1,),  # the target states the head reads (CachedLM.run's `layers`)
        target_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,  # draft ids -> target ids; None: equal
        target_vocab: int | None = None,  # the target's vocabulary size when the draft's differs
        sampled: bool = False,  # at T > 0, draw children from the draft without replacement (module docstring)
    ) -> None:
        self.head = head
        self.lm_head = lm_head
        self.expansion = expansion
        self.feature_layers = feature_layers
        self.target_ids = target_ids
        self.target_vocab = target_vocab
        self.sampled = sampled
        self.device = head.fc.weight.device

    def start(self, turn: Turn) -> None:
        super().start(turn)
        self.sampling = self.sampled and turn.temperature > 0
        self.cache = DynamicCache(config=self.head.config)  # pairs of committed tokens only
        self.pending = turn.features if turn.features is not None else torch.empty(0, self.head.feature_size)
        self.root: torch.Tensor | None = None  # [H]: the head's output at the root's position
        self._extend(turn.prompt)

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        self.pending = torch.cat([self.pending.to(feedback.features), feedback.features])
        self._extend(tokens)

    @torch.inference_mode()
    def _extend(self, tokens: list[int]) -> None:
        """Feed the committed pairs (feature of token i, token i + 1) the draft cache lacks."""
        past = self.cache.get_seq_length()
        n = min(len(self.pending), len(tokens) - 1 - past)
        if n <= 0:
            return
        ids = torch.tensor([tokens[past + 1 : past + 1 + n]], device=self.device)
        positions = torch.arange(past, past + n, device=self.device)[None]
        allowed = torch.ones(n, past + n, dtype=torch.bool).tril(past)  # causal over the cache and the new rows
        mask = additive_mask(allowed, self.head.fc.weight.dtype, self.device)
        out = self.head(self.pending[None, :n], ids, positions, mask, self.cache)[0]  # [n, H]
        self.pending = self.pending[n:]
        self.root = out[-1] if past + n == len(tokens) - 1 else None

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        depths = min(self.expansion.max_depth, max_depth)
        if self.root is None or depths < 1:
            return NO_PROPOSAL
        past = self.cache.get_seq_length()
        found = Candidates()
        hidden = {-1: self.root}  # node -> the head's output at its position
        frontier, fed = [-1], []
        for depth in range(1, depths + 1):
            logits = self.lm_head(torch.stack([hidden[f] for f in frontier]))  # [F, V']
            level = []
            for parent, (toks, logps, laws) in zip(frontier, self._children(logits), strict=True):
                for rank, (logp, token) in enumerate(zip(logps, toks, strict=True)):
                    if self.expansion.admits(found.path(parent, rank)):
                        level.append(found.add(token, parent, logp, rank))
                        if laws is not None:
                            found.laws.append(laws[rank])
            frontier = self.expansion.grow(level, found) if depth < depths else []
            if not frontier:
                break
            hidden.update(zip(frontier, self._feed(frontier, found, hidden, fed, past + depth - 1), strict=True))
            fed += frontier
        if fed:  # tree keys are discarded, the committed prefix stays (transformers 5 crops by minus the count)
            self.cache.crop(-len(fed))
        keep = self.expansion.select(found)
        tree = Tree(found.tokens, found.parents).subtree(keep)
        return Proposal(tree, torch.stack([found.laws[i] for i in keep]) if found.laws else None)

    def _children(self, logits: torch.Tensor) -> list[tuple[list[int], list[float], torch.Tensor | None]]:
        """Per parent row of logits [F, V']: its candidate children as target ids, their draft log-probabilities
        and, when sampling, the law each was drawn from over the target vocabulary ([k, V])."""
        k = min(self.expansion.branch, logits.shape[-1])
        if not self.sampling:
            top = torch.log_softmax(logits.float(), dim=-1).topk(k)
            ids = top.indices if self.target_ids is None else self.target_ids(top.indices)  # [F, k]
            return [(row, logps, None) for row, logps in zip(ids.tolist(), top.values.tolist(), strict=True)]
        draft_ids = torch.arange(logits.shape[-1], device=logits.device)
        to_target = draft_ids if self.target_ids is None else self.target_ids(draft_ids)  # [V']
        q = probabilities(logits, self.temperature)  # [F, V']
        out = []
        for row, drawn, laws in zip(q, *draw_distinct(q, k, self.generator), strict=True):
            if self.target_ids is not None:  # laws move onto the target vocabulary
                full = laws.new_zeros(len(drawn), self.target_vocab)
                full[:, to_target] = laws
                laws = full
            out.append((to_target[drawn].tolist(), torch.log(row[drawn]).tolist(), laws))
        return out

    def _feed(self, nodes: list[int], found: Candidates, hidden: dict, fed: list[int], position: int) -> torch.Tensor:
        """One draft forward over a level's growing nodes; each sees the committed prefix, its fed ancestors
        and itself. Returns the head's outputs [len(nodes), H]."""
        past = self.cache.get_seq_length()
        allowed = torch.zeros(len(nodes), past + len(nodes), dtype=torch.bool)
        allowed[:, : past - len(fed)] = True
        for row, node in enumerate(nodes):
            above = found.ancestors(node)
            allowed[row, past - len(fed) : past] = torch.tensor([j in above for j in fed], dtype=torch.bool)
            allowed[row, past + row] = True
        features = torch.stack([hidden[found.parents[n]] for n in nodes])[None]  # [1, n, H]: the parents' outputs
        ids = torch.tensor([[found.tokens[n] for n in nodes]], device=self.device)
        positions = torch.full((1, len(nodes)), position, device=self.device)
        mask = additive_mask(allowed, self.head.fc.weight.dtype, self.device)
        return self.head(features, ids, positions, mask, self.cache)[0]


@implementation("eagle", color="#2ca02c")
def build_eagle(params: dict, res: Resources) -> Proposer:
    sampled = params.pop("sampled", False)
    tree = StaticTree(choices.resolve(params.pop("tree", "eagle_mc_sim_7b_63")), **params)
    return Eagle(res.head("eagle"), res.target_model.get_output_embeddings(), tree, sampled=sampled)


@implementation("eagle2", color="#d62728")
def build_eagle2(params: dict, res: Resources) -> Proposer:
    sampled = params.pop("sampled", False)
    return Eagle(res.head("eagle"), res.target_model.get_output_embeddings(), DynamicTree(**params), sampled=sampled)


@implementation("eagle3", color="#9467bd")
def build_eagle3(params: dict, res: Resources) -> Proposer:
    sampled = params.pop("sampled", False)
    head = res.head("eagle3")
    text = res.target_model.config.get_text_config()
    return Eagle(
        head,
        head.logits,
        DynamicTree(**params),
        feature_layers=feature_layers(text.num_hidden_layers),
        target_ids=head.target_ids,
        target_vocab=text.vocab_size,
        sampled=sampled,
    )
