"""Sequential Temperature Scaling (STS; DSpark, arXiv 2607.05147, section 3.2.1): a confidence head's predicted
acceptance made to match how often the rows were accepted, so that the running products a schedule weighs (the
chance that rows 1..k are all accepted) are right in size, not only in order.

Row k's confidence is sigmoid(z_k / T_k) of its logit z_k. Left to right, T_k is the value of a grid whose
survivals a_k = prod_{i <= k} sigmoid(z_i / T_i) have the least expected calibration error (ECE) against whether
rows 1..k were all accepted, the temperatures of the rows before it held fixed (the paper's 1-D grid search per
position). A positive temperature keeps the order of each row's confidences."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BINS = 10  # equal-width bins of the ECE (Naeini et al., 2015)
GRID = tuple(round(math.exp((i - 60) * math.log(50) / 60), 6) for i in range(121))  # 1/50 .. 50, 1.0 among them


def ece(predicted: torch.Tensor, observed: torch.Tensor, bins: int = BINS) -> float:
    """The expected calibration error of probabilities `predicted` [N] against outcomes `observed` [N] (0 or 1):
    the samples put in `bins` equal-width bins of their prediction (1.0 in the last), each bin's gap |mean
    predicted - observed rate| weighted by its share of the samples. 0 without samples."""
    if predicted.numel() == 0:
        return 0.0
    index = (predicted * bins).long().clamp(0, bins - 1)
    gaps = torch.bincount(index, weights=(predicted - observed).double(), minlength=bins)  # per bin: sum of p - y
    return float(gaps.abs().sum() / predicted.numel())


def survival(logits: torch.Tensor, temperatures: Sequence[float] | None = None) -> torch.Tensor:
    """The running products of the rows' confidences [N, k] from their logits [N, k], each row's divided by its
    temperature first (a row past the calibrated ones takes the last's; none: every temperature 1)."""
    return torch.sigmoid(scaled(logits, temperatures)).cumprod(-1)


def scaled(logits: torch.Tensor, temperatures: Sequence[float] | None) -> torch.Tensor:
    """Logits [..., k] each divided by its row's temperature (`survival`)."""
    if not temperatures:
        return logits
    k = logits.shape[-1]
    rows = [temperatures[min(j, len(temperatures) - 1)] for j in range(k)]
    return logits / torch.tensor(rows, dtype=logits.dtype, device=logits.device)


@dataclass(frozen=True)
class Calibration:
    """STS's result per row: its temperature, the samples that drafted it, and the ECE of the survivals through
    it before (every temperature 1) and after."""

    temperatures: list[float]
    samples: list[int]
    ece_before: list[float]
    ece_after: list[float]


def sts(
    logits: torch.Tensor, accepted: torch.Tensor, drafted: torch.Tensor, grid: Sequence[float] = GRID
) -> Calibration:
    """STS from held-out steps: each step's confidence logits of its rows [N, k], its accepted drafts [N] and its
    drafted rows [N] (row j + 1 is scored in the steps that drafted it, as accepted when accepted > j). A tie goes
    to the temperature nearest 1. A row no step drafted keeps 1."""
    logits, accepted, drafted = logits.double(), accepted.long(), drafted.long()
    before = torch.ones(logits.shape[0], dtype=torch.float64)  # the calibrated survival through the row before
    temperatures = []
    for j in range(logits.shape[1]):
        seen = drafted > j
        outcome = (accepted[seen] > j).double()
        z, kept = logits[seen, j], before[seen]
        scores = [(ece(kept * torch.sigmoid(z / t), outcome), abs(math.log(t)), t) for t in grid]
        best = min(scores)[2] if seen.any() else 1.0
        temperatures.append(best)
        before = before * torch.sigmoid(logits[:, j] / best)
    return Calibration(
        temperatures,
        [int((drafted > j).sum()) for j in range(logits.shape[1])],
        row_errors(logits, accepted, drafted),
        row_errors(logits, accepted, drafted, temperatures),
    )


def row_errors(
    logits: torch.Tensor, accepted: torch.Tensor, drafted: torch.Tensor, temperatures: Sequence[float] | None = None
) -> list[float]:
    """Per row, the ECE of the survivals through it (at `temperatures`; none: raw) over the steps that drafted it
    (`sts`'s samples)."""
    through = survival(logits.double(), temperatures)
    return [ece(through[drafted > j, j], (accepted[drafted > j] > j).double()) for j in range(logits.shape[1])]
