"""MoE backends by name, imported lazily: torch (reference, CPU), triton (fused Q4_0), offload."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from swaserve.engine.config import ModelConfig
    from swaserve.engine.moe.base import MoEBackend
    from swaserve.models.weights import Gemma4Weights

log = logging.getLogger(__name__)
_NAMES = ("auto", "torch", "triton", "offload")


def get_moe_backend(
    name: str, cfg: ModelConfig, weights: Gemma4Weights, device: torch.device | str, cache_size: int = 0
) -> MoEBackend:
    """Build the MoE backend `name`; 'auto' = torch on CPU; on CUDA triton when the experts fit the
    GPU, else offload (experts stay in host memory)."""
    device = torch.device(device)
    if name not in _NAMES:
        raise ValueError(f"unknown MoE backend {name!r} (choose {', '.join(_NAMES)})")
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            try:
                import swaserve.engine.moe.triton_backend  # noqa: F401
                from swaserve.engine.moe.offload_backend import experts_fit

                name = "triton" if experts_fit(weights.layers, device) else "offload"
            except ImportError as e:
                log.warning("triton MoE backend unavailable (%s); using torch", e)
    opts: dict[str, Any] = {}
    if name == "torch":
        from swaserve.engine.moe.torch_backend import TorchMoE as cls
    elif name == "triton":
        from swaserve.engine.moe.triton_backend import TritonMoE as cls
    else:
        from swaserve.engine.moe.offload_backend import OffloadMoE as cls

        opts["cache_size"] = cache_size
    return cls(cfg, weights.layers, device, **opts)
