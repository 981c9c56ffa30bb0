"""Triton decoding of GGUF blocks inside a matmul: `load_w_tile` returns the fp32 weight tile of any
stored type, element by element from the raw block bytes (the layouts of engine/quant/blocks_legacy.py
and blocks_k.py). Used by the linear kernels (engine/quant/triton_q4.py) and the fused MoE
(engine/moe/triton_backend.py), which pick the type with the FMT constexpr.

Every tile element (row r, column k) reads the bytes it needs: its block's fp16 scale(s) through an
fp16 view `wh` of the same memory (every block size and field offset is even), its sub-block scale
byte(s) and its code bits. Scale reads repeat across a block's weights and are served by the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_FLOAT, FMT_Q4_0, FMT_Q8_0 = 0, 1, 2
FMT_Q4_1, FMT_Q5_0, FMT_Q5_1, FMT_IQ4_NL = 3, 4, 5, 6
FMT_Q2_K, FMT_Q3_K, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_IQ4_XS = 7, 8, 9, 10, 11, 12
FMT_Q4_0_PAIRS = 13  # Q4_0 repacked at load (engine/quant/q4_repack.py): read by load_w_tile_k
# qtype -> the kernels' FMT constexpr
WEIGHT_FORMATS = {
    "F32": FMT_FLOAT, "F16": FMT_FLOAT, "BF16": FMT_FLOAT, "Q4_0": FMT_Q4_0, "Q8_0": FMT_Q8_0,
    "Q4_1": FMT_Q4_1, "Q5_0": FMT_Q5_0, "Q5_1": FMT_Q5_1, "IQ4_NL": FMT_IQ4_NL, "Q2_K": FMT_Q2_K,
    "Q3_K": FMT_Q3_K, "Q4_K": FMT_Q4_K, "Q5_K": FMT_Q5_K, "Q6_K": FMT_Q6_K, "IQ4_XS": FMT_IQ4_XS,
}


@triton.jit
def _byte(wb_ptr, off, mask):
    return tl.load(wb_ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(wh_ptr, off, mask):
    return tl.load(wh_ptr + off // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _nibble(wb_ptr, base, j, mask):
    """4-bit code of weight j of a 32-weight block whose 16 code bytes start at `base`."""
    return (_byte(wb_ptr, base + j % 16, mask) >> ((j // 16) * 4)) & 0xF


@triton.jit
def _q5_high(wb_ptr, base, j, mask):
    """Bit j of the 4-byte little-endian qh at `base`."""
    return (_byte(wb_ptr, base + j // 8, mask) >> (j % 8)) & 1


@triton.jit
def _iq4_level(c):
    """IQ4 level of 4-bit codes c: -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
    113 (a select tree on the code's bits; Triton has no constant tables)."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    b2 = (c & 4) != 0
    lo = tl.where(b2, tl.where(b1, tl.where(b0, -10, -22), tl.where(b0, -35, -49)),
                  tl.where(b1, tl.where(b0, -65, -83), tl.where(b0, -104, -127)))
    hi = tl.where(b2, tl.where(b1, tl.where(b0, 113, 89), tl.where(b0, 69, 53)),
                  tl.where(b1, tl.where(b0, 38, 25), tl.where(b0, 13, 1)))
    return tl.where((c & 8) != 0, hi, lo).to(tl.float32)


@triton.jit
def _k_scale_min(wb_ptr, base, s, mask):
    """6-bit (scale, min) of sub-block s (0..7) of a Q4_K / Q5_K block at `base` (scales at + 4)."""
    t = s % 4
    lo = _byte(wb_ptr, base + 4 + t, mask)
    mid = _byte(wb_ptr, base + 8 + t, mask)
    hi = _byte(wb_ptr, base + 12 + t, mask)
    sc = tl.where(s < 4, lo & 63, (hi & 0xF) | ((lo >> 6) << 4))
    mn = tl.where(s < 4, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode(wb_ptr, wh_ptr, base, j, mask, FMT: tl.constexpr):
    """fp32 weight j of the block at byte offset `base` (both [BN, BK]) of format FMT."""
    if FMT == 1:  # Q4_0
        w = (_nibble(wb_ptr, base + 2, j, mask) - 8).to(tl.float32) * _half(wh_ptr, base, mask)
    elif FMT == 2:  # Q8_0
        q = tl.load(wb_ptr + base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _half(wh_ptr, base, mask)
    elif FMT == 3:  # Q4_1
        q = _nibble(wb_ptr, base + 4, j, mask).to(tl.float32)
        w = _half(wh_ptr, base, mask) * q + _half(wh_ptr, base + 2, mask)
    elif FMT == 4:  # Q5_0
        q = _nibble(wb_ptr, base + 6, j, mask) | (_q5_high(wb_ptr, base + 2, j, mask) << 4)
        w = (q - 16).to(tl.float32) * _half(wh_ptr, base, mask)
    elif FMT == 5:  # Q5_1
        q = (_nibble(wb_ptr, base + 8, j, mask) | (_q5_high(wb_ptr, base + 4, j, mask) << 4)).to(tl.float32)
        w = _half(wh_ptr, base, mask) * q + _half(wh_ptr, base + 2, mask)
    elif FMT == 6:  # IQ4_NL
        w = _iq4_level(_nibble(wb_ptr, base + 2, j, mask)) * _half(wh_ptr, base, mask)
    elif FMT == 7:  # Q2_K: 16 sub-blocks of 16
        sc = _byte(wb_ptr, base + j // 16, mask)
        dl = _half(wh_ptr, base + 80, mask) * (sc & 0xF).to(tl.float32)
        ml = _half(wh_ptr, base + 82, mask) * (sc >> 4).to(tl.float32)
        q = (_byte(wb_ptr, base + 16 + (j // 128) * 32 + j % 32, mask) >> (2 * ((j % 128) // 32))) & 3
        w = dl * q.to(tl.float32) - ml
    elif FMT == 8:  # Q3_K: 16 sub-blocks of 16, 6-bit scales minus 32
        s = j // 16
        low = (_byte(wb_ptr, base + 96 + s % 8, mask) >> (4 * (s // 8))) & 0xF
        high = (_byte(wb_ptr, base + 104 + s % 4, mask) >> (2 * (s // 4))) & 3
        dl = _half(wh_ptr, base + 108, mask) * ((low | (high << 4)) - 32).to(tl.float32)
        ql = (_byte(wb_ptr, base + 32 + (j // 128) * 32 + j % 32, mask) >> (2 * ((j % 128) // 32))) & 3
        hbit = (_byte(wb_ptr, base + j % 32, mask) >> (j // 32)) & 1
        w = dl * (ql - 4 * (1 - hbit)).to(tl.float32)
    elif FMT == 9 or FMT == 10:  # Q4_K / Q5_K: 8 sub-blocks of 32 with scale and min
        sc, mn = _k_scale_min(wb_ptr, base, j // 32, mask)
        if FMT == 9:
            q = (_byte(wb_ptr, base + 16 + (j // 64) * 32 + j % 32, mask) >> (4 * ((j % 64) // 32))) & 0xF
        else:
            q = (_byte(wb_ptr, base + 48 + (j // 64) * 32 + j % 32, mask) >> (4 * ((j % 64) // 32))) & 0xF
            q = q | (((_byte(wb_ptr, base + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
        dl = _half(wh_ptr, base, mask) * sc
        ml = _half(wh_ptr, base + 2, mask) * mn
        w = dl * q.to(tl.float32) - ml
    elif FMT == 11:  # Q6_K: 16 sub-blocks of 16, int8 scales
        sc = tl.load(wb_ptr + base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        dl = _half(wh_ptr, base + 208, mask) * sc.to(tl.float32)
        ql = (_byte(wb_ptr, base + (j // 128) * 64 + j % 64, mask) >> (4 * ((j % 128) // 64))) & 0xF
        qh = (_byte(wb_ptr, base + 128 + (j // 128) * 32 + j % 32, mask) >> (2 * ((j % 128) // 32))) & 3
        w = dl * ((ql | (qh << 4)) - 32).to(tl.float32)
    else:  # 12, IQ4_XS: 8 sub-blocks of 32, 6-bit scales minus 32
        s = j // 32
        high = (_byte(wb_ptr, base + 2 + s // 4, mask) >> (2 * (s % 4))) & 3
        low = (_byte(wb_ptr, base + 4 + s // 2, mask) >> (4 * (s % 2))) & 0xF
        dl = _half(wh_ptr, base, mask) * ((low | (high << 4)) - 32).to(tl.float32)
        c = (_byte(wb_ptr, base + 8 + s * 16 + j % 16, mask) >> (4 * ((j % 32) // 16))) & 0xF
        w = dl * _iq4_level(c)
    return w


@triton.jit
def load_w_tile(wb_ptr, wh_ptr, row_off, offs_k, n_mask, k_mask, FMT: tl.constexpr):
    """Dequantized fp32 weight tile [BN, BK]: rows at byte offsets `row_off` [BN] (int64; element
    offsets for FMT_FLOAT), columns `offs_k` [BK]. `wh_ptr` is an fp16 view of the same bytes."""
    mask = n_mask[:, None] & k_mask[None, :]
    rows = row_off[:, None]
    if FMT == 0:
        w = tl.load(wb_ptr + rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        if FMT == 1 or FMT == 6:
            elems, nbytes = 32, 18
        elif FMT == 2:
            elems, nbytes = 32, 34
        elif FMT == 3:
            elems, nbytes = 32, 20
        elif FMT == 4:
            elems, nbytes = 32, 22
        elif FMT == 5:
            elems, nbytes = 32, 24
        elif FMT == 7:
            elems, nbytes = 256, 84
        elif FMT == 8:
            elems, nbytes = 256, 110
        elif FMT == 9:
            elems, nbytes = 256, 144
        elif FMT == 10:
            elems, nbytes = 256, 176
        elif FMT == 11:
            elems, nbytes = 256, 210
        else:
            elems, nbytes = 256, 136
        base = rows + ((offs_k // elems) * nbytes)[None, :]  # [BN, BK] byte offset of each weight's block
        w = _decode(wb_ptr, wh_ptr, base, (offs_k % elems)[None, :], mask, FMT)
    return w


@triton.jit
def _load_q4_0_pairs(wb_ptr, wh_ptr, row_off, k0, row_k, k_hi, n_mask,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 tile [BN, BK] of columns [k0, k0 + BK) of a Q4_0_PAIRS weight (BK a multiple of 32, k0 and
    k_hi multiples of 32): one contiguous run of BK / 2 code bytes per row (16-byte-aligned rows:
    vector loads) and BK / 32 fp16 scales from the row's scale run at byte row_k / 2."""
    offs_p = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # code bytes of the tile in each row
    # the K mask per 16-byte block (k0, k_hi multiples of 32): constant over a vector's bytes
    p_ok = (offs_p // 16) * 32 < k_hi
    b = tl.load(wb_ptr + row_off[:, None] + offs_p[None, :],
                mask=n_mask[:, None] & p_ok[None, :], other=0)  # [BN, BK / 2] uint8
    lo = (b & 0xF).to(tl.int32) - 8  # element 2p
    hi = (b >> 4).to(tl.int32) - 8  # element 2p + 1
    q = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)).to(tl.float32)  # [BN, BK] in element order
    offs_b = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    d = tl.load(wh_ptr + ((row_off + row_k // 2) // 2)[:, None] + offs_b[None, :],
                mask=n_mask[:, None] & (offs_b * 32 < k_hi)[None, :], other=0.0).to(tl.float32)
    w = tl.reshape(q, (BLOCK_N, BLOCK_K // 32, 32)) * d[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def load_w_tile_k(wb_ptr, wh_ptr, row_off, k0, row_k, k_hi, n_mask, FMT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The kernels' weight tile [BN, BK] of columns [k0, k0 + BK) (masked at k_hi) of rows at byte
    offsets `row_off` (rows of `row_k` weights): load_w_tile for the GGUF layouts, the vector-load
    path for FMT_Q4_0_PAIRS."""
    if FMT == 13:
        w = _load_q4_0_pairs(wb_ptr, wh_ptr, row_off, k0, row_k, k_hi, n_mask, BLOCK_N, BLOCK_K)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = load_w_tile(wb_ptr, wh_ptr, row_off, offs_k, n_mask, offs_k < k_hi, FMT)
    return w


def weight_format(qtype: str, layout: str = "") -> int:
    """The kernels' FMT constexpr of a weight (its stored type and layout)."""
    if layout:
        if layout != "q4_0_pairs" or qtype != "Q4_0":
            raise ValueError(f"no triton kernel for the {layout!r} layout of {qtype}")
        return FMT_Q4_0_PAIRS
    return WEIGHT_FORMATS[qtype]


def block_elems(qtype: str) -> int:
    """Weights per block of a kernel weight format (1 for float types)."""
    fmt = WEIGHT_FORMATS[qtype]
    return 1 if fmt == FMT_FLOAT else 32 if fmt <= FMT_IQ4_NL else 256
