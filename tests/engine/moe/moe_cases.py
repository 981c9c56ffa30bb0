"""Random MoE layers and routings shared by the triton and offload MoE tests."""

from __future__ import annotations

import os
import random

import torch
import torch.nn.functional as F

from swaserve.engine.config import ModelConfig
from swaserve.engine.moe.base import ExpertWeights
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize


def new_seed() -> int:
    return int(os.environ.get("SWASERVE_TEST_SEED", random.randrange(2**31)))


def make_cfg(num_experts: int, top_k: int, hidden: int, inter: int, num_layers: int = 1) -> ModelConfig:
    return ModelConfig(
        vocab_size=16, hidden_size=hidden, num_layers=num_layers, num_heads=2,
        layer_types=("full",) * num_layers, head_dim_swa=16, head_dim_full=16, num_kv_heads_swa=1,
        num_kv_heads_full=1, sliding_window=4, intermediate_size=8, moe_intermediate_size=inter,
        num_experts=num_experts, top_k_experts=top_k,
    )


def random_qweight(g: torch.Generator, qtype: str, shape: tuple[int, ...]) -> QWeight:
    """Random stored weight: Q4_0/Q8_0 blocks with fp16 scales of magnitude [1e-3, 2e-2] and random
    codes (Q8_0 scales / 16), or a float tensor (F32/F16/BF16) of std 0.05."""
    if qtype in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return QWeight(qtype, tuple(shape), (torch.randn(*shape, generator=g) * 0.05).to(dt))
    *lead, n, k = shape
    nb = k // 32
    d = torch.rand(*lead, n, nb, 1, generator=g) * 0.019 + 0.001
    d = d * (torch.randint(0, 2, d.shape, generator=g) * 2 - 1)
    if qtype == "Q8_0":
        d = d / 16  # int8 codes are 16x larger than Q4_0's: keep weights of similar size
    nq = 16 if qtype == "Q4_0" else 32
    qs = torch.randint(0, 256, (*lead, n, nb, nq), generator=g, dtype=torch.uint8)
    data = torch.cat([d.half().view(torch.uint8), qs], dim=-1).reshape(*lead, n, -1).contiguous()
    return QWeight(qtype, tuple(shape), data, f"test.{qtype}")


def make_layers(g: torch.Generator, qtype: str, n_layers: int, e: int, hidden: int, inter: int):
    """The expert weights the MoE backends read, one ExpertWeights per layer."""
    return [ExpertWeights(gate_up=random_qweight(g, qtype, (e, 2 * inter, hidden)),
                          down=random_qweight(g, qtype, (e, hidden, inter)))
            for _ in range(n_layers)]


def routing(g: torch.Generator, t: int, e: int, k: int, skew: bool = False):
    """(x [T, H]-less ids [T, K] int64 distinct per token, weights [T, K] fp32). With skew, most
    tokens pick from the first k + 1 experts (long runs crossing several row blocks)."""
    pool = k + 1 if skew else e
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(t, k, generator=g) + 0.05
    return ids, w


def dense_moe(layer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act_dtype: torch.dtype):
    """float64 per-token loop on the dequantized experts; the activation is rounded to act_dtype
    like the kernels store it. [T, H] float64."""
    gu_all = dequantize(layer.gate_up).double()  # [E, 2I, H]
    down_all = dequantize(layer.down).double()  # [E, H, I]
    inter = down_all.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = gu_all[e] @ x[t].double()
            h = (F.gelu(gu[:inter], approximate="tanh") * gu[inter:]).to(act_dtype).double()
            out[t] += w[t, j].double() * (down_all[e] @ h)
    return out


# The offload backend's device paths: emulated on CPU tensors (Triton interpreter) without a GPU, the
# real CUDA path (events, side stream, mapped host memory) with one; tests pick both consistently
OFFLOAD_DEV = "cuda" if torch.cuda.is_available() else "cpu"
OFFLOAD_EMULATE = not torch.cuda.is_available()


def on_offload_dev(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(OFFLOAD_DEV) for t in ts)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
