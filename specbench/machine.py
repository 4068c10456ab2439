"""The machine a timing ran on, as the manifest records it (host, CPU or GPU and its clocks, versions, the code's
commit), and the warm-up that brings a GPU to a steady clock before timing."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from . import __version__
from .interference import busy_cpus
from .models import few_rows
from .presets import preset_dir

WARM_SECONDS = 5.0  # of matrix products before a GPU timing: the SM clock settles under sustained load


def _git_revision() -> str | None:
    """The checkout's commit, with "-dirty" when the package's tracked files differ from it (a run from edited code
    does not claim the commit's)."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        edits = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        )
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
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(index)],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
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
