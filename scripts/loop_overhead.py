"""The decode loop's own cost per step and per added slot, on a model whose forward is nearly free: a one-layer,
64-wide Llama (random weights, a vocabulary of 512) with a draft and an EAGLE-3 head of the same
width, run through `core.decode.decode_batch` on a `BatchedLM` of B slots (uncaptured: this is the host's cost).

    python scripts/loop_overhead.py [--batches 1,8,64,256] [--methods vanilla,sps,eagle3] [--steps 24] [--repeats 3]

Each B's methods run in interleaved rounds (the first discarded); a step (from one target forward's start to the
next's) is the median over the steps every slot shared. Printed per method and B: ms a step; its seconds inside
nn.Module calls (global forward hooks): the target model's, and the drafters' (draft model, heads, readouts); the
drafter's own, its propose and update calls outside those (its Python and its tensor ops outside a module, such as
EAGLE's top-k over the head's logits); the loop's, the rest (building the verification's rows, the mask, picks and
acceptance, commits, bookkeeping); and the loop's and the drafter's own per added slot: (x(B) - x(1)) / (B - 1).
On a GPU the tensor ops of both run once for the batch (inside the captured graphs, under --graphs); here on the
CPU their cost grows with B as the forwards' does. Random weights accept almost nothing (τ ≈ 1): nothing here is a
method's speedup. Never time while anything else runs (docs/cpu-notes.md)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_checkpoints import write_random  # noqa: E402

from specbench import methods  # noqa: E402
from specbench.core.decode import Job, decode_batch  # noqa: E402
from specbench.core.proposer import Drafter  # noqa: E402
from specbench.core.static_lm import BUCKETS, BatchedLM  # noqa: E402
from specbench.models import loading  # noqa: E402

PROMPT = 16  # tokens of each slot's prompt


def _resources(folders: dict[str, Path]) -> tuple[methods.Resources, torch.nn.Module]:
    device, dtype = torch.device("cpu"), torch.float32
    model = loading.load_causal_lm(folders["target"], device, dtype, "target")
    owned = loading.owned_decoder(model, "target")
    res = methods.Resources(
        "loop",
        model,
        loading.load_tokenizer(folders["target"]),
        device,
        dtype,
        draft_path=folders["draft"],
        head_paths={"eagle3": folders["eagle3"]},
        owned={id(model): owned},
    )
    return res, owned


class Clock:
    """Seconds inside nn.Module calls (the outermost only: a model's, a head's, an lm_head's), counted by global
    forward hooks while `on`, and the moments the target's forwards begin, with the module seconds at that moment.
    With `ops` (a `TorchDispatchMode` entered around the run) also the seconds of the tensor ops run outside any
    module, each timed around its kernel (`outside`), so the loop's and the drafter's own time splits into their
    tensor work and the Python around it."""

    def __init__(self) -> None:
        self.depth, self.begun, self.inside, self.outside, self.on = 0, 0.0, 0.0, 0.0, False
        self.hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave),
        ]

    def _enter(self, module, args) -> None:
        if self.depth == 0:
            self.begun = time.perf_counter()
        self.depth += 1

    def _leave(self, module, args, output) -> None:
        self.depth -= 1
        if self.depth == 0 and self.on:
            self.inside += time.perf_counter() - self.begun

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


class OpClock(TorchDispatchMode):
    """Times every aten op run outside a module into `clock.outside` (on the CPU an op's kernel runs before it
    returns). It slows every op by microseconds, so a run under it gives only the ops' seconds: the Python is the
    plain run's time less them (--ops runs each round's turns both ways)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.clock.depth or not self.clock.on:
            return func(*args, **(kwargs or {}))
        begun = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.clock.outside += time.perf_counter() - begun


