"""The few-row layout of CPU linear layers: the same product as F.linear (to float32 rounding), contiguous (CPU
SDPA's fast kernel needs it), applied only to plain float32 nn.Linear layers on CPU, at the row counts the
process calibrated (or SPECBENCH_FEW_ROWS pins)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specbench import machine, methods
from specbench.errors import SpecbenchError
from specbench.models import few_rows
from specbench.models import loading as models
from specbench.models.few_rows import FewRowLinear, use_few_row_layout
from specbench.zoo import TINY_DIR


@pytest.fixture
def ranges(monkeypatch):
    """Pins the process's row ranges for one test (another test's model may have calibrated them)."""

    def pin(value):
        monkeypatch.setattr(few_rows, "ranges", value)

    pin(few_rows.FALLBACK)
    return pin


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 320), (2, 320), (1, 10, 320), (4, 4, 320), (1, 300, 320)])
def test_same_product_as_f_linear_and_contiguous(shape, bias, ranges):
    ranges(((1, 16),))  # one row included: it goes through as two
    torch.manual_seed(0)
    layer = nn.Linear(320, 96, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.__class__ = FewRowLinear
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_layout_is_used_only_at_the_calibrated_row_counts(monkeypatch, ranges):
    ranges(((1, 2), (16, 16)))
    layer = use_few_row_layout(nn.Linear(8, 4))
    calls = []
    monkeypatch.setattr(F, "linear", lambda *args: calls.append(args[0].shape) or torch.zeros(*args[0].shape[:-1], 4))
    for rows in (1, 2, 3, 15, 16, 17):
        layer(torch.randn(rows, 8))
    assert calls == [(3, 8), (15, 8), (17, 8)]


def test_calibration_keeps_the_row_counts_where_the_transposed_layout_won_as_ranges(monkeypatch):
    won = {1, 2, 3, 5, 9, 10, 16}
    monkeypatch.setattr(few_rows, "_faster_transposed", lambda layers, rows: rows in won)
    assert few_rows.calibrate([nn.Linear(4, 4)]) == ((1, 3), (5, 5), (9, 10), (16, 16))
    monkeypatch.setattr(few_rows, "_faster_transposed", lambda layers, rows: False)
    assert few_rows.calibrate([nn.Linear(4, 4)]) == ()


def test_calibration_times_both_layouts_on_the_models_own_layers():
    layers = [nn.Linear(64, 96), nn.Linear(96, 64, bias=False)]
    assert few_rows._faster_transposed(layers, 3) in (True, False)
    assert set(few_rows.describe(few_rows.calibrate(layers)).replace("-", ",").split(",")) <= {
        "none",
        *map(str, range(1, few_rows.MOST + 1)),
    }


def test_nothing_is_timed_unless_asked(monkeypatch):
    """Calibration is opt-in: by default every process takes the same ranges, whatever the machine."""
    monkeypatch.setattr(few_rows, "calibrated", False)
    monkeypatch.setattr(few_rows, "ranges", few_rows.FALLBACK)
    monkeypatch.delenv("SPECBENCH_FEW_ROWS", raising=False)
    monkeypatch.setattr(few_rows, "calibrate", lambda layers: pytest.fail("calibrated without SPECBENCH_FEW_ROWS"))
    monkeypatch.setattr(few_rows, "STREAMED", 64 * 64 * 4)
    use_few_row_layout(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    assert few_rows.ranges == few_rows.FALLBACK


def test_when_asked_the_first_model_that_streams_its_weights_calibrates_once(monkeypatch):
    monkeypatch.setattr(few_rows, "calibrated", False)
    monkeypatch.setattr(few_rows, "ranges", few_rows.FALLBACK)
    monkeypatch.setenv("SPECBENCH_FEW_ROWS", "measure")
    calls = []
    monkeypatch.setattr(few_rows, "calibrate", lambda layers: calls.append(len(layers)) or ((1, 4),))
    monkeypatch.setattr(few_rows, "STREAMED", 3 * 64 * 64 * 4)
    use_few_row_layout(nn.Linear(64, 64))  # too small: its weights would sit in cache, unlike a decode step's
    assert calls == [] and few_rows.ranges == few_rows.FALLBACK
    use_few_row_layout(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)))
    use_few_row_layout(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)))
    assert calls == [3] and few_rows.ranges == ((1, 4),)


@pytest.mark.parametrize(("text", "expected"), [("1-12,16", ((1, 12), (16, 16))), ("none", ()), ("2-16", ((2, 16),))])
def test_specbench_few_rows_pins_the_ranges_without_calibrating(monkeypatch, text, expected):
    monkeypatch.setattr(few_rows, "calibrated", False)
    monkeypatch.setattr(few_rows, "ranges", few_rows.FALLBACK)
    monkeypatch.setenv("SPECBENCH_FEW_ROWS", text)
    monkeypatch.setattr(few_rows, "calibrate", lambda layers: pytest.fail("calibrated although pinned"))
    monkeypatch.setattr(few_rows, "STREAMED", 0)
    use_few_row_layout(nn.Linear(4, 4))
    assert few_rows.ranges == expected and few_rows.describe() == text
    assert machine.machine(torch.device("cpu"))["few_rows"] == text  # the manifest records what ran


@pytest.mark.parametrize("text", ["12-1", "0-4", "a", "1-2-3", "4,"])
def test_a_malformed_specbench_few_rows_is_one_clear_error(monkeypatch, text):
    monkeypatch.setenv("SPECBENCH_FEW_ROWS", text)
    with pytest.raises(SpecbenchError, match="SPECBENCH_FEW_ROWS"):
        few_rows.pinned()


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
    res = methods.Resources(
        "tiny", target, None, torch.device("cpu"), torch.float32, head_paths={"eagle": TINY_DIR / "eagle"}
    )
    assert isinstance(res.head("eagle").fc, FewRowLinear)


def test_a_compiled_forward_keeps_the_layout_for_few_rows(ranges):
    """torch.compile sees a symbolic row count: the range test must become a guard (a graph for 2..16 rows that
    multiplies by the weight on the left, another for more rows that calls linear), not a constant."""
    ranges(((2, 16),))
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
