"""Triton kernels fusing Gemma 4's norm chains, rope and the K/V store (one program per row/head).

All arithmetic in fp32; each output is rounded once to its buffer's dtype. Shapes in comments:
T tokens, N = hidden size, D = head dim = 2 * HALF (rope pairs (i, i + HALF), the first n_rot of
them rotate; cos/sin [T, n_rot]).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms(x, N, eps):
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    # out[t] = x[t] * rms(x[t]) (* w)   x [T, N] any float, out [T, N]
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + t * N + offs, mask=m, other=0.0).to(tl.float32)
    y = x * _rms(x, N, eps)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + t * N + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def post_attention_kernel(a_ptr, h_ptr, w_pa_ptr, w_ffn_ptr, w_moe_ptr, w_router_ptr, router_scalar,
                          x_ffn_ptr, x_moe_ptr, x_router_ptr, N, eps, BLOCK: tl.constexpr):
    # h[t] += norm(a[t]) * w_pa (in place, fp32), then from the new h: x_ffn = norm(h) * w_ffn,
    # x_moe = norm(h) * w_moe (compute dtype), x_router = norm(h) * w_router * router_scalar (fp32)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(a_ptr + t * N + offs, mask=m, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + t * N + offs, mask=m, other=0.0)
    h = h + a * _rms(a, N, eps) * tl.load(w_pa_ptr + offs, mask=m, other=0.0)
    tl.store(h_ptr + t * N + offs, h, mask=m)
    hr = h * _rms(h, N, eps)
    x_ffn = hr * tl.load(w_ffn_ptr + offs, mask=m, other=0.0)
    tl.store(x_ffn_ptr + t * N + offs, x_ffn.to(x_ffn_ptr.dtype.element_ty), mask=m)
    x_moe = hr * tl.load(w_moe_ptr + offs, mask=m, other=0.0)
    tl.store(x_moe_ptr + t * N + offs, x_moe.to(x_moe_ptr.dtype.element_ty), mask=m)
    x_router = hr * tl.load(w_router_ptr + offs, mask=m, other=0.0) * router_scalar
    tl.store(x_router_ptr + t * N + offs, x_router, mask=m)


@triton.jit
def layer_tail_kernel(m1_ptr, m2_ptr, top_k, h_ptr, w1_ptr, w2_ptr, w_post_ptr, scalar_ptr, w_next_ptr,
                      x_next_ptr, N, eps, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr):
    # m2 [T, top_k, N]: the weighted expert rows, summed here in fp32
    # h[t] = (h + norm(norm(m1) * w1 + norm(m2) * w2) * w_post) * scalar   (in place, fp32)
    # x_next[t] = norm(h) * w_next: the next layer's input norm (or the final norm), when HAS_NEXT
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    m1 = tl.load(m1_ptr + t * N + offs, mask=m, other=0.0).to(tl.float32)
    m2 = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(top_k):
        m2 += tl.load(m2_ptr + (t * top_k + k) * N + offs, mask=m, other=0.0).to(tl.float32)
    s = m1 * _rms(m1, N, eps) * tl.load(w1_ptr + offs, mask=m, other=0.0)
    s = s + m2 * _rms(m2, N, eps) * tl.load(w2_ptr + offs, mask=m, other=0.0)
    h = tl.load(h_ptr + t * N + offs, mask=m, other=0.0)
    h = (h + s * _rms(s, N, eps) * tl.load(w_post_ptr + offs, mask=m, other=0.0)) * tl.load(scalar_ptr)
    tl.store(h_ptr + t * N + offs, h, mask=m)
    if HAS_NEXT:
        x = h * _rms(h, N, eps) * tl.load(w_next_ptr + offs, mask=m, other=0.0)
        tl.store(x_next_ptr + t * N + offs, x.to(x_next_ptr.dtype.element_ty), mask=m)


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, t, n_rot, eps, HAS_W: tl.constexpr, ROPE: tl.constexpr,
                   HALF: tl.constexpr):
    # one head row [D] -> (first half, second half) normed (* w) and roped, fp32
    i = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + i).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i).to(tl.float32)
    r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    x1 = x1 * r
    x2 = x2 * r
    if HAS_W:
        x1 = x1 * tl.load(w_ptr + i)
        x2 = x2 * tl.load(w_ptr + HALF + i)
    if ROPE:
        rot = i < n_rot  # pairs past n_rot pass through (cos 1, sin 0)
        c = tl.load(cos_ptr + t * n_rot + i, mask=rot, other=1.0)
        s = tl.load(sin_ptr + t * n_rot + i, mask=rot, other=0.0)
        x1, x2 = x1 * c - x2 * s, x2 * c + x1 * s
    return x1, x2


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                     n_rot, eps, HALF: tl.constexpr):
    # out[t, h] = rope(norm(x[t, h]) * w)   x [T, NH, D], out [T, NH, D]
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1).to(tl.int64)
    y1, y2 = _norm_rope_row(x_ptr + t * stride_xt + hd * stride_xh, w_ptr, cos_ptr, sin_ptr, t, n_rot, eps,
                            True, True, HALF)
    o = out_ptr + t * stride_ot + hd * stride_oh
    i = tl.arange(0, HALF)
    tl.store(o + i, y1.to(out_ptr.dtype.element_ty))
    tl.store(o + HALF + i, y2.to(out_ptr.dtype.element_ty))


@triton.jit
def kv_store_kernel(k_ptr, v_ptr, wk_ptr, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_vs, stride_vch,
                    n_rot, eps, HALF: tl.constexpr):
    # k_cache[slot[t], h] = rope(norm(k[t, h]) * wk); v_cache[slot[t], h] = norm(v[t, h])
    # k, v [T, KVH, D] (v may alias k: K = V layers); caches [S, KVH, D]
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    k1, k2 = _norm_rope_row(k_ptr + t * stride_kt + hd * stride_kh, wk_ptr, cos_ptr, sin_ptr, t, n_rot, eps,
                            True, True, HALF)
    kc = kc_ptr + slot * stride_cs + hd * stride_ch
    tl.store(kc + i, k1.to(kc_ptr.dtype.element_ty))
    tl.store(kc + HALF + i, k2.to(kc_ptr.dtype.element_ty))
    v1, v2 = _norm_rope_row(v_ptr + t * stride_vt + hd * stride_vh, wk_ptr, cos_ptr, sin_ptr, t, n_rot, eps,
                            False, False, HALF)
    vc = vc_ptr + slot * stride_vs + hd * stride_vch
    tl.store(vc + i, v1.to(vc_ptr.dtype.element_ty))
    tl.store(vc + HALF + i, v2.to(vc_ptr.dtype.element_ty))


def row_block(n: int) -> int:
    return triton.next_power_of_2(n)
