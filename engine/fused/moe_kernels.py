"""Triton kernels of the MoE front: router (linear + softmax + top-k + renormalise + per-expert
scale), the dense MLP's gelu_tanh(gate) * up, and the device-side token alignment.

Shapes: T tokens, H hidden, E experts (a power of two), K experts per token, TK = T * K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_MAX_ASSIGNMENTS = 1024  # one program sorts up to this many (token, expert) pairs


@triton.jit
def router_kernel(x_ptr, w_ptr, pes_ptr, ids_ptr, wout_ptr, H, E: tl.constexpr, K: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    # x [T, H] fp32 (normed, scaled), w [E, H] fp32, pes [E] -> ids [T, K] int64, weights [T, K] fp32:
    # p = softmax(w x); top K of p (lowest index first on ties), renormalised, times pes[id]
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    acc = tl.zeros([E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hm = hh < H
        x = tl.load(x_ptr + t * H + hh, mask=hm, other=0.0)  # [BH]
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * H + hh[None, :], mask=hm[None, :], other=0.0)  # [E, BH]
        acc += tl.sum(w * x[None, :], axis=1)
    p = tl.exp(acc - tl.max(acc, axis=0))
    p = p / tl.sum(p, axis=0)  # [E]
    k = tl.arange(0, K)
    top_p = tl.zeros([K], dtype=tl.float32)
    top_i = tl.zeros([K], dtype=tl.int32)
    for j in tl.static_range(K):
        m = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == m, e, E), axis=0)
        top_p = tl.where(k == j, m, top_p)
        top_i = tl.where(k == j, idx, top_i)
        p = tl.where(e == idx, -1.0, p)
    top_p = top_p / tl.sum(top_p, axis=0) * tl.load(pes_ptr + top_i)
    tl.store(ids_ptr + t * K + k, top_i.to(tl.int64))
    tl.store(wout_ptr + t * K + k, top_p)


@triton.jit
def gelu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    # out[t] = gelu_tanh(g[t]) * u[t] over N columns (g, u may be halves of one [T, 2N] buffer)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    # gelu_tanh(g) = g * sigmoid(2 * sqrt(2 / pi) * (g + 0.044715 g^3))
    y = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) * u
    tl.store(out_ptr + t * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def moe_align_kernel(ids_ptr, sorted_ptr, block_e_ptr, TK, NB, E: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_TK: tl.constexpr, BLOCK_NB: tl.constexpr):
    # One program. sorted [NB * BLOCK_M] int32: the assignment ids grouped by expert (stable), each
    # expert's run padded to a multiple of BLOCK_M with TK; block_e [NB]: expert of each row block
    # (-1 past the used blocks). Same layout as moe_backend.moe_align's torch version.
    i = tl.arange(0, BLOCK_TK)
    valid = i < TK
    e = tl.load(ids_ptr + i, mask=valid, other=E).to(tl.int32)  # [BTK]; padding sorts last
    keys = tl.sort(e * BLOCK_TK + i)  # stable by construction: ties broken by assignment id
    se = tl.minimum(keys // BLOCK_TK, E - 1)
    sa = keys % BLOCK_TK  # assignment id at sorted position i
    counts = tl.histogram(e, E, mask=valid)  # [E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = tl.cumsum(counts, 0) - counts
    dest = tl.gather(pad_start, se, 0) + i - tl.gather(cnt_start, se, 0)  # [BTK]
    for r0 in range(0, NB * BLOCK_M, BLOCK_TK):  # padding rows first
        r = r0 + i
        tl.store(sorted_ptr + r, tl.full([BLOCK_TK], 0, tl.int32) + TK, mask=r < NB * BLOCK_M)
    tl.debug_barrier()
    tl.store(sorted_ptr + dest, sa, mask=valid)
    for b0 in range(0, NB, BLOCK_NB):  # BLOCK_NB blocks at a time: a [BLOCK_NB, E] compare stays small
        b = b0 + tl.arange(0, BLOCK_NB)
        before = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # [BNB]
        tl.store(block_e_ptr + b, tl.where(before < E, before, -1), mask=b < NB)


def align_on_device(topk_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sorted_ids [NB * block_m], block_expert [NB]) int32 in one launch, or None when the shape
    is outside the one-program kernel (too many assignments, E not a power of two)."""
    flat = topk_ids.reshape(-1)
    tk = flat.numel()
    if tk > ALIGN_MAX_ASSIGNMENTS or num_experts & (num_experts - 1) or tk == 0:
        return None
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_e = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    moe_align_kernel[(1,)](flat, sorted_ids, block_e, tk, num_blocks, E=num_experts, BLOCK_M=block_m,
                           BLOCK_TK=max(16, triton.next_power_of_2(tk)), BLOCK_NB=16, num_warps=4)
    return sorted_ids, block_e
