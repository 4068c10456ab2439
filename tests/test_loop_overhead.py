"""scripts/loop_overhead.py, the decode loop's own cost per step and per added slot, as a smoke test: a few steps at
B = 1 and 2 for vanilla, sps and eagle3 on its one-layer, 64-wide family, greedy and sampled (the sampled run with
--ops, the split into tensor ops and Python; timings are not checked: CI is busy)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "loop_overhead.py"


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_loop_overhead_prints_a_row_per_method_and_batch(monkeypatch, capsys, temperature):
    spec = importlib.util.spec_from_file_location("loop_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["loop_overhead.py", "--batches", "1,2", "--steps", "12", "--repeats", "1", "--temperature", temperature]
    monkeypatch.setattr(sys, "argv", argv + ["--ops"] * (temperature == "1"))
    assert module.main() == 0
    out, _, split = capsys.readouterr().out.partition("\n\n")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "µs" not in line]
    cells = {(r[0].strip("| "), int(r[1])): [float(x) for x in r[2:7]] for r in rows if r[1].strip().isdigit()}
    assert set(cells) == {(m, b) for m in ("vanilla", "sps", "eagle3") for b in (1, 2)}
    for (method, _), (step, target, drafter, own, loop) in cells.items():
        assert (
            step > 0 and target > 0 and abs(step - target - drafter - own - loop) < 0.03
        )  # (five cells rounded to 0.01)
        assert (drafter > 0) == (method != "vanilla") and own >= 0
    added = {r[0].strip("| "): float(r[7]) for r in rows if r[1].strip() == "2"}  # the loop's µs per added slot
    if temperature == "0":
        assert not split
        return
    parts = [
        line.strip("| ").split(" | ") for line in split.splitlines() if line.startswith("| ") and "---" not in line
    ]
    ops = {r[0]: [float(x) for x in r[2:]] for r in parts[1:]}
    assert set(ops) == set(added) and all(r[1] == "2" for r in parts[1:])
    for method, (loop_ops, loop_python, *_) in ops.items():  # (a difference of two runs: either sign)
        assert abs(loop_ops + loop_python - added[method]) < 0.2
    assert ops["vanilla"][2] == 0  # (it proposes nothing: no op)
