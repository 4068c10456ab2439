"""What a `--graphs` step asks of the host, method by method, on this machine's CPU (tiny family, nothing timed): how
often it reads tensor values back (on a GPU, each read waits for the device's queue to drain), how often it copies
host values onto the device from pageable memory (a tensor made from host data with a `device`, or indexed by a host
list: on a GPU each waits for the queue too; `core.transfer.upload` queues them instead) and how many ops it runs
outside the functions `--graphs` captures (on a GPU, each is a kernel launched from Python), and inside them (on a
GPU, kernels of the replayed graphs: each a few microseconds however small, which fusing saves; aten ops, so a cast
to the dtype a tensor has counts here and costs nothing). Steps run at T = 0.

    python scripts/step_ops.py [--methods vanilla,sps,eagle2] [--max-new-tokens 32] [--top 12] [--batch 64]

prints, per method, the median and the most of each over its steps (with --top, the ops a typical step runs most
outside the captured functions). tests/test_graphs.py holds the reads to one. The CPU's few-row layout is off
(`SPECBENCH_FEW_ROWS=none`, unless set): products run as on a GPU, and the counts do not follow its per-process
calibration (one row through the other layout adds ~20 ops a layer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specbench import methods, tasks
from specbench.cli.main import main as specbench
from specbench.core.capture import Replays
from specbench.core.proposer import drafter
from specbench.models.decoder import Decoder
from specbench.run import session

READS = {
    "tolist",
    "item",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
    "masked_select",
    "numpy",
    "any",
    "all",
    "equal",
}
VIEWS = {
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "transpose",
    "t",
    "expand",
    "permute",
    "alias",
    "detach",
    "as_strided",
    "split",
    "unbind",
    "lift_fresh",
    "_reshape_alias",
    "resolve_conj",
    "resolve_neg",
}  # no kernel (resolve_*: the input, without a conjugate or negative bit)
CAPTURED = ((Replays, "run"), (Decoder, "forward"))  # (a forward too long for a bucket is never captured)


class StepCounter:
    """Per decode step at T = 0 (from a propose to the update after it), by method: host reads of tensor values
    and, unless `ops` is off, ops outside the captured functions. Install it with `counting()`."""

    def __init__(self, ops: bool = True) -> None:
        self.reads: dict[str, list[int]] = {}
        self.ops: dict[str, list[int]] = {}
        self.uploads: dict[str, list[int]] = {}
        self.names: dict[str, list[Counter]] = {}  # ops outside the captured functions by name, step by step
        self.inside: dict[str, list[int]] = {}  # ops inside the captured functions
        self.count_ops = ops
        self.step: tuple[list[int], list[int], list[Counter], list[int], list[int]] | None = None
        self.captured = 0  # inside a function --graphs captures

    @contextmanager
    def counting(self):
        """Counts while the block runs (decode and the captured functions wrapped until it ends)."""
        decode_batch, build, names = session.decode_batch, methods.build_batch, {}

        def named(name, *args, **kwargs):
            drafting = build(name, *args, **kwargs)
            names[id(drafting)] = name
            return drafting

        def counted(target, drafts, next_job, finished, **kwargs):
            first = next_job()
            waiting = [first] if first is not None else []

            def jobs():
                return waiting.pop() if waiting else next_job()

            if first is None or first.temperature > 0:  # sampling reads the drafts' laws
                return decode_batch(target, drafts, jobs, finished, **kwargs)
            drafting = drafter(drafts)
            name = names.get(id(drafts), type(drafting).__name__)
            drafting.propose, drafting.update = self._begins(name, drafting.propose), self._ends(drafting.update)
            learns, drafting.learns = drafting.learns, True  # (its update ends a step, learning or not)
            try:
                return decode_batch(target, drafting, jobs, finished, **kwargs)
            finally:
                del drafting.propose, drafting.update  # (its own methods again)
                drafting.learns, self.step = learns, None

        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(session, "decode_batch", counted))
            stack.enter_context(mock.patch.object(methods, "build_batch", named))
            for owner, name in CAPTURED:
                stack.enter_context(mock.patch.object(owner, name, self._inside(getattr(owner, name))))
            stack.enter_context(_Reads(self))
            if self.count_ops:
                stack.enter_context(_Ops(self))
            yield self

    def _begins(self, name: str, propose):
        """`propose`, counting from here as a step of `name`."""

        def step_begins(*args, **kwargs):
            self.step = (
                self.reads.setdefault(name, []),
                self.ops.setdefault(name, []),
                self.names.setdefault(name, []),
                self.uploads.setdefault(name, []),
                self.inside.setdefault(name, []),
            )
            for counts in (self.step[0], self.step[1], self.step[3], self.step[4]):
                counts.append(0)
            self.step[2].append(Counter())
            return propose(*args, **kwargs)

        return step_begins

    def _ends(self, update):
        """`update`, ending the step."""

        def step_ends(*args, **kwargs):
            update(*args, **kwargs)
            self.step = None

        return step_ends

    def _inside(self, fn):
        def captured(*args, **kwargs):
            self.captured += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.captured -= 1

        return captured


class _Reads(TorchFunctionMode):
    def __init__(self, counter: StepCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counter.step is not None:
            if _reads(func, args, kwargs or {}) or _masked(func, args):
                self.counter.step[0][-1] += 1
            if _uploads(func, args, kwargs or {}):
                self.counter.step[3][-1] += 1
        return func(*args, **(kwargs or {}))


def _reads(func, args: tuple, kwargs: dict) -> bool:
    """Whether a call brings a tensor's values to the host (`any` and `all` over a dimension stay on the device)."""
    name = getattr(func, "__name__", "")
    if name in ("any", "all") and (len(args) > 1 or "dim" in kwargs):
        return False
    return name in READS


