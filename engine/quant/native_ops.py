"""The decoder layer's CPU glue in one native call each (native_ops.c, built into native.py's library).

Each wrapper takes CPU fp32 contiguous tensors whose last dimension is a multiple of 8 (`fits` says
whether a set of tensors qualifies; callers keep the torch ops otherwise). Numerics: fp32 like the torch
code they replace, sums in another order (last-bit differences): models/gemma4.py uses them on the
native CPU path only.
"""

from __future__ import annotations

import torch

from swaserve.engine.quant import native


def available() -> bool:
    return native.available()


def fits(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given is CPU fp32 contiguous with a last dimension a multiple of 8."""
    for t in tensors:  # a plain loop: called a few times per layer on the decode path
        if t is not None and (t.is_cuda or t.dtype != torch.float32 or t.shape[-1] % 8
                              or not t.is_contiguous()):
            return False
    return True


# the kernels' KV element types (native_ops.c load_kv); uint8 views hold q8_0 blocks
_KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3}


def kv_layout(view: torch.Tensor) -> tuple[int, int, int, int]:
    """How the native calls address a KV pool view [num_slots, KVH, R] (kv_view_ok): (data pointer, bytes
    between slots, bytes between heads, element type of native_ops.c load_kv)."""
    e = view.element_size()
    return view.data_ptr(), view.stride(0) * e, view.stride(1) * e, _KV_TYPES[view.dtype]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., N] -> rms_norm(x) * w (w None: no weight), a new tensor."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    native.load().swa_rms_norm(x.data_ptr(), x.numel() // n, n, _ptr(w), eps, out.data_ptr(), None)
    return out


def rms_norm_add_(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """res += rms_norm(x) * w, in place; returns res."""
    n = x.shape[-1]
    assert res.shape == x.shape, (res.shape, x.shape)
    native.load().swa_rms_norm(x.data_ptr(), x.numel() // n, n, _ptr(w), eps, None, res.data_ptr())
    return res


def norm_rope_(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
               sin: torch.Tensor | None, half: int) -> torch.Tensor:
    """In place on x [T, nh, D]: per-head rms_norm * w, then NeoX rope with cos/sin [T, n] on the pairs
    (i, half + i), i < n (cos None: no rope). Returns x."""
    t, nh, d = x.shape
    n = 0 if cos is None else cos.shape[-1]
    if cos is not None:
        assert cos.shape == (t, n) and sin is not None and sin.shape == (t, n) and half + n <= d
        cos, sin = cos.contiguous(), sin.contiguous()
    native.load().swa_norm_rope(x.data_ptr(), t, nh, d, _ptr(w), eps, _ptr(cos), _ptr(sin), n, half)
    return x


def ffn_tail_(h: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              w: torch.Tensor, eps: float, scalar: float) -> torch.Tensor:
    """h = (h + norm(norm(m1) * w1 + norm(m2) * w2) * w) * scalar in place ([M, N]; m1, m2 are
    overwritten). Returns h."""
    m, n = h.shape
    assert m1.shape == m2.shape == h.shape
    native.load().swa_ffn_tail(m1.data_ptr(), m2.data_ptr(), w1.data_ptr(), w2.data_ptr(), w.data_ptr(),
                               eps, scalar, h.data_ptr(), m, n)
    return h


def gelu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(g) * u for g, u [T, I] (the routed experts' activation, exp form: last-bit differences
    from torch's gelu), a new tensor."""
    t, i = g.shape
    assert u.shape == g.shape
    out = torch.empty_like(g)
    native.load().swa_gelu_mul(g.data_ptr(), u.data_ptr(), out.data_ptr(), t, i)
    return out


def router(x: torch.Tensor, rw: torch.Tensor, eps: float, w: torch.Tensor, k: int,
           per_expert_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 4's router for x [T, H]: softmax(W @ (rms_norm(x) * rw)) over the E experts of w [E, H],
    top-k (first index on ties), renormalised, times per_expert_scale [E] -> (ids [T, k] int64,
    weights [T, k] fp32)."""
    t, h = x.shape
    e = w.shape[0]
    assert w.shape == (e, h) and rw.shape == (h,) and per_expert_scale.shape == (e,) and 0 < k <= e
    ids = torch.empty(t, k, dtype=torch.int64)
    wts = torch.empty(t, k, dtype=torch.float32)
    native.load().swa_router(x.data_ptr(), t, h, rw.data_ptr(), eps, w.data_ptr(), e, k,
                             per_expert_scale.data_ptr(), ids.data_ptr(), wts.data_ptr())
    return ids, wts


def decode_attn(q: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                counts: torch.Tensor, out: torch.Tensor, threads: int | None = None) -> None:
    """Decode attention into out[rows] (q, out [T, H, D]): row b attends to the pool slots
    slots[b, :counts[b]] of K/V ([num_slots, KVH, R] pool views of fp32 / fp16 / bf16 values or q8_0
    bytes (R = D / 32 * 34), each side its own type; contiguous head rows, any slot and head stride: the
    pool's own layout, nothing gathered). Scale 1; fp32 math."""
    _, h, d = q.shape
    kvh = k.shape[1]
    assert kv_view_ok(k, d) and kv_view_ok(v, d) and h % kvh == 0, (k.shape, k.stride(), v.stride())
    assert rows.dtype == slots.dtype == counts.dtype == torch.int64 and slots.is_contiguous()
    b, s = slots.shape
    native.load().swa_decode_attn(q.data_ptr(), rows.data_ptr(), b, h, kvh, d, *kv_layout(k), *kv_layout(v),
                                  slots.data_ptr(), s, counts.data_ptr(), out.data_ptr(),
                                  threads if threads is not None else torch.get_num_threads())


def kv_gather(src: torch.Tensor, slots: torch.Tensor, d: int, out: torch.Tensor | None = None,
              threads: int | None = None) -> torch.Tensor:
    """The values of the pool rows src[slots] (src a [num_slots, KVH, R] view as decode_attn takes, slots
    [n] int64) as fp32 [n, KVH, d] (`out` when given): gather and dequantize in one pass."""
    assert kv_view_ok(src, d) and slots.dtype == torch.int64 and slots.is_contiguous()
    n, kvh = slots.numel(), src.shape[1]
    if out is None:
        out = torch.empty(n, kvh, d, dtype=torch.float32)
    assert out.shape == (n, kvh, d) and out.dtype == torch.float32 and out.is_contiguous()
    native.load().swa_kv_gather(*kv_layout(src), slots.data_ptr(), n, kvh, d, out.data_ptr(),
                                threads if threads is not None else torch.get_num_threads())
    return out


def kv_store_q8(dst: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, threads: int | None = None) -> None:
    """dst[slots] = q8_0 blocks of x (dst a uint8 [num_slots, KVH, D / 32 * 34] pool view as kv_gather
    takes, slots [T] int64, x [T, KVH, D] fp32 contiguous), bit-exact with kv_quant.quantize_q8_0."""
    t, kvh, d = x.shape
    assert dst.dtype == torch.uint8 and kv_view_ok(dst, d) and dst.shape[1] == kvh
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == t
    assert x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
    if t:
        native.load().swa_kv_store_q8(x.data_ptr(), t, kvh, d, dst.data_ptr(), dst.stride(0), dst.stride(1),
                                      slots.data_ptr(),
                                      threads if threads is not None else torch.get_num_threads())


def kv_dtype_ok(dtype: torch.dtype) -> bool:
    """Whether decode_attn reads KV pool views of this dtype (uint8: q8_0 blocks)."""
    return dtype in _KV_TYPES


def kv_view_ok(t: torch.Tensor, d: int) -> bool:
    """Whether a pool view [num_slots, KVH, R] of head dim d is one the native calls read: a CPU view of a
    type they know, head rows contiguous, R matching d (d a multiple of 8, of 32 for q8_0)."""
    if t.device.type != "cpu" or t.dtype not in _KV_TYPES or t.dim() != 3 or t.stride(2) != 1 or d % 8:
        return False
    if t.dtype == torch.uint8:
        return d % 32 == 0 and t.shape[2] == d // 32 * 34
    return t.shape[2] == d
