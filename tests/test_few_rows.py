"""The few-row layout of CPU linear layers: the same product as F.linear (to float32 rounding), contiguous (CPU
SDPA's fast kernel needs it), and applied only to plain float32 nn.Linear layers on CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specbench import methods, models
from specbench.few_rows import FEWEST, MOST, FewRowLinear, use_few_row_layout
from specbench.zoo import TINY_DIR


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 320), (2, 320), (1, 10, 320), (4, 4, 320), (1, 300, 320)])
def test_same_product_as_f_linear_and_contiguous(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(320, 96, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.__class__ = FewRowLinear
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_layout_is_used_only_between_two_and_16_rows(monkeypatch):
    layer = use_few_row_layout(nn.Linear(8, 4))
    calls = []
    monkeypatch.setattr(F, "linear", lambda *args: calls.append(args[0].shape) or torch.zeros(*args[0].shape[:-1], 4))
    for rows in (1, 2, 16, 17):
        layer(torch.randn(rows, 8))
    assert calls == [(1, 8), (17, 8)]
    assert (FEWEST, MOST) == (2, 16)


def test_applied_to_plain_float32_cpu_linears_only():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.Linear(4, 4).double(), nn.Embedding(3, 4))
    keys = list(model.state_dict())
    assert use_few_row_layout(model) is model
    assert [type(m).__name__ for m in model] == ["FewRowLinear", "Custom", "Linear", "Embedding"]
    assert list(model.state_dict()) == keys  # checkpoints load and save as before


def test_the_bundled_target_and_heads_get_it():
    target = models.load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)
    assert isinstance(target.get_output_embeddings(), FewRowLinear)
    res = methods.Resources("tiny", target, None, torch.device("cpu"), torch.float32,
                            head_paths={"eagle": TINY_DIR / "eagle"})  # fmt: skip
    assert isinstance(res.head("eagle").fc, FewRowLinear)


def test_a_compiled_forward_keeps_the_layout_for_few_rows():
    """torch.compile sees a symbolic row count: the range test must become a guard (a graph for 2..16 rows that
    multiplies by the weight on the left, another for more rows that calls linear), not a constant."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm.forward

    torch.manual_seed(0)
    layer = use_few_row_layout(nn.Linear(8, 4))
    compiled = torch.compile(layer, backend=record, dynamic=True)
    for rows in (3, 5, 17, 40):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias))
    assert len(graphs) == 2  # 3 and 5 rows share one graph, 17 and 40 the other
    assert "<built-in function matmul>" in graphs[0] and not any("linear" in f for f in graphs[0])
    assert any("linear" in f for f in graphs[1])
    torch._dynamo.reset()
