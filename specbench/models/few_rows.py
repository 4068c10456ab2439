"""Linear layers over a few rows on CPU: MKL's float32 F.linear (x @ W.T) over 1 to 16 rows can be several times
slower than (W @ x.T).T, the same product laid out the other way round (one row computed as two). Vanilla's step,
small trees and chains, a draft model's steps and EAGLE's draft levels are such products. By default 1 to 16 rows
take it (`FALLBACK`). Which row counts gain depends on the CPU and its BLAS: `SPECBENCH_FEW_ROWS=measure` times
them once per process (`calibrate`) on the first CPU float32 model large enough to stream its weights from memory
as a decode step does, and `SPECBENCH_FEW_ROWS` pins ranges ("1-12,16"; "none": F.linear throughout). Logits differ
from F.linear's in the last bits, as any two GEMM kernels' do; under `--compile` each range gets its own graph.
Measurements: docs/cpu-notes.md."""

from __future__ import annotations

import os
import time
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpecbenchError

MOST = 16  # the largest row count calibrated: past it F.linear (on the AVX2 EPYC 32-256 rows gained nothing or lost 8%)
FALLBACK = ((1, 16),)  # both EPYCs' calibrations took one row too (1-12,16 and 1-11,16; docs/cpu-notes.md)
STREAMED = 32 << 20  # bytes of linear weights from which a model's products stream from memory, as in a decode step
SAMPLE = 96 << 20  # bytes of weights a calibration pass goes through at most (bounds its cost on large models)
ROUNDS = 3  # interleaved rounds per row count; the fastest of each layout is compared

ranges: tuple[tuple[int, int], ...] = FALLBACK  # row counts (inclusive ranges) that take the (W @ x.T).T layout
calibrated = False
M = TypeVar("M", bound=nn.Module)


class FewRowLinear(nn.Linear):
    """nn.Linear (same parameters and state dict) that computes the calibrated row counts as (W @ x.T).T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        for lo, hi in ranges:  # comparisons, not `in`: a compiled graph guards on them (no generator: a hot path)
            if lo <= rows <= hi:
                return _transposed(self, x.reshape(rows, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def _transposed(layer: nn.Linear, flat: torch.Tensor) -> torch.Tensor:
    """(W @ x.T).T of `flat` [rows, in], contiguous (CPU SDPA's fast kernel needs unit strides after attention
    reshapes the output into heads); one row goes through as two."""
    rows = len(flat)
    if rows == 1:
        flat = flat.expand(2, -1).contiguous()
    y = (layer.weight @ flat.T).T[:rows].contiguous()
    if layer.bias is not None:
        y += layer.bias
    return y


def use_few_row_layout(module: M) -> M:
    """Every plain nn.Linear of a float32 CPU `module` becomes a FewRowLinear (in place; returns `module`). With
    `SPECBENCH_FEW_ROWS=measure`, the first such module whose weights stream from memory calibrates the process's
    row ranges."""
    first = next(module.parameters(), None)
    if first is None or first.device.type != "cpu":
        return module
    layers = [m for m in module.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32]
    for layer in layers:
        layer.__class__ = FewRowLinear
    if not calibrated:
        pin = pinned()
        if pin is not None:
            set_ranges(pin)
        elif measuring() and sum(layer.weight.nbytes for layer in layers) >= STREAMED:
            set_ranges(calibrate(layers))
    return module


def set_ranges(value: tuple[tuple[int, int], ...]) -> None:
    global ranges, calibrated
    ranges, calibrated = value, True


def measuring() -> bool:
    """Whether `SPECBENCH_FEW_ROWS=measure` asks for the row counts to be timed on this machine."""
    return os.environ.get("SPECBENCH_FEW_ROWS", "").strip() == "measure"


def pinned() -> tuple[tuple[int, int], ...] | None:
    """The ranges `SPECBENCH_FEW_ROWS` names ("1-12,16"; "none": none), or None when it is unset or "measure"."""
    text = os.environ.get("SPECBENCH_FEW_ROWS", "").strip()
    if not text or text == "measure":
        return None
    if text == "none":
        return ()
    out = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            raise SpecbenchError(f"SPECBENCH_FEW_ROWS='{text}': give row ranges such as '1-12,16', 'none' or 'measure'")
        out.append((int(lo), int(hi)))
    return tuple(out)


def calibrate(layers: list[nn.Linear]) -> tuple[tuple[int, int], ...]:
    """The row counts 1..MOST for which (W @ x.T).T is faster than F.linear over `layers` (a prefix of up to
    SAMPLE bytes, taken in order as a forward takes them), as inclusive ranges."""
    sample, size = [], 0
    for layer in layers:
        if size >= SAMPLE:
            break
        sample.append(layer)
        size += layer.weight.nbytes
    wins = [rows for rows in range(1, MOST + 1) if _faster_transposed(sample, rows)]
    out: list[tuple[int, int]] = []
    for rows in wins:
        if out and out[-1][1] == rows - 1:
            out[-1] = (out[-1][0], rows)
        else:
            out.append((rows, rows))
    return tuple(out)


@torch.inference_mode()
def _faster_transposed(layers: list[nn.Linear], rows: int) -> bool:
    inputs = {n: torch.randn(rows, n) for n in {layer.in_features for layer in layers}}
    best = {"linear": float("inf"), "transposed": float("inf")}
    for round in range(ROUNDS + 1):  # round 0 warms both up
        for name in best:
            start = time.perf_counter()
            for layer in layers:
                x = inputs[layer.in_features]
                if name == "linear":
                    F.linear(x, layer.weight, layer.bias)
                else:
                    _transposed(layer, x)
            if round:
                best[name] = min(best[name], time.perf_counter() - start)
    return best["transposed"] < best["linear"]


def describe(value: tuple[tuple[int, int], ...] | None = None) -> str:
    """'1-12,16' (or 'none'): the ranges as the manifest records them and SPECBENCH_FEW_ROWS takes them."""
    value = ranges if value is None else value
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in value) or "none"
