"""CPU MoE backend: every routed expert of a layer in one native call.

All (token, k) assignments of the step (decode rows and prefill chunks together) are grouped by expert
inside the kernel: per active expert one gate_up over its tokens, gelu_tanh(gate) * up, one down, then the
weighted combine; the work items (expert, row chunk) share one OpenMP region. Two kernels, per layer:
- Q4_0 gate_up and down: engine/quant/native.py's Q4_0 x Q8_0 kernel on the interleaved form, built once
  here, at construction (progress bar); the file pages are released, so host memory holds ~1.0x the
  experts' file bytes.
- any other pair of the types of engine/quant/native_k.py (Q8_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K,
  IQ4_XS, Q4_0; e.g. Q4_K_M's Q4_K gate_up with a Q6_K, Q5_0 or Q8_0 down): native_k's kernel on the
  stored rows, read in place (nothing is built).

`--moe-backend cpu` also works with the model on a GPU (as llama.cpp's --cpu-moe): the experts stay
in host memory, the normed input [T, H] and the routing come to the host, and the result goes back in
the caller's dtype and device. The `auto` rule picks it on a CPU device when every layer's experts have
a kernel, the engine's cpu_matmul is "native" and the kernels are built; otherwise the torch backend (the
reference). Other experts (the IQ1-3 codebook types, float) are refused at construction.
"""

from __future__ import annotations

import torch

from swaserve.engine.config import CpuMatmul, ModelConfig
from swaserve.engine.moe.base import ExpertWeights, MoEBackend
from swaserve.engine.quant import native, native_k
from swaserve.engine.quant.linear import interleaved, native_k_ok, native_ok, prepare_native


def _kind(ew: ExpertWeights) -> str:
    """"q4" (both Q4_0, native.py), "k" (native_k.py), or "" (no kernel) for one layer's experts."""
    if len(ew.gate_up.shape) != 3:
        return ""
    if native_ok(ew.gate_up) and native_ok(ew.down):
        return "q4"
    return "k" if native_k_ok(ew.gate_up) and native_k_ok(ew.down) else ""


def supports(experts: list[ExpertWeights]) -> bool:
    """Whether the native kernels can run every layer's experts (types with a kernel, whole blocks, built)."""
    return bool(experts) and all(_kind(ew) for ew in experts)


class CpuMoE(MoEBackend):
    def __init__(self, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device | str = "cpu",
                 progress: bool = True):
        if not (native.available() or native_k.available()):
            raise ValueError(f"--moe-backend cpu needs the native kernels: {native_k.why_unavailable()}")
        if not supports(experts):
            kinds = sorted({w.qtype for ew in experts for w in (ew.gate_up, ew.down)})
            raise ValueError(f"--moe-backend cpu has no kernel for experts of type {', '.join(kinds)} "
                             f"(kernels: {', '.join(native_k.TYPES)}); use --moe-backend torch or offload")
        self.cfg = cfg
        self.device = torch.device(device)  # where inputs come from and results go (experts stay on the host)
        self.kinds = [_kind(ew) for ew in experts]
        prepare_native([w for ew, kd in zip(experts, self.kinds, strict=True) if kd == "q4"
                        for w in (ew.gate_up, ew.down)], progress)
        # per layer: (gate_up, down) as the layer's kernel reads them: interleaved [E, packed] uint8 (q4) or
        # the stored rows [E, N, row bytes] (k)
        self.weights = [(interleaved(ew.gate_up), interleaved(ew.down)) if kd == "q4"
                        else (ew.gate_up, ew.down) for ew, kd in zip(experts, self.kinds, strict=True)]

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
        xf, ids, w = x.to("cpu", torch.float32), topk_ids.cpu(), topk_weights.cpu()
        gu, dn = self.weights[layer]
        inter = self.cfg.moe_intermediate_size
        if self.kinds[layer] == "q4":
            y = native.moe(xf, gu, dn, inter, ids, w)
        else:
            y = native_k.moe(xf, gu.qtype, gu.data, dn.qtype, dn.data, inter, ids, w)
        return y.to(x.device, x.dtype)
