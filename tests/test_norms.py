"""`--graphs` runs transformers' Llama-style RMSNorm as torch's rms_norm kernel and one product: the same numbers,
two kernels instead of eight; a norm computing something else keeps its own forward."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from specbench.models.norms import fuse_norms, rms_norm

from .conftest import CUDA, random_llama


class Ops(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", [LlamaRMSNorm, Qwen3RMSNorm])
def test_the_two_kernels_give_transformers_norm(kind, dtype, device):
    """Bit for bit on a CPU; on a GPU within a few units in the last place (the mean sums in another order, which
    float32 keeps where float16 rounds it away)."""
    gen = torch.Generator().manual_seed(1)
    norm = kind(4096, eps=1e-5).to(device, dtype)
    norm.weight.data = (torch.randn(4096, generator=gen) * 0.5 + 1).to(device, dtype)
    hidden = (torch.randn(2, 7, 4096, generator=gen) * 5).to(device, dtype)
    with torch.inference_mode(), Ops() as ops:
        fused = rms_norm(norm, hidden)
    assert len(ops.names) == 2 and ops.names[1] == "mul", ops.names  # (on a GPU: a fused kernel, not a chain)
    ulp = 0 if device == "cpu" else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(fused, norm(hidden), rtol=ulp, atol=ulp)


class OnePlusWeight(nn.Module):
    """Gemma's formula (x normalised, times 1 + weight) behind Llama's attribute names."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.variance_epsilon = 1e-6

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


def test_a_model_keeps_its_state_and_logits_and_a_norm_computing_otherwise_keeps_its_forward():
    model = random_llama(50, layers=2, seed=0, init=0.1).eval()
    model.model.layers[0].extra = OnePlusWeight(model.config.hidden_size)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        before, state = model(ids).logits, {k: v.clone() for k, v in model.state_dict().items()}
        assert fuse_norms(model) is model
        after = model(ids).logits
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 2 * 2 + 1 and all(type(m).forward is rms_norm for m in norms)
    assert type(model.model.layers[0].extra) is OnePlusWeight
    assert torch.equal(after, before)
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], v) for k, v in state.items())
    fuse_norms(model)  # a second time changes nothing
    assert all(type(m).__mro__[1] is LlamaRMSNorm for m in norms)