def step_seconds(
    target: BatchedLM, drafting: Drafter, steps: int, seed: int, clock: Clock, temperature: float = 0.0
) -> list[float]:
    """Medians, over the steps every slot shared, of a step's seconds, its target forward's model seconds, its
    drafters' model seconds, the drafter's own seconds outside them (its propose and update calls less their
    models), and the seconds of tensor ops outside modules, the loop's and the drafter's own (0 without
    `OpClock`), for one batch of `target.batch` turns of `steps` tokens each (random prompts, nothing stops them
    early; at `temperature`, each turn drawing from a generator of its own). A step is the time from one target
    forward's start to the next's (drafting, verification, acceptance, commits, updates)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = target.model.config.vocab_size
    jobs = [
        Job(
            torch.randint(3, vocab, (PROMPT,), generator=generator).tolist(),
            steps,
            temperature,
            torch.Generator().manual_seed(seed * 1000 + i) if temperature else None,
            (i, 0),
        )
        for i in range(target.batch)
    ]
    starts: list[tuple[float, ...]] = []  # per target forward: (moment, module seconds, its own, rows, the
    # drafter's own seconds outside modules so far, op seconds outside modules so far, the drafter's own of them)
    own = [0.0, 0.0]  # the drafter's calls' seconds outside modules, and its ops' there, so far

    def timed(call, counted: bool):
        def wrapper(*args, **kwargs):
            before = (time.perf_counter(), clock.inside, clock.outside)
            try:
                return call(*args, **kwargs)
            finally:
                if counted:
                    starts.append((*before[:2], clock.inside - before[1], len(args[0]), own[0], before[2], own[1]))
                else:
                    own[0] += time.perf_counter() - before[0] - (clock.inside - before[1])
                    own[1] += clock.outside - before[2]

        return wrapper

    target.verify = timed(target.verify, True)  # type: ignore[method-assign]
    drafting.propose = timed(drafting.propose, False)  # type: ignore[method-assign]
    drafting.update = timed(drafting.update, False)  # type: ignore[method-assign]
    clock.on, clock.inside, clock.outside = True, 0.0, 0.0
    try:
        decode_batch(target, drafting, lambda: jobs.pop() if jobs else None, lambda job, gen: None, stop_ids=set())
    finally:
        for holder, name in ((target, "verify"), (drafting, "propose"), (drafting, "update")):
            delattr(holder, name)
        clock.on = False
    full = [
        (b[0] - a[0], a[2], b[1] - a[1] - a[2], b[4] - a[4], b[5] - a[5] - (b[6] - a[6]), b[6] - a[6])
        for a, b in zip(starts, starts[1:], strict=False)
        if a[3] == b[3] == target.batch
    ]
    if not full:
        raise SystemExit(f"no two steps in a row kept all {target.batch} slots busy: raise --steps")
    return [statistics.median(column) for column in zip(*full, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--methods", default="vanilla,sps,eagle3")
    parser.add_argument("--steps", type=int, default=24, help="tokens each slot's turn generates")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (one more, discarded, warms up)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every turn")
    parser.add_argument(
        "--ops",
        action="store_true",
        help="also run each round's turns again with each tensor op outside the modules timed: the loop's and the "
        "drafter's own time split into their tensor ops' and the rest (Python)",
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    names = args.methods.split(",")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        res, owned = _resources(write_random("loop", Path(folder), torch.device("cpu"), torch.float32))
        rows: dict[tuple[str, int], list[float]] = {}
        measure(args, batches, names, res, owned, Clock(), rows)
    report(args, batches, names, rows)
    return 0


def measure(args, batches: list[int], names: list[str], res, owned, clock: Clock, rows: dict) -> None:
    """Every B's methods in interleaved rounds (the first discarded): `rows[name, B]`, the medians of the rounds'
    `step_seconds`."""
    for batch in batches:
        target = BatchedLM(owned, batch, capture=False, context=PROMPT + args.steps + BUCKETS[-1])
        slots = {name: methods.build_batch(name, res, batch) for name in names}
        times: dict[str, list[list[float]]] = {name: [] for name in names}
        for round_ in range(args.repeats + 1):
            for name in names:
                measured = step_seconds(target, slots[name], args.steps, round_, clock, args.temperature)
                if args.ops:  # the same turns again, each op timed: only its op seconds are kept
                    with OpClock(clock):
                        timed = step_seconds(target, slots[name], args.steps, round_, clock, args.temperature)
                    measured[4:] = timed[4:]
                if round_:
                    times[name].append(measured)
        for name in names:
            rows[name, batch] = [statistics.median(t) for t in zip(*times[name], strict=True)]


def report(args, batches: list[int], names: list[str], rows: dict) -> None:
    """The table (and with --ops, the split of the loop's and the drafter's own time) as markdown."""
    print(
        f"loop overhead: one layer, 64 wide, {args.steps} tokens a turn, T = {args.temperature:g}, "
        f"median of {args.repeats} rounds"
    )
    print(
        "| method | B | ms/step | target model ms | drafter models ms | drafter's own ms | loop ms "
        "| loop per added slot (µs) | drafter's own per added slot (µs) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    split = []
    for name in names:
        parts0 = parts(rows[name, batches[0]])
        for batch in batches:
            step, target, drafter, own, loop, *rest = parts(rows[name, batch])
            added = [
                f"{(x - x0) / (batch - batches[0]) * 1e6:.1f}" if batch > batches[0] else "—"
                for x, x0 in zip((loop, own, *rest), (parts0[4], parts0[3], *parts0[5:]), strict=True)
            ]
            cells = " | ".join(f"{x * 1e3:.2f}" for x in (step, target, drafter, own, loop))
            print(f"| {name} | {batch} | {cells} | {' | '.join(added[:2])} |")
            split.append(f"| {name} | {batch} | {' | '.join(added[2:])} |")
    if args.ops:
        print(
            "\nper added slot (µs): tensor ops outside the modules (timed in a second run of the same turns) "
            "and the rest (Python):"
        )
        print("| method | B | loop's tensor ops | loop's Python | drafter's own tensor ops | drafter's own Python |")
        print("|---|---|---|---|---|---|")
        print("\n".join(row for row in split if "—" not in row))


def parts(medians: list[float]) -> list[float]:
    """A step's seconds: the whole, the target model's, the drafters' models', the drafter's own, the loop's (the
    rest), then the loop's tensor ops and Python, and the drafter's own tensor ops and Python."""
    step, target, drafter, own, loop_ops, own_ops = medians
    loop = step - target - drafter - own
    return [step, target, drafter, own, loop, loop_ops, loop - loop_ops, own_ops, own - own_ops]


if __name__ == "__main__":
    sys.exit(main())
