"""How many of its drafted rows each slot verifies, from predicted acceptance and the target's step costs: DSpark's
hardware-aware prefix scheduler (arXiv 2607.05147, Algorithm 1), on this loop's cost model.

Every slot's candidate rows (slot r, row j) are taken in descending order of their survival a_{r,j} (the predicted
chance that rows 1..j are all accepted: non-increasing in j, so a slot's rows come in order; ties go to the earlier
row, then the earlier slot). Each is admitted while the batch's expected tokens per second grows: (one token per
slot plus the admitted survivals) over the cost of the verification forward. The first admission that does not grow
it stops the search (the paper's early stop): the decision to verify row j then depends only on rows drafted before
it, which keeps verification lossless.

The cost is this loop's: a batched forward pads every slot to the widest slot's rows, so it costs T(rows of the
widest) as profiled at the batch's size (`run.profiling.forward_profile`, the smallest profiled size holding them),
where the paper's engine costs the total tokens.

The asynchronous variant (the paper's section 5.2: there, so the scheduler never stalls the device) takes a capacity,
a count of rows, from the confidences of two steps before by a search over every count (no early stop), and admits
that many of this step's rows in the same order.
"""

from __future__ import annotations


def step_cost(costs: dict[int, float], rows: int) -> float:
    """The profiled seconds of a forward of `rows` rows a slot: the smallest profiled size holding them (the largest
    past them)."""
    return costs[min((n for n in costs if n >= rows), default=max(costs))]


def prefix_lengths(survival: list[list[float]], costs: dict[int, float]) -> list[int]:
    """Rows each slot verifies (0 up to len(survival[r])): the greedy admission above with its early stop."""
    best, rates = _rates(survival, costs)
    count = 0
    for rate in rates:
        if rate <= best:
            break
        best, count = rate, count + 1
    return top_lengths(survival, count)


def candidates(survival: list[list[float]]) -> list[tuple[float, int, int]]:
    """Every slot's rows (survival, row, slot) with a survival above 0, in admission order: descending survival,
    ties to the earlier row, then the earlier slot (a slot's rows in order, as their survivals never grow)."""
    found = [(a, j, r) for r, row in enumerate(survival) for j, a in enumerate(row) if a > 0]
    return sorted(found, key=lambda c: (-c[0], c[1], c[2]))


def _rates(survival: list[list[float]], costs: dict[int, float]) -> tuple[float, list[float]]:
    """The batch's expected tokens per second with no row admitted, and after each admission in order: (one token
    a slot plus the admitted survivals) over the forward's cost at the widest slot's rows."""
    expected, widest, rates = float(len(survival)), 0, []
    for a, j, _ in candidates(survival):
        expected, widest = expected + a, max(widest, j + 1)
        rates.append(expected / step_cost(costs, 1 + widest))
    return len(survival) / step_cost(costs, 1), rates


def capacity(survival: list[list[float]], costs: dict[int, float]) -> int:
    """The asynchronous schedule's capacity (the paper's section 5.2): how many rows, admitted in order, give the
    best expected rate, searched over every count (no early stop). It is computed from an earlier step's
    confidences, so a row's verification still depends on nothing drafted after it (`top_lengths`)."""
    best, rates = _rates(survival, costs)
    count = 0
    for n, rate in enumerate(rates, start=1):
        if rate > best:
            best, count = rate, n
    return count


def top_lengths(survival: list[list[float]], count: int) -> list[int]:
    """Rows each slot verifies when the first `count` rows in admission order (`candidates`) are: whether row j is
    among them depends only on the rows ranked before it, none of them drafted after it (lossless)."""
    lengths = [0] * len(survival)
    for _, j, r in candidates(survival)[:count]:
        lengths[r] = max(lengths[r], j + 1)
    return lengths
