"""Fused MoE over stacked (Q4_0 / Q8_0 / float) expert weights with Triton.

The T * K (token, expert) assignments are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M (moe_align), so every row block of the sorted list belongs to one expert.
Kernel 1 computes gate and up for a block (grouped GEMM over the expert's [2I, H] weight,
dequantized in the kernel), applies gelu_tanh(gate) * up and stores the activation per
assignment; kernel 2 runs the down projection of the same blocks, scales by the routing weight
and stores per assignment; the K rows of each token are then summed in fp32. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.engine.config import ModelConfig
from swaserve.engine.fused.moe_kernels import align_on_device
from swaserve.engine.moe.base import ExpertWeights, MoEBackend
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.q4_repack import repack_weight
from swaserve.engine.quant.triton_q4 import (
    check_triton_device,
    dot_f32,
    load_w_tile_k,
    weight_format,
    weight_views,
)


@triton.jit
def _gate_up_kernel(
    x_ptr, wb_ptr, wh_ptr, act_ptr, sorted_ptr, block_e_ptr, eoff_ptr,
    num_assign, top_k, H, INTER, stride_xm, stride_we, stride_wn,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, INDIRECT: tl.constexpr,
):
    # INDIRECT: expert e's weight starts at byte eoff[e] from wb_ptr (a device cache slot, or the
    # expert in mapped host memory: engine/moe/offload_cache.py); else at e * stride_we
    # act: [T * K, I] in the activation dtype, row = assignment index t * K + k
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_e_ptr + pid_m)
    if e >= 0:
        ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM] assignment ids
        valid = ids < num_assign
        tok = (ids // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        if INDIRECT:  # offsets are multiples of 16 (16-byte rows, 64-byte host slices): vector loads stay
            base = tl.multiple_of(tl.load(eoff_ptr + e), 16)
        else:
            base = e.to(tl.int64) * stride_we
        gate_off = base + offs_n.to(tl.int64) * stride_wn  # rows [0, I): gate
        up_off = base + (offs_n + INTER).to(tl.int64) * stride_wn  # rows [I, 2I): up
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            x = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                        mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            wg = load_w_tile_k(wb_ptr, wh_ptr, gate_off, k0, H, H, n_mask, FMT, BLOCK_N, BLOCK_K)  # [BN, BK]
            wu = load_w_tile_k(wb_ptr, wh_ptr, up_off, k0, H, H, n_mask, FMT, BLOCK_N, BLOCK_K)
            if DOT_F32:
                xf = x.to(tl.float32)
                acc_g += tl.dot(xf, tl.trans(wg), input_precision="ieee")
                acc_u += tl.dot(xf, tl.trans(wu), input_precision="ieee")
            else:
                acc_g += tl.dot(x, tl.trans(wg.to(x.dtype)))
                acc_u += tl.dot(x, tl.trans(wu.to(x.dtype)))
        # gelu_tanh(g) = g * sigmoid(2 * sqrt(2 / pi) * (g + 0.044715 g^3))
        inner = 1.5957691216057308 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
        act = acc_g * tl.sigmoid(inner) * acc_u
        out = act_ptr + ids.to(tl.int64)[:, None] * INTER + offs_n[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, wb_ptr, wh_ptr, out_ptr, topw_ptr, sorted_ptr, block_e_ptr, eoff_ptr,
    num_assign, H, INTER, stride_we, stride_wn,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, INDIRECT: tl.constexpr,
):
    # out: [T * K, H] fp32, row = assignment index, already scaled by its routing weight
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_e_ptr + pid_m)
    if e >= 0:
        ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < num_assign
        rows = ids.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        if INDIRECT:
            w_off = tl.multiple_of(tl.load(eoff_ptr + e), 16) + offs_n.to(tl.int64) * stride_wn
        else:
            w_off = e.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < INTER
            a = tl.load(act_ptr + rows[:, None] * INTER + offs_k[None, :],
                        mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            w = load_w_tile_k(wb_ptr, wh_ptr, w_off, k0, INTER, INTER, n_mask, FMT, BLOCK_N, BLOCK_K)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        rw = tl.load(topw_ptr + ids, mask=valid, other=0.0).to(tl.float32)  # [BM]
        acc = acc * rw[:, None]
        out = out_ptr + rows[:, None] * H + offs_n[None, :]
        tl.store(out, acc, mask=valid[:, None] & n_mask[None, :])


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Intermediate buffers (tests replace this to poison them with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def moe_blocks(num_assign: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the grouped kernels: small row blocks while most
    experts see few tokens (decode), 64 once they average 64 or more (no spills on sm_90)."""
    return (16 if num_assign <= 64 * num_experts else 64), 64, 32, 8


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort assignments by expert, each expert's run padded to a multiple of block_m.

    Returns sorted_ids [NB * block_m] int32 (assignment index t * K + k, or T * K for padding)
    and block_expert [NB] int32 (the expert of each row block, -1 past the used blocks), with
    NB a static upper bound, so nothing waits for the device.
    """
    flat = topk_ids.reshape(-1)  # [TK]
    tk = flat.numel()
    dev = flat.device
    nb = tk // block_m + min(num_experts, tk) + 1
    aligned = align_on_device(flat, num_experts, block_m, nb)  # one launch (decode-sized batches)
    if aligned is not None:
        return aligned
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would sync on CUDA)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    pad_end = torch.cumsum(padded, 0)  # [E]
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # [TK]
    sorted_e = flat[order]  # [TK]
    dest = pad_start[sorted_e] + torch.arange(tk, device=dev) - cnt_start[sorted_e]  # [TK]
    sorted_ids = torch.full((nb * block_m,), tk, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(nb, device=dev) * block_m  # [NB]
    block_e = torch.searchsorted(pad_end, starts, right=True)  # [NB] first expert ending after start
    block_e = torch.where(block_e < num_experts, block_e, -1).to(torch.int32)
    return sorted_ids, block_e


def fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up: tuple[torch.Tensor, torch.Tensor, int],  # (bytes, fp16 view, kernel FMT) of [E, 2I, H]
    down: tuple[torch.Tensor, torch.Tensor, int],  # of [E, H, I]
    topk_ids: torch.Tensor,  # [T, K] expert index into the stacked weights
    topk_weights: torch.Tensor,  # [T, K]
    intermediate_size: int,  # I
    block_m: int | None = None,  # rows per block of the sorted assignments (None: by batch size)
    out_dtype: torch.dtype | None = None,  # None: x's dtype
    summed: bool = True,  # False: the weighted rows per assignment, [T, K, H] fp32 (a caller sums them)
    expert_offsets: tuple[torch.Tensor, torch.Tensor] | None = None,  # int64 [E] byte offsets per expert
) -> torch.Tensor:  # [T, H] in out_dtype
    """sum_k w_k * down_e(gelu_tanh(gate_e x) * up_e x) over stacked expert weights. With
    `expert_offsets` (gate_up's, down's), expert e's weights start eoff[e] bytes from the stacks'
    first bytes instead of at row e (the offload cache: a slot, or mapped host memory)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E = gate_up[0].shape[0] if expert_offsets is None else expert_offsets[0].shape[0]
    if T == 0:
        return torch.zeros_like(x, dtype=out_dtype or x.dtype) if summed else x.new_zeros(0, K, H).float()
    if x.stride(1) != 1:
        x = x.contiguous()
    bm, bn, bk, warps = moe_blocks(T * K, E)
    bm = block_m or bm
    sorted_ids, block_e = moe_align(topk_ids, E, bm)
    nb = block_e.numel()
    tk = T * K
    topw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [TK]
    f32 = dot_f32(x.dtype)
    gb, gh, gq = gate_up
    db, dh, dq = down
    inter = intermediate_size
    indirect = expert_offsets is not None
    g_off, d_off = expert_offsets if indirect else (block_e, block_e)  # (unused pointers when direct)
    act = empty(tk, inter, dtype=x.dtype, device=x.device)  # [TK, I]
    _gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        x, gb, gh, act, sorted_ids, block_e, g_off, tk, K, H, inter, x.stride(0), gb.stride(0), gb.stride(1),
        FMT=gq, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=f32, INDIRECT=indirect, num_warps=warps,
    )
    out = empty(tk, H, dtype=torch.float32, device=x.device)  # [TK, H]
    _down_kernel[(nb, triton.cdiv(H, bn))](
        act, db, dh, out, topw, sorted_ids, block_e, d_off, tk, H, inter, db.stride(0), db.stride(1),
        FMT=dq, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=f32, INDIRECT=indirect, num_warps=warps,
    )
    if not summed:
        return out.view(T, K, H)
    return out.view(T, K, H).sum(1).to(out_dtype or x.dtype)


