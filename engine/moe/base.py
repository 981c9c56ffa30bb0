"""MoE backend ABC: routed experts of one layer (the router itself runs in the model)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class MoEBackend(ABC):
    name: str = "?"

    @abstractmethod
    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H] input already normed by pre_feedforward_layernorm_2
        topk_ids: torch.Tensor,  # [T, K] int64 expert ids
        topk_weights: torch.Tensor,  # [T, K] fp32, renormalised and multiplied by per_expert_scale
    ) -> torch.Tensor:  # [T, H]: sum_k w_k * down_e(gelu_tanh(gate_e x) * up_e x)
        ...
