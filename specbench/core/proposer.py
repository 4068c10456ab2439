"""The proposer interface: what every method implements to plug into the shared decode loop."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .acceptance import Accepted
from .cached_lm import SideBranch
from .choices import first
from .sampling import SparseLaws, inverse_cdf, probabilities
from .tree import EMPTY, DeviceTree, Tree, chain


@dataclass(frozen=True)
class Proposal:
    tree: Tree
    draft_probs: torch.Tensor | SparseLaws | None = None  # [n, V] (or sparse: over each row's candidates): the
    # distribution each node was drawn from; None = point masses
    side: SideBranch | None = None  # tokens verified alongside whose logits only the proposer reads
    drafted: int | None = None  # tokens drafted, when the tree verifies fewer (a schedule cut it); None: the tree's

    def pruned(self, max_depth: int, unread: bool = False) -> Proposal:
        """Drop nodes deeper than max_depth (drafting past the token budget is wasted work). A side branch is
        dropped with them: its mask refers to the full tree. `unread` (a verdict judged greedily in the forward): a
        tree whose tokens are still on the device is cut there (`DeviceTree.limited`) instead of read or indexed."""
        if len(self.tree) <= max_depth or self.tree.depth_bound() <= max_depth:  # (n nodes lie n deep at most)
            return self
        tree = self.tree
        if unread and isinstance(tree, DeviceTree) and tree.on_device and self.side is None:
            return Proposal(tree.limited(max_depth), self.draft_probs, drafted=self.drafted)
        keep = [i for i, d in enumerate(self.tree.depths()) if d <= max_depth]
        probs = self.draft_probs[keep] if self.draft_probs is not None else None
        return Proposal(self.tree.subtree(keep), probs, drafted=self.drafted)


NO_PROPOSAL = Proposal(EMPTY)


def chain_of_rows(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None, vocab: int | None = None
) -> Proposal:
    """A chain whose tokens a drafter guessed in parallel, one per row of logits [k, V']: the argmax at T = 0, else
    one draw per row at the temperature, verified against its row's law (zero past V', up to the target's `vocab`)."""
    if temperature == 0:
        return Proposal(chain(logits.argmax(-1)))
    q = probabilities(logits, temperature)
    drafted = inverse_cdf(q, torch.rand(len(q), generator=generator, device=q.device))  # on the device: no read
    if vocab is not None and q.shape[1] < vocab:
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
    return Proposal(chain(drafted), q)


@dataclass(frozen=True)
class Nested:
    """Knobs whose smaller values propose, at T = 0 and the same state, a subtree of what their largest values
    propose: one calibration run with the largest values scores every smaller setting (`specbench tune`)."""

    keys: tuple[str, ...]
    snapshot: Callable[[Any, int, Any], Any]  # (drafter, slot, its proposal) -> what `subtree` needs, taken right
    # after propose
    subtree: Callable[[Any, dict], Any]  # (snapshot, {key: smaller value}) -> the Tree those values would propose


def chain_prefix(key: str) -> Nested:
    """A chain drafted greedily token by token: a smaller `key` (its length) proposes the first `key` tokens."""
    return Nested(
        (key,),
        snapshot=lambda drafter, slot, proposal: proposal.tree,
        subtree=lambda tree, params: tree.subtree(list(range(min(params[key], len(tree))))),
    )


def tree_prefix(key: str, paths: Callable[[Any, int, Proposal], tuple[list[tuple], list[list[int]]]]) -> Nested:
    """A static tree of rank paths (Medusa, EAGLE-1): a smaller `key` keeps the tree's first `key` paths
    (`choices.first`), and at T = 0 proposes the nodes of the whole tree's proposal that lie on them. `paths` gives,
    right after a propose, each proposed node's path of ranks and the tree's paths in their listed order (from the
    drafter, the slot and its proposal)."""

    def subtree(snapshot: tuple[Tree, list[tuple], list[list[int]]], params: dict) -> Tree:
        tree, node_paths, listed = snapshot
        kept = {tuple(p) for p in first(listed, params[key])}
        return tree.subtree([i for i, p in enumerate(node_paths) if p in kept])

    return Nested((key,), snapshot=lambda drafter, slot, p: (p.tree, *paths(drafter, slot, p)), subtree=subtree)


@dataclass(frozen=True)
class Feedback:
    """What one verification tells the proposer."""

    accepted: Accepted
    features: torch.Tensor | None = None  # [1 + len(accepted.rows), F]: the root's and the accepted nodes' features
    side_logits: torch.Tensor | None = None  # [m, V]: the target's logits at the side-branch tokens
    side_picks: list[int] | None = None  # [m]: their argmax, when the verification read it (T = 0)


@dataclass(frozen=True)
class Turn:
    """What a proposer is told when a new turn begins."""

    prompt: list[int]
    temperature: float
    generator: torch.Generator | None = None
    features: torch.Tensor | None = None  # [len(prompt) - 1, F]: the prompt's target states, when feature_layers
    request: tuple[Hashable, int] | None = None  # (question, turn number): the same each time it is answered


class Proposer:
    """A method: proposes a token tree each step and learns what the target accepted.

    `tokens` passed to propose/update is the committed sequence (prompt and generated tokens); its last
    element is the root of the next verification, not yet in the target's cache. `max_depth` passed to propose
    is how many tokens past the root the token budget can still take: the loop prunes deeper nodes, so a
    method that drafts token by token stops there instead of wasting the work.
    """

    feature_layers: tuple[int, ...] | None = None  # target hidden states the method drafts from (CachedLM.run)

    def start(self, turn: Turn) -> None:
        """A new turn begins: a method with per-turn state (draft cache, pools) overrides this, calls
        super().start(turn) first, then resets its state."""
        self.temperature = turn.temperature
        self.generator = turn.generator

    def propose(self, tokens: list[int], max_depth: int) -> Proposal:
        return NO_PROPOSAL

    def update(self, tokens: list[int], proposal: Proposal, feedback: Feedback) -> None:
        """`tokens` now include the accepted path and the target's own token."""


class Drafter:
    """A method's drafting for a whole batch: one object for every slot of it (B = 1 a batch of one). Each step the
    loop asks it once for every active slot's proposal and tells it once what each accepted; the slots starting
    turns at one step are told together. A method drafting from the target's states names them in
    `feature_layers`."""

    feature_layers: tuple[int, ...] | None = None
    learns: bool = True  # whether `update` has anything to learn (the loop skips it otherwise)

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        """Each of `slots` begins its turn (the slots a step's refill hands new turns: together, so a drafter
        that prefills a cache of its own prefills them in one forward)."""

    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        """A proposal for each of `slots`, with its committed tokens and depth budget (as `Proposer.propose`)."""
        return [NO_PROPOSAL for _ in slots]

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        """What each of `slots` accepted: its tokens now, its proposal and the verification's feedback."""


class PerSlot(Drafter):
    """Proposers written for one sequence (a plug-in's, the host drafters'), one per slot, as a batch's Drafter:
    adapted once, here. Each slot's turn, proposal and update are its proposer's."""

    def __init__(self, proposers: list) -> None:
        self.proposers = proposers
        self.feature_layers = proposers[0].feature_layers
        self.learns = any(
            getattr(type(p), "update", None) is not Proposer.update or "update" in getattr(p, "__dict__", {})
            for p in proposers
        )

    def start(self, slots: list[int], turns: list[Turn]) -> None:
        for slot, turn in zip(slots, turns, strict=True):
            self.proposers[slot].start(turn)

    def propose(self, slots: list[int], tokens: list[list[int]], max_depths: list[int]) -> list[Proposal]:
        return [self.proposers[s].propose(t, d) for s, t, d in zip(slots, tokens, max_depths, strict=True)]

    def update(
        self, slots: list[int], tokens: list[list[int]], proposals: list[Proposal], feedback: list[Feedback]
    ) -> None:
        for slot, t, proposal, fed in zip(slots, tokens, proposals, feedback, strict=True):
            self.proposers[slot].update(t, proposal, fed)


def drafter(drafting: Drafter | Proposer | list) -> Drafter:
    """A Drafter as it is, or one-sequence proposers (one, or one per slot) adapted (`PerSlot`)."""
    if isinstance(drafting, Drafter):
        return drafting
    return PerSlot(drafting if isinstance(drafting, list) else [drafting])


__all__ = [
    "NO_PROPOSAL",
    "Drafter",
    "PerSlot",
    "drafter",
    "Feedback",
    "Nested",
    "Proposal",
    "Proposer",
    "Turn",
    "chain_of_rows",
    "chain_prefix",
    "tree_prefix",
]
