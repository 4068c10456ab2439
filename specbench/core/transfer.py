"""Host values onto the device without waiting for it. A copy from the host's ordinary (pageable) memory to a GPU
first waits for every kernel queued before it: one more host sync, mid-step. A copy from page-locked memory is
queued like a kernel, and the host goes on."""

from __future__ import annotations

import torch


def upload(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` (ints, as long; or a tensor on the host) on `device`, queued without a wait on a GPU. The page-locked
    copy stays alive until the transfer has run (torch's host allocator records it on the stream)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    if device.type == "cpu" or host.device == device:
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def padded_rows(slots: list[int], counts: list[int], pad: int) -> list[int]:
    """The rows of a [B, pad, ...] buffer, flattened to [B * pad, ...], that hold slot s's first n values, for each
    (s, n) of `slots` and `counts`: every slot's values then land in one indexed copy, not one copy a slot."""
    return [slot * pad + j for slot, n in zip(slots, counts, strict=True) for j in range(n)]


def appended(pending: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Rows waiting to be read [p, ...], then `new` [n, ...] in their dtype (usually none wait: `new` as it is)."""
    return torch.cat([pending.to(new), new]) if len(pending) else new
