"""Per-step host data -> device tensors without a host synchronisation.

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until the
device has finished all queued work: one such call mid-step serialises the whole step. Here the
values go into pinned host memory first and are copied with `non_blocking=True`; the caching host
allocator keeps a pinned block alive until the copy that reads it has completed, so the staging
tensor may be dropped at once. On the CPU this is a plain `torch.tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device | str
              ) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`, queued without waiting for the device."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def pack_to_device(parts: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device | str
                   ) -> list[torch.Tensor]:
    """Several integer lists staged as one host buffer and one copy; returns a 1-D device view each."""
    flat: list[int] = []
    for p in parts:
        flat.extend(p)
    dev = to_device(flat, dtype, device)
    out, start = [], 0
    for p in parts:
        out.append(dev[start:start + len(p)])
        start += len(p)
    return out
