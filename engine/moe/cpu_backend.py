"""CPU MoE backend: every routed expert of a layer in one native call (engine/quant/native.py).

All (token, k) assignments of the step (decode rows and prefill chunks together) are grouped by expert
inside the kernel: per active expert one Q4_0 x Q8_0 gate_up over its tokens, gelu_tanh(gate) * up, one
down, then the weighted combine; the work items (expert, 32-row chunk) share one OpenMP region. The
experts' interleaved form is built once here, at construction (progress bar), and the file pages are
released, so host memory holds ~1.0x the experts' file bytes.

`--moe-backend cpu` also works with the model on a GPU (as llama.cpp's --cpu-moe): the experts stay
in host memory, the normed input [T, H] and the routing come to the host, and the result goes back in
the caller's dtype and device. The `auto` rule picks it on a CPU device when the experts are Q4_0, the
engine's cpu_matmul is "native" and the kernel is built; otherwise the torch backend (the reference).
Non-Q4_0 experts are refused at construction (use torch or offload).
"""

from __future__ import annotations

import torch

from swaserve.engine.config import CpuMatmul, ModelConfig
from swaserve.engine.moe.base import ExpertWeights, MoEBackend
from swaserve.engine.quant import native
from swaserve.engine.quant.linear import interleaved, native_ok, prepare_native


def supports(experts: list[ExpertWeights]) -> bool:
    """Whether the native kernel can run these experts (all Q4_0, H and I multiples of 32, kernel built)."""
    return bool(experts) and all(
        native_ok(ew.gate_up) and native_ok(ew.down) and len(ew.gate_up.shape) == 3 for ew in experts)


class CpuMoE(MoEBackend):
    def __init__(self, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device | str = "cpu",
                 progress: bool = True):
        if not native.available():
            raise ValueError(f"--moe-backend cpu needs the native kernels: {native.why_unavailable()}")
        if not supports(experts):
            kinds = sorted({w.qtype for ew in experts for w in (ew.gate_up, ew.down)})
            raise ValueError(f"--moe-backend cpu computes Q4_0 experts only (these are {', '.join(kinds)}); "
                             "use --moe-backend torch or offload")
        self.cfg = cfg
        self.device = torch.device(device)  # where inputs come from and results go (experts stay on the host)
        prepare_native([w for ew in experts for w in (ew.gate_up, ew.down)], progress)
        self.gate_up = [interleaved(ew.gate_up) for ew in experts]  # [E, packed(2I, H)] uint8 per layer
        self.down = [interleaved(ew.down) for ew in experts]  # [E, packed(H, I)] uint8 per layer

    @classmethod
    def create(cls, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device, *,
               cache_size: int, cpu_matmul: CpuMatmul) -> CpuMoE:
        return cls(cfg, experts, device)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        topk_weights: torch.Tensor,  # [T, K]
    ) -> torch.Tensor:  # [T, H]
        y = native.moe(x.to("cpu", torch.float32), self.gate_up[layer], self.down[layer],
                       self.cfg.moe_intermediate_size, topk_ids.cpu(), topk_weights.cpu())
        return y.to(x.device, x.dtype)
