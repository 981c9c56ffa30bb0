"""tools/gpu_check/run.py rows for the Triton kernels of every GGUF block type beyond Q4_0 (Q4_1, Q5_0,
Q5_1, Q8_0, IQ4_NL, Q2_K..Q6_K, IQ4_XS): the linear GEMV/GEMM at projection shapes, and the fused MoE
with the (gate_up, down) type pairs llama.cpp's mixes write for gemma-4-26B-A4B (its experts' down
projection has 704 columns, so a K-type mix stores it in the type's 32-weight fallback).

Weights are random blocks of the type (models/demo/random_blocks.py), made on the host and copied over;
errors are against a bf16 / fp32 torch matmul on the dequantized weights (engine/quant/dequant.py,
exact to gguf), timings against bf16 F.linear / the torch expert loop on those weights.
"""

from __future__ import annotations

from typing import Any

LINEAR_TYPES = ("Q8_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# (gate_up type, down type) of the experts under Q4_K_M, Q5_K_M, Q6_K (and Q4_K_M's more-bits layers),
# IQ4_XS files
MOE_PAIRS = (("Q4_K", "Q5_0"), ("Q5_K", "Q5_1"), ("Q6_K", "Q8_0"), ("IQ4_XS", "IQ4_NL"))


def rand_qweight(c: Any, qtype: str, shape: tuple[int, ...], seed: int = 0):
    """Random stored `qtype` weight of `shape` on the device; weights of std ~ 1/sqrt(K)."""
    import numpy as np

    from swaserve.engine.quant.base import QWeight
    from swaserve.models.demo.random_blocks import random_blocks

    raw = random_blocks(qtype, shape, shape[-1] ** -0.5, np.random.default_rng(seed))
    return QWeight(qtype, tuple(shape), c.torch.from_numpy(raw).to(c.dev), f"rand.{qtype}")


def check_qtype_linear(c: Any, row: Any, qtype: str, name: str, N: int, K: int, M: int) -> list:
    """One row: the Triton linear of a `qtype` weight [N, K] at M rows vs bf16 F.linear on its
    dequantization."""
    from swaserve.engine.quant.triton_q4 import quant_linear

    w = rand_qweight(c, qtype, (N, K))
    bpw = 8 * w.data.nbytes / (N * K)
    return [row.linear_row(c, w, M, quant_linear, qtype.lower(), name,
                           f"{bpw:.2f} bits/weight; torch = bf16 mm on dequantized W")]


def check_qtype_moe(c: Any, row: Any, gate_up_type: str, down_type: str, T: int) -> list:
    """One row: the fused MoE over `gate_up_type` / `down_type` experts vs the bf16 torch expert loop."""
    from swaserve.engine.moe.base import ExpertWeights
    from swaserve.engine.moe.triton_backend import TritonMoE
    from swaserve.engine.quant.dequant import dequantize

    torch = c.torch
    S = c.shapes
    experts, hidden, inter = S.quant_moe
    layer = ExpertWeights(gate_up=rand_qweight(c, gate_up_type, (experts, 2 * inter, hidden)),
                          down=rand_qweight(c, down_type, (experts, hidden, inter), seed=1))
    cfg = row.shape_cfg(S, ("full",), experts=experts, hidden=hidden, inter=inter)
    moe = TritonMoE(cfg, [layer], c.dev)
    gu = dequantize(layer.gate_up).to(torch.bfloat16)
    dn = dequantize(layer.down).to(torch.bfloat16)
    x = torch.randn(T, hidden, device=c.dev, dtype=torch.bfloat16, generator=c.gen)
    scores = torch.rand(T, experts, device=c.dev, generator=c.gen)
    w, ids = torch.topk(scores, S.top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    y = moe.forward(0, x, ids, w)
    err = row.rel_err(y, row.moe_ref(x, gu, dn, ids, w, inter))
    ms = c.time_ms(lambda: moe.forward(0, x, ids, w))
    ref_ms = c.time_ms(lambda: row.moe_ref(x, gu, dn, ids, w, inter))
    per_expert = layer.gate_up.data[0].nbytes + layer.down.data[0].nbytes
    used = int(torch.unique(ids).numel())
    rate = c.bw(used * per_expert + 2 * x.nbytes, ms) if T <= 64 else \
        c.flops(2 * T * S.top_k * 3 * inter * hidden, ms)
    shape = f"E{experts} top{S.top_k} H{hidden} I{inter}"
    return [row.Row(f"moe fused {gate_up_type}/{down_type} T={T}", shape, row.status(err, 3e-2, y), err, ms,
                    ref_ms, rate, f"{used} experts used")]


def plan(c: Any, row: Any) -> list[tuple[str, Any]]:
    """(name, check) entries for the driver of tools/gpu_check/run.py."""
    S = c.shapes
    out: list[tuple[str, Any]] = []
    rows_per_proj = (1,) if c.quick else (1, 8, S.gemm_rows)
    for qtype in LINEAR_TYPES:
        for name, N, K in S.quant_projections[:1] if c.quick else S.quant_projections:
            for M in rows_per_proj:
                out.append((f"{qtype} {name} M={M}",
                            lambda q=qtype, n=name, N=N, K=K, M=M: check_qtype_linear(c, row, q, n, N, K, M)))
    for gu, dn in MOE_PAIRS:
        for T in S.moe_tokens[:1] if c.quick else S.moe_tokens:
            out.append((f"moe {gu}/{dn} T={T}", lambda gu=gu, dn=dn, T=T: check_qtype_moe(c, row, gu, dn, T)))
    return out
