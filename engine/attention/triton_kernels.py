"""Triton kernels for paged attention: varlen prefill (with a cached prefix) and split-K decode.

Both kernels read K/V through a page table: the key at logical position n of sequence b lives in
pool slot page_table[b, n // PAGE] * PAGE + n % PAGE. Keys are indexed by absolute position; a
query at position p sees keys k <= p, and on sliding layers only k > p - window (there, under BIDIR, an image
soft token sees k < its key end instead of k <= p: the rest of its image). Softmax runs in
fp32 with an online (flash) rescale. `DOT_F32` upcasts dot operands to fp32 with exact (ieee, not
tf32) products: for fp32 KV, and for bf16 under TRITON_INTERPRET=1, whose bf16 dot is wrong.
K_TYPE / V_TYPE say how a side is stored: 0 float (dot operands in its dtype), 1 q8_0 (34-byte blocks of
an fp16 scale and 32 int8, dequantized to fp32 in-kernel; kw_ptr / vw_ptr: int16 views of the same bytes,
read as words), 2 fp8 (scale 1.0); 1 and 2 are converted to the query's dtype for the dot.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_tile(ptr, word_ptr, row, offs_d, mask, BN: tl.constexpr, D: tl.constexpr, TYPE: tl.constexpr):
    """[BN, D] values of head rows starting at element `row` [BN, 1] of a pool view: fp32 from q8_0 blocks
    (TYPE 1: `word_ptr` an int16 view of the bytes: a block is 17 words, the fp16 scale then 16 pairs of
    int8 codes, low byte first; one scale load a block, 16 two-byte loads), else the stored elements."""
    if TYPE == 1:
        NB: tl.constexpr = D // 32
        blk = row[:, :, None] // 2 + (tl.arange(0, NB) * 17)[None, :, None]  # [BN, NB, 1] word offsets
        m3 = mask[:, None, None]
        d = tl.load(word_ptr + blk, mask=m3, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        w = tl.load(word_ptr + blk + 1 + tl.arange(0, 16)[None, None, :], mask=m3, other=0)  # [BN, NB, 16]
        q = tl.interleave((w << 8) >> 8, w >> 8)  # [BN, NB, 32] int16: the codes, sign-extended
        return tl.reshape(q.to(tl.float32) * d, [BN, D])
    else:
        return tl.load(ptr + row + offs_d[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, o_ptr,
    blk_seq_ptr, blk_start_ptr,  # [NB] int32: sequence and first query token (within it) per program
    cu_q_ptr, prefix_ptr,  # [B + 1], [B] int32
    pt_ptr,  # [B, MP] int64 page table
    kend_ptr,  # [T] int32 one past the last key of each token (BIDIR; AttentionMetadata.key_ends)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
    sm_scale, window,
    G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, DOT_F32: tl.constexpr, K_TYPE: tl.constexpr, V_TYPE: tl.constexpr,
    BIDIR: tl.constexpr,
):
    # One program per (BLOCK_M // G query tokens, KV head): the tile's BLOCK_M rows are those tokens'
    # G query heads (row r = token r // G, head kvh * G + r % G), so each K/V tile is read once for
    # all the heads that share it (packed GQA).
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(blk_seq_ptr + pid)
    m0 = tl.load(blk_start_ptr + pid)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    prefix = tl.load(prefix_ptr + b)
    TOK: tl.constexpr = BLOCK_M // G  # query tokens per tile

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_r // G  # query token of each row, within the sequence
    head = kvh * G + offs_r % G  # [BM]
    offs_d = tl.arange(0, D)
    m_mask = (offs_r < TOK * G) & (offs_m < q_len)
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)  # [BM, D]
    if DOT_F32:
        q = q.to(tl.float32)
    elif K_TYPE == 0:
        q = q.to(k_ptr.dtype.element_ty)  # tl.dot needs equal operand types (8-bit K: K to q's)
    pos = prefix + offs_m  # [BM] absolute positions

    hi = prefix + tl.minimum(m0 + TOK, q_len)  # one past the last key any row sees
    if BIDIR:  # an image's soft tokens also see its later ones (all in this chunk)
        kend = tl.load(kend_ptr + tok, mask=m_mask, other=0)  # [BM]
        hi = tl.maximum(hi, tl.max(kend, 0))
    if SLIDING:
        lo = tl.maximum(prefix + m0 - window + 1, 0)
    else:
        lo = prefix * 0
    start = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = (offs_n >= lo) & (offs_n < hi)
        page = tl.load(pt_ptr + b * stride_pt + offs_n // PAGE, mask=n_valid, other=0)
        slot = page.to(tl.int64) * PAGE + offs_n % PAGE  # [BN]
        k = _kv_tile(k_ptr, kw_ptr, slot[:, None] * stride_ks + kvh * stride_kh, offs_d, n_valid,
                     BLOCK_N, D, K_TYPE)  # [BN, D]
        if DOT_F32:
            k = k.to(tl.float32)
        elif K_TYPE != 0:
            k = k.to(q.dtype)
        if DOT_F32:  # exact fp32 products (not tf32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # [BM, BN]
        else:
            s = tl.dot(q, tl.trans(k)) * sm_scale  # [BM, BN]
        if BIDIR:
            mask = n_valid[None, :] & (offs_n[None, :] < kend[:, None])
        else:  # causal (no second [BM] bound live in registers: D512 q8_0 spilled with one)
            mask = n_valid[None, :] & (offs_n[None, :] <= pos[:, None])
        if SLIDING:
            mask = mask & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_ptr, vw_ptr, slot[:, None] * stride_vs + kvh * stride_vh, offs_d, n_valid,
                     BLOCK_N, D, V_TYPE)  # [BN, D]
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            if V_TYPE != 0:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, po_ptr, plse_ptr,
    dec_seq_ptr,  # [BD] int32: batch index of each decode sequence (q_len == 1)
    cu_q_ptr, prefix_ptr, pt_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
    sm_scale, window, num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr, K_TYPE: tl.constexpr,
    V_TYPE: tl.constexpr,
):
    # partials: po [BD, H, S, D] fp32 (normalised within the split), plse [BD, H, S] fp32
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(dec_seq_ptr + i)
    tok = tl.load(cu_q_ptr + b).to(tl.int64)
    prefix = tl.load(prefix_ptr + b)
    hi = prefix + 1
    if SLIDING:
        lo = tl.maximum(hi - window, 0)
    else:
        lo = prefix * 0
    chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    heads = kvh * G + offs_g  # [BG]
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)  # [BG, D]
    if DOT_F32:
        q = q.to(tl.float32)
    elif K_TYPE == 0:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < s_hi
        page = tl.load(pt_ptr + b * stride_pt + offs_n // PAGE, mask=n_valid, other=0)
        slot = page.to(tl.int64) * PAGE + offs_n % PAGE
        k = _kv_tile(k_ptr, kw_ptr, slot[:, None] * stride_ks + kvh * stride_kh, offs_d, n_valid,
                     BLOCK_N, D, K_TYPE)  # [BN, D]
        if DOT_F32:
            k = k.to(tl.float32)
        elif K_TYPE != 0:
            k = k.to(q.dtype)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # [BG, BN]
        else:
            s = tl.dot(q, tl.trans(k)) * sm_scale  # [BG, BN]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_ptr, vw_ptr, slot[:, None] * stride_vs + kvh * stride_vh, offs_d, n_valid,
                     BLOCK_N, D, V_TYPE)  # [BN, D]
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            if V_TYPE != 0:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    H = tl.num_programs(1) * G
    row = (i * H + heads).to(tl.int64) * num_splits + split  # [BG]
    tl.store(po_ptr + row[:, None] * D + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(plse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    po_ptr, plse_ptr, o_ptr, dec_seq_ptr, cu_q_ptr,
    stride_ot, stride_oh, num_splits,
    D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    b = tl.load(dec_seq_ptr + i)
    tok = tl.load(cu_q_ptr + b).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < num_splits
    base = (i * H + h).to(tl.int64) * num_splits
    lse = tl.load(plse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))  # [BS]
    m = tl.max(lse, 0)  # finite: the split holding the query's own key is never empty
    denom = tl.sum(tl.exp(lse - m), 0)  # empty splits weigh 0
    # one split row [D] at a time: a [BLOCK_S, D] tile at D = 512 needs 255 registers and spills
    acc = tl.zeros([D], dtype=tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(plse_ptr + base + s) - m)
        acc += tl.load(po_ptr + (base + s) * D + offs_d) * w
    tl.store(o_ptr + tok * stride_ot + h * stride_oh + offs_d, (acc / denom).to(o_ptr.dtype.element_ty))


# Block sizes: the largest tiles that compile for sm_90 without register spills
# (python -m tools.gpu_check.triton_aot prints registers and stack per configuration).
def prefill_block_sizes(head_dim: int, group: int = 1, shared_bytes: int | None = None, q8: bool = False
                        ) -> tuple[int, int, int, int]:
    """(BLOCK_M rows = query tokens x the group's G heads, BLOCK_N, num_warps, num_stages) for the
    packed prefill kernel; `shared_bytes`: the device's shared memory per block (None: sm_90's),
    at D = 512 under 160 KB (sm_89: 99 KB) the row tile halves to fit (K and V tiles are 64 KB each).
    `q8`: K or V stored q8_0 (the dequantizing loads need more registers: half the key tile)."""
    if head_dim >= 512:
        small = shared_bytes is not None and shared_bytes < 160 * 1024
        bm, bn, warps, stages = (16 if small else 32), 64, 8, 1
    elif head_dim >= 256:
        bm, bn, warps, stages = 64, 64, 8, 1
    else:
        bm, bn, warps, stages = 64, 64, 4, 2
    if q8:
        bn //= 2
    return max(bm, prefill_rows(group)), bn, warps, stages


def prefill_rows(group: int, rows: int = 16) -> int:
    """Rows of a packed prefill tile holding at least one token's `group` heads and `rows` rows."""
    return max(rows, triton.next_power_of_2(group))


def decode_block_sizes(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the decode kernel."""
    if head_dim >= 512:
        return 32, 8, 2
    return 32, 4, 2
