"""Which path a model op takes: the device kernels (CUDA, or the Triton interpreter when a test or
tool asks with `device_kernels()`) or the torch/CPU ops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import FLOAT_TYPES

_forced = False  # device kernels on CPU tensors (interpreter): tests and tools only


@contextlib.contextmanager
def device_kernels() -> Iterator[None]:
    """Run the device (Triton) path on CPU tensors, in the interpreter (TRITON_INTERPRET=1)."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


def use_device_kernels(device: torch.device) -> bool:
    return device.type == "cuda" or _forced


def device_linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [..., K] @ W^T on the device path: the Triton block kernels, or F.linear for a float weight
    (converted to the compute dtype at load, so `to` is a no-op)."""
    if w.qtype in FLOAT_TYPES:
        return F.linear(x, w.data.to(x.dtype))
    from swaserve.engine.quant import triton_q4

    return triton_q4.quant_linear(x, w)
