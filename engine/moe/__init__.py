"""MoE backends by name, imported lazily: torch (reference, CPU), cpu (native Q4_0 kernel, experts in
host memory), triton (fused Q4_0), offload.

`MOE_BACKENDS.choices` is what `--moe-backend` accepts; `auto` = cpu on a CPU device when the experts
are Q4_0, cpu_matmul is "native" and the native kernel is built, else torch; on CUDA triton when the
experts fit the GPU, else offload (experts stay in host memory).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from swaserve.engine.registry import Registry

if TYPE_CHECKING:
    import torch

    from swaserve.engine.config import CpuMatmul, ModelConfig
    from swaserve.engine.moe.base import ExpertWeights, MoEBackend

log = logging.getLogger(__name__)


def _auto(experts: list[ExpertWeights], device: torch.device, cpu_matmul: CpuMatmul = "exact") -> str:
    if device.type != "cuda":
        if cpu_matmul != "native":
            return "torch"
        from swaserve.engine.moe.cpu_backend import supports

        return "cpu" if supports(experts) else "torch"
    try:
        import swaserve.engine.moe.triton_backend  # noqa: F401
        from swaserve.engine.moe.offload_backend import experts_fit
    except ImportError as e:
        log.warning("triton MoE backend unavailable (%s); using torch", e)
        return "torch"
    return "triton" if experts_fit(experts, device) else "offload"


MOE_BACKENDS: Registry[MoEBackend] = Registry("MoE", _auto)
MOE_BACKENDS.register("torch", "swaserve.engine.moe.torch_backend:TorchMoE")
MOE_BACKENDS.register("cpu", "swaserve.engine.moe.cpu_backend:CpuMoE")
MOE_BACKENDS.register("triton", "swaserve.engine.moe.triton_backend:TritonMoE")
MOE_BACKENDS.register("offload", "swaserve.engine.moe.offload_backend:OffloadMoE")


def get_moe_backend(name: str, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device | str,
                    cache_size: int = 0, cpu_matmul: CpuMatmul = "exact") -> MoEBackend:
    """Build the MoE backend `name` ("auto" resolved for the experts and device) over `experts`
    (one ExpertWeights per layer); ValueError for an unknown name."""
    import torch

    device = torch.device(device)
    cls = MOE_BACKENDS.load(MOE_BACKENDS.resolve(name, experts, device, cpu_matmul))
    return cls.create(cfg, experts, device, cache_size=cache_size, cpu_matmul=cpu_matmul)
