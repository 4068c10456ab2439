"""The machine a timing ran on and the load on it: what the manifest records and what makes a timing
untrustworthy (other processes' CPU work, Python's cyclic collector)."""

from __future__ import annotations

import atexit
import functools
import gc
import hashlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from . import __version__
from .models import few_rows
from .presets import preset_dir

BUSY_SHARE = 0.25  # other processes using more than this share of the CPUs make a timing untrustworthy
WARM_SECONDS = 5.0  # of matrix products before a GPU timing: the SM clock settles under sustained load

def _git_revision() -> str | None:
    """The checkout's commit, with "-dirty" when the package's tracked files differ from it (a run from edited code
    does not claim the commit's)."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        edits = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=here,
                               capture_output=True, text=True, timeout=5)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    revision = head.stdout.strip()
    return (revision + ("-dirty" if edits.stdout.strip() else "")) or None


def files_digest(code: Path, presets: Path) -> str:
    """sha256 (first 16 hex digits) of the Python files under `code` and the YAML files under `presets`, by relative
    path and content."""
    digest = hashlib.sha256()
    for folder, pattern in ((code, "*.py"), (presets, "*.yaml")):
        for path in sorted(folder.rglob(pattern)):
            digest.update(f"{path.relative_to(folder).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def source_digest() -> str:
    """The package's code and method presets (`files_digest`): what code ran, where a checkout's commit is stale or
    missing (a copy without its history)."""
    return files_digest(Path(__file__).parent, preset_dir("methods"))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()


def machine(device: torch.device) -> dict:
    import transformers

    return {
        "device": device.type,
        "device_name": device_name(device),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specbench": __version__,
        "git_revision": _git_revision(),
        "source_digest": source_digest(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "busy_cpus": busy_cpus(),
        "few_rows": few_rows.describe() if device.type == "cpu" else None,  # row counts the (W @ x.T).T layout takes
        "gpu_clocks": gpu_clocks(device) if device.type == "cuda" else None,
    }


def gpu_clocks(device: torch.device) -> dict | None:
    """The GPU's SM and memory clocks (MHz), power (W) and temperature (°C) now, from nvidia-smi (None without it):
    a timing taken at a lowered clock reads slower than the card is."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    query = "clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(index)],
                              capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        sm, mem, sm_max, power, temperature = (float(v) for v in line.split(","))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return {"sm_mhz": sm, "mem_mhz": mem, "sm_max_mhz": sm_max, "power_w": power, "temperature_c": temperature}


def warm_gpu(device: torch.device, seconds: float = WARM_SECONDS) -> None:
    """Sustained matrix products for `seconds` on a CUDA device (nothing elsewhere): an idle GPU runs at a low clock
    and raises it under load, so a timing taken first after loading or compiling reads slower than the card is."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


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
