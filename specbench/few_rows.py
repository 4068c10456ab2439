"""Linear layers over a few rows on CPU: MKL's float32 GEMM computes x @ W.T (F.linear) over 2 to 16 rows up to
twice as slowly as (W @ x.T).T, the same product laid out the other way round. Small verification trees and
chains and EAGLE's draft levels are such products, so on CPU every nn.Linear of the target, the draft model and
the heads takes that layout there. The tiny target after 400 cached tokens (2-core EPYC, torch 2.13,
`benchmarks/test_hot_paths.py -k tiny_target`, both layouts in one run): 4 rows 35.7 -> 25.4 ms, 8 rows
47.0 -> 29.6, 16 rows 52.4 -> 39.4. From 32 rows on the layout gained nothing or lost up to 8% (measured
interleaved), so longer inputs, and one row (a vanilla step), keep F.linear.
Under torch.compile (`--compile`) the row count is symbolic: the range test becomes a guard, so a compiled
forward has one graph for one row, one for 2-16 rows (with this layout) and one for more. Compiled, the tiny
target after 400 cached tokens took 26.4 -> 18.3 ms over 4 rows and 26.7 -> 22.3 over 8 with the layout
(one row: 17.4). The logits differ from F.linear's in the last bits, as any two GEMM kernels' do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEWEST, MOST = 2, 16  # the row counts where (W @ x.T).T beat F.linear on the CPU it was measured on


class FewRowLinear(nn.Linear):
    """nn.Linear (same parameters and state dict) that computes FEWEST..MOST rows as (W @ x.T).T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not FEWEST <= rows <= MOST:  # comparisons, not `in range`: a compiled graph guards on them
            return F.linear(x, self.weight, self.bias)
        # contiguous: attention reshapes the output into heads, and CPU SDPA's fast kernel needs unit strides
        y = (self.weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def use_few_row_layout(module: nn.Module) -> nn.Module:
    """Every plain nn.Linear of a float32 CPU `module` becomes a FewRowLinear (in place; returns `module`)."""
    first = next(module.parameters(), None)
    if first is None or first.device.type != "cpu":
        return module
    for layer in module.modules():
        if type(layer) is nn.Linear and layer.weight.dtype == torch.float32:
            layer.__class__ = FewRowLinear
    return module
