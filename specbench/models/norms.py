"""RMSNorm in two kernels for `--graphs`: transformers' Llama-style norm (Llama, Qwen2/3, Mistral and the heads built
from them) runs a chain of eight elementwise kernels: casts, square, mean, add, rsqrt, products. Inside a captured
forward each is a launch of a few microseconds, some 500 of a 7B forward's 1,400. torch's rms_norm kernel
(float32 inside, rounded once to the input's dtype) followed by the weight's product gives the same numbers as
that chain: rounded where it rounds, multiplied by the weight in the same dtype (bit for bit on a CPU; on a GPU the
mean's summation order may differ in float32's last bit). On a GPU in float16 or bfloat16 both run as one Triton
kernel (`core.kernels.rms_norm`). Classes whose forward computes something else (Gemma's
and Qwen3-Next's `1 + weight`) keep their own: a probe on each class decides. The eager loop, comparable with
published scripts, keeps transformers' chain."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core import kernels


def rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`norm`'s forward as torch's rms_norm kernel and the weight's product (one kernel where `core.kernels` serves)."""
    if kernels.norms(hidden, norm.weight):
        return kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon)
    return F.rms_norm(hidden, norm.weight.shape, None, norm.variance_epsilon) * norm.weight


_fused: dict[type, type | None] = {}  # a norm class -> its two-kernel subclass; None: it computes something else


def fuse_norms(module: nn.Module) -> nn.Module:
    """Every Llama-style RMSNorm in `module` runs as `rms_norm` (in place: the class of each such norm becomes a
    subclass with that forward; parameters and state dict unchanged). Returns `module`."""
    for norm in module.modules():
        kind = type(norm)
        if not _llama_like(norm) or kind in _fused.values():
            continue
        if kind not in _fused:
            _fused[kind] = type(kind.__name__, (kind,), {"forward": rms_norm, "__doc__": "RMSNorm in two kernels"})
            if not _agrees(norm, _fused[kind]):
                _fused[kind] = None
        if _fused[kind] is not None:
            norm.__class__ = _fused[kind]
    return module


def _llama_like(norm: nn.Module) -> bool:
    """A float `variance_epsilon` and a weight vector, as transformers' LlamaRMSNorm and its copies have."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    return isinstance(eps, float) and isinstance(weight, torch.Tensor) and weight.dim() == 1


@torch.inference_mode()
def _agrees(norm: nn.Module, fused: type) -> bool:
    """Whether `fused`'s forward gives `norm`'s outputs on a probe (random rows in the weight's dtype and device)
    within a few units in the last place."""
    weight = norm.weight
    probe = torch.randn(3, len(weight), generator=torch.Generator().manual_seed(0)).mul(4).to(weight)
    own = norm(probe)
    tolerance = 4 * torch.finfo(own.dtype).eps
    return torch.allclose(fused.forward(norm, probe), own, rtol=tolerance, atol=tolerance)