def _indices(func, args: tuple) -> tuple:
    """The indices of `x[...]` or `x[...] = v` as a tuple; () for any other call."""
    if getattr(func, "__name__", "") not in ("__getitem__", "__setitem__") or len(args) < 2:
        return ()
    return args[1] if isinstance(args[1], tuple) else (args[1],)


def _masked(func, args: tuple) -> bool:
    """Whether a call indexes by a boolean mask (`x[mask]`, `x[mask] = v`): its result's size is the mask's count,
    which the host reads (a wait on a GPU, and refused inside a CUDA graph's capture)."""
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in _indices(func, args))


def _uploads(func, args: tuple, kwargs: dict) -> bool:
    """Whether a call copies host values onto the device from pageable memory: a tensor made from host data with a
    device, a tensor indexed by a host list, or a host number put at a tensor's indices."""
    name = getattr(func, "__name__", "")
    if name in ("tensor", "as_tensor"):
        return kwargs.get("device") is not None
    if name == "new_tensor":  # host data onto its tensor's device
        return True
    index = _indices(func, args)
    if any(isinstance(i, list) for i in index):
        return True
    # `x[tensor] = 1`: the value becomes a host tensor that index_put_ copies (a CUDA graph's capture refuses it)
    return (
        name == "__setitem__"
        and not isinstance(args[2], torch.Tensor)
        and any(isinstance(i, torch.Tensor) for i in index)
    )


class _Ops(TorchDispatchMode):
    def __init__(self, counter: StepCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c, name = self.counter, func.overloadpacket.__name__
        if c.step is not None and name not in VIEWS:
            if c.captured:
                c.step[4][-1] += 1
            else:
                c.step[1][-1] += 1
                c.step[2][-1][name] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="vanilla,sps,lookahead,medusa,eagle,eagle2,eagle3,mtp,dflash,pard")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--top",
        type=int,
        default=0,
        help="also list the N most frequent ops outside of a method's typical step (one with the median count)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="B questions decoded together (the quick task's first turns, repeated to B): counts per batch step",
    )
    args = parser.parse_args()
    os.environ.setdefault("SPECBENCH_FEW_ROWS", "none")
    counter = StepCounter()
    with tempfile.TemporaryDirectory() as out, counter.counting():
        task, limit = ["--tasks", "quick"], ["--limit", "1"]
        if args.batch > 1:
            prompts = [q.turns[0] for q in tasks.load("quick").questions]
            path = Path(out) / "prompts.jsonl"
            path.write_text(
                "".join(json.dumps({"turns": [prompts[i % len(prompts)]]}) + "\n" for i in range(args.batch))
            )
            task, limit = ["--tasks", str(path), "--batch", str(args.batch)], ["--limit", str(args.batch)]
        code = specbench(
            [
                "run",
                "--methods",
                args.methods,
                *limit,
                *task,
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--no-report",
                "--no-noise-floor",
                "--device",
                "cpu",
                "--graphs",
                "--temperatures",
                "0",
                "--out",
                str(Path(out) / "run"),
            ]
        )
    if code:
        return code
    print(
        "| method | steps | host reads a step (median, most) | pageable uploads a step (median, most) "
        "| ops outside captured graphs a step (median, most) | ops inside them (median, most) |"
    )
    print("|---|---|---|---|---|---|")
    for name in counter.reads:
        cells = [counter.reads[name], counter.uploads[name], counter.ops[name], counter.inside[name]]
        medians = " | ".join(f"{statistics.median(c):g}, {max(c)}" for c in cells)
        print(f"| {name} | {len(cells[0])} | {medians} |")
    for name, steps in counter.names.items() if args.top else ():
        ops = counter.ops[name]
        typical = steps[ops.index(sorted(ops)[len(ops) // 2])]
        print(f"\n{name}, ops of a typical step: " + ", ".join(f"{op} {n}" for op, n in typical.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
