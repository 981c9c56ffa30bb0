"""The Gemma 4 layer steps on the device path: the fused kernels of engine/fused around the device
linears, the attention backend's paged attention and the MoE backend.

Per layer (after its input norm, which the previous layer's tail kernel produced):
  q, k, v linears -> q norm + rope (1 launch) -> k norm + rope and v norm, stored to the KV slots
  (1 launch) -> paged attention -> o linear -> post-attention kernel (norm + residual, and the three
  norms of the new residual: MLP input, MoE input, router input) -> gate, up, gelu*up, down ->
  router kernel (linear, softmax, top-k, renormalise, scale) -> MoE (device-side alignment) ->
  tail kernel (the sum over the K expert rows, three norms, residual, layer scalar, and the next
  layer's input norm).
"""

from __future__ import annotations

import torch

from swaserve.engine.attention.base import AttentionMetadata, store_kv
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.fused import moe_kernels, norm_kernels
from swaserve.engine.fused.ops import device_linear
from swaserve.engine.quant.base import QWeight
from swaserve.models.gemma4_ops import Branches, LayerOps, Rope
from swaserve.models.weights import LayerWeights


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [T, N] -> x * rms(x) (* w) in `dtype`, one launch."""
    T, N = x.shape
    out = torch.empty(T, N, dtype=dtype, device=x.device)
    norm_kernels.rms_norm_kernel[(T,)](x, w if w is not None else x, out, N, eps, HAS_W=w is not None,
                                       BLOCK=norm_kernels.row_block(N))
    return out


class FusedOps(LayerOps):
    """The device path (CUDA, or the Triton interpreter under engine.fused.ops.device_kernels()): each
    tail makes the next layer's input norm, so the layers carry it."""

    def linear(self, x: torch.Tensor, w: QWeight) -> torch.Tensor:
        return device_linear(x, w)

    def first_input(self, h: torch.Tensor) -> torch.Tensor | None:
        return self.input_norm(self.model.layers[0], h)

    def input_norm(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, lw.attn_norm, self.model.cfg.rms_norm_eps, self.model.dtype)

    def attend(self, i: int, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
               half: int, sliding: bool, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        eps = self.model.cfg.rms_norm_eps
        T, nh, D = q.shape
        kvh = k.shape[1]
        cos, sin = rope  # [T, n_rot] fp32
        n_rot = cos.shape[1]
        qr = torch.empty_like(q)
        norm_kernels.norm_rope_kernel[(T, nh)](q, lw.q_norm, cos, sin, qr, q.stride(0), q.stride(1),
                                               qr.stride(0), qr.stride(1), n_rot, eps, HALF=D // 2)
        k_cache, v_cache = pool.kv(i)  # [S, KVH, R]
        slots = meta.swa_slots if sliding else meta.full_slots  # [T]
        k_dst, v_dst, dst_slots = k_cache, v_cache, slots
        eight_bit = k_cache.element_size() == 1 or v_cache.element_size() == 1  # q8_0 / fp8 KV
        if eight_bit:  # normed, roped rows to a scratch first, then quantized into the pool
            k_dst = torch.empty(T, kvh, D, dtype=self.model.dtype, device=q.device)  # [T, KVH, D]
            v_dst = torch.empty_like(k_dst)
            dst_slots = torch.arange(T, device=q.device)
        norm_kernels.kv_store_kernel[(T, kvh)](
            k, v, lw.k_norm, cos, sin, dst_slots, k_dst, v_dst, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1), n_rot,
            eps, HALF=D // 2)
        if eight_bit:
            store_kv(k_cache, v_cache, slots, k_dst, v_dst)
        table = meta.swa_page_table if sliding else meta.full_page_table
        return self.model.attn.attend(qr, k_cache, v_cache, table, meta, sliding)  # [T, NH, D]

    def post_attention(self, lw: LayerWeights, h: torch.Tensor, a: torch.Tensor) -> Branches:
        # residual (in place) + the three norms of the new residual, one launch
        T, H = h.shape
        dt = self.model.dtype
        x_ffn = torch.empty(T, H, dtype=dt, device=h.device)
        x_moe = torch.empty(T, H, dtype=dt, device=h.device)
        x_router = torch.empty(T, H, dtype=torch.float32, device=h.device)
        norm_kernels.post_attention_kernel[(T,)](
            a, h, lw.post_attention_norm, lw.ffn_norm, lw.pre_ffw_norm_2, lw.router_scale,
            self.model.router_input_scale, x_ffn, x_moe, x_router, H, self.model.cfg.rms_norm_eps,
            BLOCK=norm_kernels.row_block(H))
        return Branches(h, x_ffn, x_moe, x_router)

    def mlp(self, lw: LayerWeights, b: Branches) -> torch.Tensor:
        T = b.mlp.shape[0]
        gate = device_linear(b.mlp, lw.gate_proj)  # [T, I]
        up = device_linear(b.mlp, lw.up_proj)
        inter = gate.shape[1]
        act = torch.empty_like(gate)
        moe_kernels.gelu_mul_kernel[(T, -(-inter // 1024))](gate, up, act, inter, gate.stride(0),
                                                             up.stride(0), act.stride(0), BLOCK=1024)
        return device_linear(act, lw.down_proj)  # [T, H]

    def route(self, i: int, lw: LayerWeights, b: Branches) -> tuple[torch.Tensor, torch.Tensor]:
        T, H = b.router.shape
        E, K = self.model.cfg.num_experts, self.model.cfg.top_k_experts
        topk_ids = torch.empty(T, K, dtype=torch.int64, device=b.h.device)
        topk_w = torch.empty(T, K, dtype=torch.float32, device=b.h.device)
        moe_kernels.router_kernel[(T,)](b.router, lw.router, lw.per_expert_scale, topk_ids, topk_w, H, E=E,
                                        K=K, BLOCK_H=64)
        return topk_ids, topk_w

    def experts(self, i: int, lw: LayerWeights, b: Branches, topk_ids: torch.Tensor,
                topk_w: torch.Tensor) -> torch.Tensor:
        moe = self.model.moe
        unsummed = getattr(moe, "forward_unsummed", None)  # [T, K, H] fp32 rows: the tail sums them
        if unsummed is not None:
            return unsummed(i, b.moe, topk_ids, topk_w)
        return moe.forward(i, b.moe, topk_ids, topk_w)[:, None, :]  # [T, 1, H]

    def tail(self, i: int, lw: LayerWeights, h: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # m2 [T, K, H]: norms, residual (in place), layer scalar, the next input norm, one launch
        T, H = h.shape
        layers = self.model.layers
        last = i + 1 == len(layers)
        next_norm = self.model.final_norm if last else layers[i + 1].attn_norm
        x_next = torch.empty(T, H, dtype=torch.float32 if last else self.model.dtype, device=h.device)
        norm_kernels.layer_tail_kernel[(T,)](
            m1, m2, m2.shape[1], h, lw.post_ffw_norm_1, lw.post_ffw_norm_2, lw.post_ffw_norm, lw.layer_scalar,
            next_norm, x_next, H, self.model.cfg.rms_norm_eps, HAS_NEXT=True, BLOCK=norm_kernels.row_block(H))
        return h, x_next

    def final_norm(self, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        return x  # the last tail wrote norm(h) * final_norm in fp32
