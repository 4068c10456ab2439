"""Published static trees in the "choices" format (paths of candidate ranks), by name."""

from __future__ import annotations

from ..errors import SpecbenchError

# Medusa's default (FasterDecoding/Medusa medusa_choices.py): 63 nodes, depth 4; rank = rank in the head's top-k.
MEDUSA_MC_SIM_7B_63 = [
    [0],
    [0, 0],
    [1],
    [0, 1],
    [2],
    [0, 0, 0],
    [1, 0],
    [0, 2],
    [3],
    [0, 3],
    [4],
    [0, 4],
    [2, 0],
    [0, 5],
    [0, 0, 1],
    [5],
    [0, 6],
    [6],
    [0, 7],
    [0, 1, 0],
    [1, 1],
    [7],
    [0, 8],
    [0, 0, 2],
    [3, 0],
    [0, 9],
    [8],
    [9],
    [1, 0, 0],
    [0, 2, 0],
    [1, 2],
    [0, 0, 3],
    [4, 0],
    [2, 1],
    [0, 0, 4],
    [0, 0, 5],
    [0, 0, 0, 0],
    [0, 1, 1],
    [0, 0, 6],
    [0, 3, 0],
    [5, 0],
    [1, 3],
    [0, 0, 7],
    [0, 0, 8],
    [0, 0, 9],
    [6, 0],
    [0, 4, 0],
    [1, 4],
    [7, 0],
    [0, 1, 2],
    [2, 0, 0],
    [3, 1],
    [2, 2],
    [8, 0],
    [0, 5, 0],
    [1, 5],
    [1, 0, 1],
    [0, 2, 1],
    [9, 0],
    [0, 6, 0],
    [0, 0, 0, 1],
    [1, 6],
    [0, 7, 0],
]

# EAGLE-1's static tree (SafeAILab/EAGLE v1 choices.py, also named mc_sim_7b_63): 25 nodes, depth 5;
# rank = rank among the parent's draft top-k.
EAGLE_MC_SIM_7B_63 = [
    [0],
    [1],
    [2],
    [3],
    [0, 0],
    [0, 1],
    [0, 2],
    [1, 0],
    [1, 1],
    [2, 0],
    [2, 1],
    [3, 0],
    [0, 0, 0],
    [0, 0, 1],
    [0, 0, 2],
    [0, 1, 0],
    [0, 1, 1],
    [0, 2, 0],
    [0, 2, 1],
    [1, 0, 0],
    [0, 0, 0, 0],
    [0, 0, 0, 1],
    [0, 0, 0, 2],
    [0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1],
]

NAMED = {"medusa_mc_sim_7b_63": MEDUSA_MC_SIM_7B_63, "eagle_mc_sim_7b_63": EAGLE_MC_SIM_7B_63}


def first(choices: list[list[int]], nodes: int | None) -> list[list[int]]:
    """The tree's first `nodes` paths in its listed order, a path counted only when its parent path is already
    kept (None: every path). Medusa lists its trees in the order it grew them, most likely node first, so these
    are its smaller trees; EAGLE-1's lists level by level, so these are its shallower ones."""
    if nodes is None:
        return choices
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise SpecbenchError(f"nodes must be a whole number >= 1 (paths kept from the tree), got {nodes!r}")
    kept: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for path in choices:
        if len(kept) == nodes:
            break
        if tuple(path) not in seen and (len(path) == 1 or tuple(path[:-1]) in seen):
            kept.append(path)
            seen.add(tuple(path))
    return kept


def resolve(choices: str | list[list[int]]) -> list[list[int]]:
    """A named tree, or a literal list of paths (from a preset or --params)."""
    if isinstance(choices, str):
        if choices not in NAMED:
            raise SpecbenchError(f"unknown tree '{choices}': use one of {', '.join(NAMED)} or a list of paths")
        return NAMED[choices]
    return choices
