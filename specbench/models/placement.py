"""--device and --dtype by name, without torch: `run`, `verify` and `tune` check them before their heavy imports,
and `loading` resolves the same names into torch's objects (whether this machine has the device is its to say)."""

from __future__ import annotations

import re

from ..errors import SpecbenchError

DTYPES = ("float32", "float16", "bfloat16")  # --dtype besides auto; torch's attribute names
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")  # --device; N: a GPU's index
# the names torch.device parses (an index without leading zeros, short enough to parse)
_DEVICE = re.compile("|".join(d.replace("N", "(0|[1-9][0-9]{0,3})") for d in DEVICES))


def check_device(device: str) -> None:
    """By its name alone, so a typo is one line before torch (seconds to import) is needed."""
    if not _DEVICE.fullmatch(device):
        raise SpecbenchError(f"bad --device '{device}': use {', '.join(DEVICES)}")


def check_dtype(dtype: str) -> None:
    """As `check_device`: the names alone."""
    if dtype != "auto" and dtype not in DTYPES:
        raise SpecbenchError(f"bad --dtype '{dtype}': use auto, {', '.join(DTYPES)}")
