"""The Gemma 4 decoder layer on the device path: the fused kernels of this package around the
linears, the attention backend's paged attention and the MoE backend.

Per layer (after its input norm, which the previous layer's tail kernel produced):
  q, k, v linears -> q norm + rope (1 launch) -> k norm + rope and v norm, stored to the KV slots
  (1 launch) -> paged attention -> o linear -> post-attention kernel (norm + residual, and the three
  norms of the new residual: MLP input, MoE input, router input) -> gate, up, gelu*up, down ->
  router kernel (linear, softmax, top-k, renormalise, scale) -> MoE (device-side alignment) ->
  tail kernel (the sum over the K expert rows, three norms, residual, layer scalar, and the next
  layer's input norm).
The model is duck-typed (models/gemma4.py's Gemma4Model): engine/ never imports models/.
"""

from __future__ import annotations

from typing import Any

import torch

from swaserve.engine.attention.base import AttentionMetadata, store_kv
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.fused import moe_kernels, norm_kernels
from swaserve.engine.fused.ops import device_linear
from swaserve.engine.quant.linear import embedding


def supported(model: Any) -> bool:
    """The fused path needs an attention backend that attends over K/V already in the pool."""
    return hasattr(model.attn, "attend")


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [T, N] -> x * rms(x) (* w) in `dtype`, one launch."""
    T, N = x.shape
    out = torch.empty(T, N, dtype=dtype, device=x.device)
    norm_kernels.rms_norm_kernel[(T,)](x, w if w is not None else x, out, N, eps, HAS_W=w is not None,
                                       BLOCK=norm_kernels.row_block(N))
    return out


@torch.no_grad()
def device_forward(model: Any, input_ids: torch.Tensor, meta: AttentionMetadata, pool: KVPool
                   ) -> torch.Tensor:
    """input_ids [T] -> fp32 hidden [T, H] after the final norm (Gemma4Model.forward's contract)."""
    cfg = model.cfg
    ids = input_ids.to(model.device)
    positions = meta.positions.to(model.device)  # [T]
    h = (embedding(ids, model.embed) * model.embed_scale).contiguous()  # [T, H] fp32 residual stream
    rope = {kind: r.lookup(positions) for kind, r in model.ropes.items()}
    x = rms_norm(h, model.layers[0].attn_norm, cfg.rms_norm_eps, model.dtype)  # [T, H] layer 0's input
    n = len(model.layers)
    for i, lw in enumerate(model.layers):
        nxt = model.layers[i + 1].attn_norm if i + 1 < n else model.final_norm
        x = device_layer(model, i, lw, h, x, rope["sliding" if model._is_sliding[i] else "full"], meta, pool,
                         nxt, torch.float32 if i + 1 == n else model.dtype)
    return x  # the last tail wrote norm(h) * final_norm in fp32


def device_layer(model: Any, i: int, lw: Any, h: torch.Tensor, x: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, pool: KVPool,
                 next_norm: torch.Tensor, next_dtype: torch.dtype) -> torch.Tensor:
    """One layer: updates the residual h [T, H] fp32 in place; x [T, H] is this layer's normed input;
    returns the next layer's normed input (norm(h) * next_norm in next_dtype)."""
    cfg = model.cfg
    eps = cfg.rms_norm_eps
    T, H = h.shape
    sliding = model._is_sliding[i]
    D = cfg.head_dim_swa if sliding else cfg.head_dim_full
    kvh = cfg.num_kv_heads_swa if sliding else cfg.num_kv_heads_full
    nh = cfg.num_heads
    cos, sin = rope  # [T, n_rot] fp32
    n_rot = cos.shape[1]
    dt = model.dtype
    block = norm_kernels.row_block(H)

    # attention
    q = device_linear(x, lw.q_proj).view(T, nh, D)  # [T, NH, D]
    k = device_linear(x, lw.k_proj).view(T, kvh, D)  # [T, KVH, D]
    v = k if lw.v_proj is None else device_linear(x, lw.v_proj).view(T, kvh, D)  # K = V on full layers
    qr = torch.empty_like(q)
    norm_kernels.norm_rope_kernel[(T, nh)](q, lw.q_norm, cos, sin, qr, q.stride(0), q.stride(1), qr.stride(0),
                                           qr.stride(1), n_rot, eps, HALF=D // 2)
    k_cache, v_cache = pool.kv(i)  # [S, KVH, R]
    slots = meta.swa_slots if sliding else meta.full_slots  # [T]
    k_dst, v_dst, dst_slots = k_cache, v_cache, slots
    eight_bit = k_cache.element_size() == 1 or v_cache.element_size() == 1  # q8_0 / fp8 KV
    if eight_bit:  # normed, roped rows to a scratch first, then quantized into the pool
        k_dst = torch.empty(T, kvh, D, dtype=dt, device=h.device)  # [T, KVH, D]
        v_dst = torch.empty_like(k_dst)
        dst_slots = torch.arange(T, device=h.device)
    norm_kernels.kv_store_kernel[(T, kvh)](
        k, v, lw.k_norm, cos, sin, dst_slots, k_dst, v_dst, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1), n_rot, eps,
        HALF=D // 2)
    if eight_bit:
        store_kv(k_cache, v_cache, slots, k_dst, v_dst)
    table = meta.swa_page_table if sliding else meta.full_page_table
    o = model.attn.attend(qr, k_cache, v_cache, table, meta, sliding)  # [T, NH, D]
    a = device_linear(o.reshape(T, nh * D), lw.o_proj)  # [T, H]

    # residual + the three norms of the new residual
    x_ffn = torch.empty(T, H, dtype=dt, device=h.device)
    x_moe = torch.empty(T, H, dtype=dt, device=h.device)
    x_router = torch.empty(T, H, dtype=torch.float32, device=h.device)
    norm_kernels.post_attention_kernel[(T,)](
        a, h, lw.post_attention_norm, lw.ffn_norm, lw.pre_ffw_norm_2, lw.router_scale,
        model.router_input_scale, x_ffn, x_moe, x_router, H, eps, BLOCK=block)
    # dense MLP
    gate = device_linear(x_ffn, lw.gate_proj)  # [T, I]
    up = device_linear(x_ffn, lw.up_proj)
    inter = gate.shape[1]
    act = torch.empty_like(gate)
    moe_kernels.gelu_mul_kernel[(T, -(-inter // 1024))](gate, up, act, inter, gate.stride(0), up.stride(0),
                                                         act.stride(0), BLOCK=1024)
    mlp = device_linear(act, lw.down_proj)  # [T, H]
    # router + routed experts
    E, K = cfg.num_experts, cfg.top_k_experts
    topk_ids = torch.empty(T, K, dtype=torch.int64, device=h.device)
    topk_w = torch.empty(T, K, dtype=torch.float32, device=h.device)
    moe_kernels.router_kernel[(T,)](x_router, lw.router, lw.per_expert_scale, topk_ids, topk_w, H, E=E, K=K,
                                    BLOCK_H=64)
    unsummed = getattr(model.moe, "forward_unsummed", None)  # [T, K, H] fp32 rows: the tail sums them
    if unsummed is not None:
        m2 = unsummed(i, x_moe, topk_ids, topk_w)
    else:
        m2 = model.moe.forward(i, x_moe, topk_ids, topk_w)[:, None, :]  # [T, 1, H]
    # tail: norms, residual, layer scalar, next input norm
    x_next = torch.empty(T, H, dtype=next_dtype, device=h.device)
    norm_kernels.layer_tail_kernel[(T,)](
        mlp, m2, m2.shape[1], h, lw.post_ffw_norm_1, lw.post_ffw_norm_2, lw.post_ffw_norm, lw.layer_scalar,
        next_norm, x_next, H, eps, HAS_NEXT=True, BLOCK=block)
    return x_next
