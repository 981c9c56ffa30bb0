"""MoE backend ABC and the per-layer expert weights a backend reads (the router runs in the model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from swaserve.engine.config import CpuMatmul, ModelConfig
from swaserve.engine.quant.base import QWeight


@dataclass
class ExpertWeights:
    """The routed experts of one layer, stacked, in their stored form (E experts, hidden H, expert
    intermediate I = ModelConfig.moe_intermediate_size)."""

    gate_up: QWeight  # [E, 2 * I, H]: gate rows [0, I), then up rows [I, 2I)
    down: QWeight  # [E, H, I]


class MoEBackend(ABC):
    @classmethod
    def create(cls, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device, *,
               cache_size: int, cpu_matmul: CpuMatmul) -> MoEBackend:
        """Build from the engine's settings (engine.moe.get_moe_backend); a backend overrides this to
        take the settings it uses (cache_size: offload; cpu_matmul: the CPU linears)."""
        return cls(cfg, experts, device)  # type: ignore[call-arg]

    @abstractmethod
    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H] input already normed by pre_feedforward_layernorm_2
        topk_ids: torch.Tensor,  # [T, K] int64 expert ids
        topk_weights: torch.Tensor,  # [T, K] fp32, renormalised and multiplied by per_expert_scale
    ) -> torch.Tensor:  # [T, H]: sum_k w_k * down_e(gelu_tanh(gate_e x) * up_e x)
        ...
