"""What interferes with a timing on the machine: other processes' CPU work (read from /proc/stat) and Python's cyclic
collector. Either makes a timing untrustworthy; neither needs torch, so a report reads the same threshold."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BUSY_SHARE = 0.25  # other processes using more than this share of the CPUs make a timing untrustworthy


def busy_cpus(seconds: float = 0.5) -> float | None:
    """CPUs' worth of work other processes do right now (from /proc/stat over `seconds`; None off Linux).
    Unlike the load average, it does not remember a job that has just finished."""

    first = _cpu_ticks()
    time.sleep(seconds)
    last = _cpu_ticks()
    if first is None or last is None:
        return None
    return (1 - (last[1] - first[1]) / max(last[0] - first[0], 1)) * (os.cpu_count() or 1)


def _cpu_ticks() -> tuple[int, int] | None:
    """All CPUs' (total, idle + iowait) clock ticks since boot, from /proc/stat; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]
    except (OSError, ValueError, IndexError):
        return None


class OtherLoad:
    """CPUs' worth of work other processes did over an interval: all CPUs' busy time (/proc/stat) minus this
    process's own CPU time, over the wall time. None off Linux."""

    def __enter__(self) -> OtherLoad:
        self.start = self._sample()
        self.value: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        end = self._sample()
        if self.start is not None and end is not None and end[2] > self.start[2]:
            busy, own, wall = (e - s for e, s in zip(end, self.start, strict=True))
            self.value = max(0.0, (busy - own) / wall)

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        """(all CPUs' busy seconds, this process's CPU seconds, wall clock)."""
        ticks = _cpu_ticks()
        if ticks is None:
            return None
        own = os.times()
        return (ticks[0] - ticks[1]) / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()


def set_aside() -> None:
    """Collect, then set every object alive aside from the cyclic collector (`gc.freeze`): the imports, models and
    proposers a worker keeps for its whole run (some 400,000 objects with torch and transformers), which the full
    collection before each timed decode (`without_gc`) would otherwise walk, a fifth of a second a decode.
    `take_back` (a worker's close) and exit undo it (extension modules then see their objects released)."""
    gc.collect()
    gc.freeze()


def take_back() -> None:
    """The objects `set_aside` set aside are the collector's again."""
    gc.unfreeze()


atexit.register(take_back)


@contextmanager
def without_gc() -> Iterator[None]:
    """Collect first, then keep Python's cyclic collector out of a timed region (as timeit does): its pauses
    would land on whichever method happens to be running."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def too_busy(busy: float | None, cpus: int) -> bool:
    """Other processes kept enough of the CPUs busy (`OtherLoad`) to make a timing untrustworthy."""
    return busy is not None and busy > BUSY_SHARE * cpus


def warn_if_busy(info: dict) -> None:
    """Timing on a loaded machine is wrong (and CPU thread pools degrade badly under contention): say so."""
    busy, cpus = info.get("busy_cpus"), info.get("cpu_count") or 1
    if too_busy(busy, cpus):
        print(
            f"specbench: warning: other processes keep {busy:.1f} of {cpus} CPUs busy; they will distort the timings",
            file=sys.stderr,
        )
