"""`--graphs` computes the projections that read one input (q/k/v, gate/up) as one product over their concatenated
weights and rotates queries and keys as one tensor: the same logits in fewer kernels; a projection called on
another tensor computes its own, and an owner that feeds its projections different rows (DFlash's attention) keeps
them apart."""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specbench.cli.main import main
from specbench.heads.dflash import DFlashAttention
from specbench.methods import resources
from specbench.models import loading
from specbench.models.projections import fuse_projections

from .conftest import random_llama, random_qwen2

PRODUCTS = {"mm", "addmm", "bmm", "linear"}


class Ops(TorchDispatchMode):
    """How many of each aten op run inside it (on an empty tensor, which launches no kernel, not counted)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.counts[func.overloadpacket.__name__] += not isinstance(out, torch.Tensor) or out.numel() > 0
        return out


def _products(model, ids) -> tuple[torch.Tensor, Counter]:
    """The logits and the ops of one forward, matrix products counted together as "products"."""
    with torch.inference_mode(), Ops() as ops:
        logits = model(ids).logits
    ops.counts["products"] = sum(ops.counts[name] for name in PRODUCTS)
    return logits, ops.counts


def _stored_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_fused_projections_give_the_logits_in_four_products_a_layer_and_add_no_memory():
    for model in (random_llama(50, layers=2, seed=0, init=0.1), random_qwen2(50, layers=2, seed=1, init=0.1)):
        ids, one = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), torch.tensor([[7]])  # (one row: strides of size-1
        (before, separate), (before_one, separate_one) = _products(model, ids), _products(model, one)  # dims differ)
        stored = _stored_bytes(model)
        assert fuse_projections(model) is model
        (after, fused), (after_one, fused_one) = _products(model, ids), _products(model, one)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(after_one, before_one, rtol=1e-5, atol=1e-5)
        layers = model.model.layers
        for op, fewer in (("products", 3), ("neg", 1), ("cat", 1)):  # 7 products a layer -> 4; the rotary
            assert separate[op] - fused[op] == fewer * len(layers), op  # embedding's neg and cat once, not twice
            assert separate_one[op] - fused_one[op] == fewer * len(layers), op
        assert _stored_bytes(model) == stored  # the parts' weights are views of the concatenated ones
        attention = layers[0].self_attn
        fused_weight = attention.qkv_proj.weight
        assert attention.k_proj.weight.untyped_storage().data_ptr() == fused_weight.untyped_storage().data_ptr()
        assert (attention.q_proj.bias is None) == (attention.qkv_proj.bias is None)
        assert attention.products[0].input is None  # released after each forward
        fuse_projections(model)  # a second time changes nothing
        assert _products(model, ids)[1] == fused
        torch.testing.assert_close(_products(model, ids)[0], after, rtol=0, atol=0)


def test_a_projection_called_on_another_tensor_computes_its_own_product():
    model = random_llama(50, layers=1, seed=0)
    attention = fuse_projections(model).model.layers[0].self_attn
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.inference_mode():
        attention.products[0].input, attention.products[0].output = x, torch.zeros(1, 3, 3 * x.shape[-1])
        assert not attention.q_proj(x).any()  # the owner's product, while it runs on x
        other = torch.randn_like(x)
        torch.testing.assert_close(attention.q_proj(other), other @ attention.q_proj.weight.T)


def test_an_owner_feeding_its_projections_different_rows_keeps_them_apart():
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=64, num_hidden_layers=1, vocab_size=40)  # fmt: skip
    attention = DFlashAttention(config)
    fuse_projections(attention)
    assert not hasattr(attention, "qkv_proj") and type(attention) is DFlashAttention


def test_a_graphs_run_fuses_the_target_the_draft_and_the_heads_kernels(tmp_path, monkeypatch):
    fused = []

    def spy(module):
        fused.append(type(module).__name__)
        return fuse_for_graphs(module)

    fuse_for_graphs = loading.fuse_for_graphs
    monkeypatch.setattr(loading, "fuse_for_graphs", spy)
    monkeypatch.setattr(resources, "fuse_for_graphs", spy)
    args = ["run", "--methods", "sps,eagle3", "--limit", "1", "--tasks", "quick", "--max-new-tokens", "4",
            "--no-report", "--no-noise-floor", "--no-warmup", "--device", "cpu"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "eager")]) == 0
    assert fused == []  # the eager loop keeps transformers' kernels (comparable with published scripts)
    assert main([*args, "--graphs", "--out", str(tmp_path / "graphs")]) == 0
    assert sorted(set(fused)) == ["Eagle3Head", "LlamaForCausalLM"] and len(fused) == 3  # target, draft, head
