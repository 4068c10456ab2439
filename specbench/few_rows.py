"""Linear layers over a few rows on CPU: MKL's float32 GEMM computes x @ W.T (F.linear) over 2 to a few hundred
rows up to twice as slowly as (W @ x.T).T, the same product laid out the other way round. Verification forwards
and EAGLE's draft levels are such products, so on CPU every nn.Linear of the target, the draft model and the
heads takes the faster layout where it is faster (2-core EPYC, torch 2.13, the tiny target after 400 tokens,
benchmarks/test_hot_paths.py: a 4-row forward 37.7 -> 23.0 ms, 16 rows 50.9 -> 37.2, a 64-row tree 90.1 -> 75.3;
EAGLE-2's drafting step 34.9 -> 32.4). One row (a vanilla step) and long prefills keep F.linear, as fast there.
The logits differ from F.linear's in the last bits, as any two GEMM kernels' do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROWS = range(2, 257)  # where (W @ x.T).T beat F.linear on the CPU it was measured on


class FewRowLinear(nn.Linear):
    """nn.Linear (same parameters and state dict) that computes 2..256 rows as (W @ x.T).T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # compiled graphs pick their own kernels
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        if rows not in ROWS:
            return F.linear(x, self.weight, self.bias)
        # contiguous: attention reshapes the output into heads, and CPU SDPA's fast kernel needs unit strides
        y = (self.weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def use_few_row_layout(module: nn.Module) -> nn.Module:
    """Every plain nn.Linear of a float32 CPU `module` becomes a FewRowLinear (in place; returns `module`)."""
    if next(module.parameters()).device.type != "cpu":
        return module
    for layer in module.modules():
        if type(layer) is nn.Linear and layer.weight.dtype == torch.float32:
            layer.__class__ = FewRowLinear
    return module
