"""Triton linears that dequantize GGUF weights inside the kernel (y = x @ W^T), for every stored type.

The weight stays in its stored form: uint8 [N, K / E * B] (blocks of E weights in B bytes, in GGUF
order) for the block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; Q2_K..Q6_K, IQ4_XS), or a float
tensor [N, K]. The tile decoder `load_w_tile` (engine/quant/triton_blocks.py) reads fp16 scales
through an fp16 view of the same bytes (blocks and rows have even byte sizes). Few rows (decode)
run a split-K GEMV with fp32 partials; more rows run a tiled GEMM on tl.dot. `load_w_tile` is
shared with the fused MoE.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.triton_blocks import (  # noqa: F401  (re-exported for the fused MoE)
    FMT_FLOAT,
    FMT_Q4_0,
    FMT_Q8_0,
    WEIGHT_FORMATS,
    block_elems,
    load_w_tile,
    load_w_tile_k,
    weight_format,
)

GEMV_MAX_ROWS = 4  # rows up to which the GEMV kernel is used


@triton.jit
def _gemm_kernel(
    x_ptr, wb_ptr, wh_ptr, y_ptr, M, N, K, stride_xm, stride_ym, stride_wn,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    row_off = offs_n.to(tl.int64) * stride_wn
    x_rows = offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = load_w_tile_k(wb_ptr, wh_ptr, row_off, k0, K, K, n_mask, FMT, BLOCK_N, BLOCK_K)  # [BN, BK]
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, wb_ptr, wh_ptr, part_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # part: [splits, M, N] fp32 partial sums over this program's K range
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    row_off = offs_n.to(tl.int64) * stride_wn
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        w = load_w_tile_k(wb_ptr, wh_ptr, row_off, k0, K, k_hi, n_mask, FMT, BLOCK_N, BLOCK_K)  # [BN, BK]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = part_ptr + (split * M + offs_m)[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(device: torch.device, what: str) -> None:
    """Raise ValueError when Triton kernels cannot run on `device`."""
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{what} needs a CUDA device (or TRITON_INTERPRET=1 for the slow CPU "
                         f"interpreter); got device {device}")


def dot_f32(dtype: torch.dtype) -> bool:
    """Upcast dot operands to fp32: for fp32 operands, and for bf16 in the interpreter (its bf16 dot
    is wrong; fp16 is right there, so fp16 runs the GPU code path on CPU too)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def weight_views(data: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes, fp16 view of the same memory) of stored weight rows; float weights: (data, data)."""
    if WEIGHT_FORMATS[qtype] == FMT_FLOAT:
        return data, data
    if data.stride(-1) != 1 or data.storage_offset() % 2 or data.shape[-1] % 2:
        data = data.contiguous().clone()
    try:
        return data, data.view(torch.float16)
    except RuntimeError:  # odd strides of a sliced view: copy to a fresh, aligned buffer
        data = data.clone()
        return data, data.view(torch.float16)


def _views(w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    cached = w.cache.triton_views  # (source tensor, bytes, fp16 view)
    if cached is None or cached[0] is not w.data:
        cached = w.cache.triton_views = (w.data, *weight_views(w.data, w.qtype))
    return cached[1], cached[2]


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, numel, splits, BLOCK: tl.constexpr):
    # y[i] = sum_s part[s, i] in fp32, stored in y's dtype   part [splits, numel], y [numel]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=m)


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output/partial buffers (tests replace this to poison them with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def gemv_blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the GEMV kernel for m <= GEMV_MAX_ROWS rows."""
    return triton.next_power_of_2(m), 16, 128 if m <= 2 else 64


def gemm_blocks(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the GEMM kernel for m rows (no spills on sm_90)."""
    if m <= 16:
        return 16, 64, 32, 4
    if m <= 32:
        return 32, 64, 64, 8
    if m <= 64:
        return 64, 64, 64, 8
    return 128, 64, 32, 8


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def quant_linear(x: torch.Tensor, w: QWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] for a 2-D QWeight of any WEIGHT_FORMATS type on the kernel's device."""
    if w.qtype not in WEIGHT_FORMATS:
        raise ValueError(f"{w.name}: no triton kernel for weight type {w.qtype!r}")
    assert len(w.shape) == 2, f"{w.name}: triton linear needs a 2-D weight, got {w.shape}"
    N, K = w.shape
    assert x.shape[-1] == K and K % block_elems(w.qtype) == 0, (w.name, x.shape, w.shape)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    wb, wh = _views(w)
    fmt = weight_format(w.qtype, w.layout)
    stride_wn = wb.stride(0)
    if M == 0:
        return torch.empty(*lead, N, dtype=out_dtype, device=x.device)
    if M <= GEMV_MAX_ROWS:
        bm, bn, bk = gemv_blocks(M)
        grid_n = triton.cdiv(N, bn)
        splits = max(1, min(4 * _num_sms(x.device) // grid_n, triton.cdiv(K, bk)))
        k_per_split = triton.cdiv(triton.cdiv(K, splits), bk) * bk
        splits = triton.cdiv(K, k_per_split)
        part = empty(splits, M, N, dtype=torch.float32, device=x.device)
        _gemv_kernel[(grid_n, splits)](
            x2, wb, wh, part, M, N, K, k_per_split, x2.stride(0), stride_wn,
            FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
        )
        y = empty(M, N, dtype=out_dtype, device=x.device)
        _split_sum_kernel[(triton.cdiv(M * N, 1024),)](part, y, M * N, splits, BLOCK=1024)  # sum + cast
        return y.reshape(*lead, N)
    y = empty(M, N, dtype=out_dtype, device=x.device)
    bm, bn, bk, warps = gemm_blocks(M)
    _gemm_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x2, wb, wh, y, M, N, K, x2.stride(0), y.stride(0), stride_wn,
        FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dot_f32(x.dtype), num_warps=warps,
    )
    return y.reshape(*lead, N)


def q4_0_linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [..., K] @ W^T for a Q4_0 weight [N, K], dequantized in the kernel."""
    assert w.qtype == "Q4_0", w.qtype
    return quant_linear(x, w)


def q8_0_linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [..., K] @ W^T for a Q8_0 weight [N, K], dequantized in the kernel."""
    assert w.qtype == "Q8_0", w.qtype
    return quant_linear(x, w)