def stacked_views(w: QWeight, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(bytes, fp16 view, kernel FMT) of a stacked expert weight [E, N, K] on `device`."""
    try:
        fmt = weight_format(w.qtype, w.layout)
    except KeyError:
        raise ValueError(f"{w.name}: no triton MoE kernel for weight type {w.qtype!r}") from None
    data = w.data.to(device)
    b, h = weight_views(data, w.qtype)
    assert b.dim() == 3 and b.stride(-1) == 1, (w.name, b.shape, b.stride())
    return b, h, fmt


def resident_experts(w: QWeight, device: torch.device) -> QWeight:
    """A stacked expert weight on `device`, Q4_0 repacked there for the vector-load tile path."""
    if w.data.device != device:
        w = QWeight(w.qtype, w.shape, w.data.to(device), w.name, layout=w.layout)
    return repack_weight(w)


class TritonMoE(MoEBackend):
    """All experts resident on the device; one fused gate_up + down pass per layer."""

    graph_safe = True  # no host work in forward: a decode step can be captured (engine/runner/cuda_graphs.py)

    def __init__(self, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device | str = "cuda",
                 block_m: int | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        check_triton_device(self.device, "the triton MoE backend")
        self.intermediate_size = cfg.moe_intermediate_size
        self.block_m = block_m  # rows per block of the sorted assignments (None: by batch size)
        self.gate_up = [stacked_views(resident_experts(ew.gate_up, self.device), self.device)
                        for ew in experts]  # [E, 2I, H] per layer
        self.down = [stacked_views(resident_experts(ew.down, self.device), self.device)
                     for ew in experts]  # [E, H, I] per layer

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        topk_weights: torch.Tensor,  # [T, K]
    ) -> torch.Tensor:  # [T, H]
        return fused_moe(x, self.gate_up[layer], self.down[layer], topk_ids, topk_weights,
                         self.intermediate_size, self.block_m)

    def forward_unsummed(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                         ) -> torch.Tensor:  # [T, K, H] fp32 weighted expert rows: the fused tail sums them
        return fused_moe(x, self.gate_up[layer], self.down[layer], topk_ids, topk_weights,
                         self.intermediate_size, self.block_m, summed=False)
