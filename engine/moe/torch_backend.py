"""Torch MoE backend: tokens grouped by expert, one gate_up and one down linear per active expert.

Each expert's weights are 2-D slices of the stacked [E, N, K] QWeights (engine.quant.linear's
`expert_slice`, cached on the stacked weight so a repacked Q4_0 form is built once per expert).
It is the reference for the triton and offload backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swaserve.engine.config import CpuMatmul, ModelConfig
from swaserve.engine.moe.base import ExpertWeights, MoEBackend
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.linear import expert_slice, linear


def _to(w: QWeight, device: torch.device) -> QWeight:
    if w.data.device == device:
        return w
    return QWeight(w.qtype, w.shape, w.data.to(device), w.name)  # a copy: no longer a view of the file


class TorchMoE(MoEBackend):
    def __init__(self, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device | str = "cpu",
                 cpu_matmul: CpuMatmul = "exact"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.cpu_matmul = cpu_matmul  # numerics of the CPU Q4_0 linears (EngineConfig.cpu_matmul)
        self.gate_up = [_to(ew.gate_up, self.device) for ew in experts]  # [E, 2 * I, H] per layer
        self.down = [_to(ew.down, self.device) for ew in experts]  # [E, H, I] per layer

    @classmethod
    def create(cls, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device, *,
               cache_size: int, cpu_matmul: CpuMatmul) -> TorchMoE:
        return cls(cfg, experts, device, cpu_matmul=cpu_matmul)

    def expert(self, layer: int, x: torch.Tensor, e: int) -> torch.Tensor:
        """down_e(gelu_tanh(gate_e x) * up_e x) for x [n, H] -> [n, H]."""
        gu = linear(x, expert_slice(self.gate_up[layer], e), self.cpu_matmul)  # [n, 2 * I]
        gate, up = gu.chunk(2, dim=-1)  # [n, I] each
        act = F.gelu(gate, approximate="tanh") * up  # [n, I]
        return linear(act, expert_slice(self.down[layer], e), self.cpu_matmul)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        topk_weights: torch.Tensor,  # [T, K]
    ) -> torch.Tensor:  # [T, H]
        T, K = topk_ids.shape
        if T == 0:
            return torch.zeros_like(x)
        flat = topk_ids.reshape(-1)  # [T * K]
        order = torch.argsort(flat, stable=True)  # [T * K] assignments sorted by expert
        xs = x[order // K]  # [T * K, H] token rows in expert order
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        ys = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self.expert(layer, xs[start:start + n], e))  # [n, H]
                start += n
        y = torch.empty_like(xs)  # [T * K, H] back in (token, k) order
        y[order] = torch.cat(ys) if len(ys) > 1 else ys[0]
        return (y.view(T, K, -1) * topk_weights.to(x.dtype)[..., None]).sum(1)  # [T, H]
