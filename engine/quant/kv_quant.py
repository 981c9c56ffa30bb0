"""K/V rows to and from the pool's storage types (engine/attention/kv_format.py), in torch.

q8_0 follows llama.cpp's reference quantizer (ggml-quants.c quantize_row_q8_0_ref, bit-exact with
gguf.quants): per 32 values d = amax / 127 (fp32), q = roundf(x * (1 / d)) (half away from zero), d
stored as fp16; x = fp16(d) * q, exact in fp32. fp8_e4m3: scale 1.0, clamped to +-448 (the type's
largest finite value) before the cast. Float types: a plain cast.
"""

from __future__ import annotations

import torch

from swaserve.engine.attention.kv_format import Q8_BLOCK, Q8_BLOCK_BYTES
from swaserve.engine.quant.blocks_legacy import decode_q8_0

FP8_MAX = 448.0


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero) in x's dtype, exactly (no x + 0.5 rounding step)."""
    a = x.abs()
    fl = a.floor()
    return (fl + (2 * (a - fl)).floor()).copysign_(x)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a multiple of 32) -> q8_0 blocks uint8 [..., D / 32 * 34]."""
    *lead, dim = x.shape
    if x.numel() == 0:
        return torch.empty(*lead, dim // Q8_BLOCK * Q8_BLOCK_BYTES, dtype=torch.uint8, device=x.device)
    xb = x.reshape(-1, Q8_BLOCK).float()  # [nb, 32]
    d = xb.abs().amax(1, keepdim=True) / 127  # [nb, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = roundf(xb * inv).to(torch.int8)  # [nb, 32] in -127..127
    out = torch.empty(xb.shape[0], Q8_BLOCK_BYTES, dtype=torch.uint8, device=x.device)  # [nb, 34]
    out[:, :2] = d.to(torch.float16).view(torch.uint8)
    out[:, 2:] = q.view(torch.uint8)
    return out.view(*lead, dim // Q8_BLOCK * Q8_BLOCK_BYTES)


def dequantize_q8_0(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q8_0 blocks uint8 [..., nb * 34] -> values [..., nb * 32] in `dtype` (computed in fp32)."""
    *lead, nbytes = blocks.shape
    flat = blocks.reshape(-1, Q8_BLOCK_BYTES)  # [nb, 34]
    out = decode_q8_0(flat).view(*lead, nbytes // Q8_BLOCK_BYTES * Q8_BLOCK)  # fp32
    return out if dtype == torch.float32 else out.to(dtype)


def encode(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Values x [..., D] as the pool stores them in a view of dtype `storage` (uint8: q8_0)."""
    if storage == torch.uint8:
        return quantize_q8_0(x)
    if storage == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(storage)
    return x.to(storage)


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows [..., R] (a view's dtype says the type; uint8: q8_0) -> values [..., D] in `dtype`."""
    if rows.dtype == torch.uint8:
        return dequantize_q8_0(rows, dtype)
    return rows.to(dtype)


def head_dim(rows: torch.Tensor) -> int:
    """Values per head row of a pool view [..., R] (R bytes of q8_0 blocks, or R elements)."""
    r = rows.shape[-1]
    return r // Q8_BLOCK_BYTES * Q8_BLOCK if rows.dtype == torch.uint8 else r
