"""The Gemma 4 text model (26B-A4B architecture) over the paged KV pools.

Facts: docs/model.md. Sliding and full layers differ in head_dim, KV heads and rope;
full layers use K = V (no v_proj) and "proportional" rope (only the first pairs rotate). Every
decoder layer has a dense MLP and a routed MoE whose outputs are summed. Norms run in fp32 with
the raw weight (no 1 + w); v_norm and the router norm have no weight. Linears go through
engine.quant.linear in the weights' stored form (with the engine's `cpu_matmul` numerics); routed
experts go to the MoE backend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from swaserve.engine.attention.base import AttentionBackend, AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.config import CpuMatmul, ModelConfig
from swaserve.engine.fused import decoder as fused_decoder
from swaserve.engine.fused.ops import use_device_kernels
from swaserve.engine.fused.weights import float_weight_to, logits_fp32
from swaserve.engine.moe.base import MoEBackend
from swaserve.engine.quant import native, native_ops
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.linear import embedding, linear, prepare_native
from swaserve.models.weights import Gemma4Weights, LayerWeights


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-0.5 * w in fp32, returned in `dtype` (default x's); w None = no weight."""
    xf = x.float()  # no copy when x is fp32
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # weight applied in place below
    if w is not None:
        y.mul_(w)
    return y.to(dtype or x.dtype)  # no copy when the dtypes match


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """NeoX half-split rope: pairs (i, i + half) for i < n rotate, n = cos.shape[-1].

    x [T, nh, D]; cos/sin [T, n]. Dims outside the rotated pairs pass through unchanged.
    """
    n = cos.shape[-1]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # [T, 1, n]
    x1, x2 = x[..., :n], x[..., half:half + n]  # [T, nh, n]
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    if n == half and 2 * half == x.shape[-1]:
        return torch.cat([r1, r2], dim=-1)
    out = x.clone()
    out[..., :n] = r1
    out[..., half:half + n] = r2
    return out


class _Rope:
    """cos/sin of one layer kind at a step's positions, computed on the positions' device.

    angle = position * inv_freq in fp32, elementwise exactly what a precomputed table holds, with
    no table size to outgrow and no `positions.max()` read back to the host (a sync per step)."""

    def __init__(self, theta: float, dim: int, pairs: int, half: int, device: torch.device):
        # inv_freq[i] = 1 / theta^(2i / dim) for the rotated pairs (the rest have frequency 0)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.float32) / dim))
        self.inv_freq = self.inv_freq.to(device)  # [pairs]
        self.half = half

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = positions.to(torch.float32)[:, None] * self.inv_freq  # [T, n]
        return angle.cos(), angle.sin()  # [T, n] each


def _to_dev(w: QWeight, device: torch.device, dtype: torch.dtype | None) -> QWeight:
    """On CUDA float weights are converted to `dtype` here, once (engine/fused/weights.py)."""
    if device.type == "cpu":
        return w
    return float_weight_to(w, device, dtype)


def _layer_to(lw: LayerWeights, device: torch.device, dtype: torch.dtype) -> LayerWeights:
    """Everything but the routed experts (the MoE backend places those) on `device`."""
    if device.type == "cpu":
        return lw
    moved = {}
    for name, val in vars(lw).items():
        if isinstance(val, QWeight):
            moved[name] = _to_dev(val, device, dtype)
        elif isinstance(val, torch.Tensor):
            moved[name] = val.to(device)
        else:
            moved[name] = val
    return LayerWeights(**moved)


def _glue_ok(lw: LayerWeights) -> bool:
    """Whether a layer's norm weights suit the native glue calls (CPU fp32 contiguous, sizes of 8s)."""
    norms = (lw.attn_norm, lw.post_attention_norm, lw.ffn_norm, lw.pre_ffw_norm_2, lw.post_ffw_norm_1,
             lw.post_ffw_norm_2, lw.post_ffw_norm, lw.q_norm, lw.k_norm, lw.router_scale)
    pes = lw.per_expert_scale
    return (native_ops.fits(*norms, lw.router) and pes.dtype == torch.float32 and pes.is_contiguous()
            and lw.layer_scalar.numel() == 1)


class Gemma4Model:
    """Gemma 4 text model; `forward` runs a varlen batch through the paged KV pools."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Gemma4Weights,
        attn: AttentionBackend,
        moe: MoEBackend,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        cpu_matmul: CpuMatmul = "exact",
    ):
        if len(weights.layers) != cfg.num_layers:
            raise ValueError(f"weights have {len(weights.layers)} layers, config says {cfg.num_layers}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype  # compute dtype of the linears and attention; the residual stream is fp32
        self.cpu_matmul = cpu_matmul  # CPU Q4_0 linears of fp32 inputs: exact or fast (EngineConfig)
        self.attn = attn
        self.moe = moe
        # [V, H], also the tied lm_head: kept in its stored dtype (logits_fp32 casts the hidden rows)
        self.embed = _to_dev(weights.embed, self.device, None)
        self.final_norm = weights.final_norm.to(self.device).float()
        self.layers = [_layer_to(lw, self.device, dtype) for lw in weights.layers]
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.router_input_scale = cfg.hidden_size ** -0.5
        self._is_sliding = [t == "sliding" for t in cfg.layer_types]  # per layer
        if self.device.type == "cpu" and cpu_matmul == "native":  # repack once at load, not on first use
            prepare_native([self.embed, *(w for lw in self.layers for w in vars(lw).values()
                                          if isinstance(w, QWeight))])
        # the native CPU path runs the layer's norms, rope, residual adds and tail as native calls
        # (engine/quant/native_ops.py: ~1 call where torch takes 5-20 ops); the exact path keeps torch
        self._glue = (self.device.type == "cpu" and cpu_matmul == "native" and dtype == torch.float32
                      and native_ops.available() and all(_glue_ok(lw) for lw in self.layers))
        self._scalars = [float(lw.layer_scalar) for lw in self.layers] if self._glue else []
        self._router_w = [(lw.router_scale * self.router_input_scale).float().contiguous()
                          for lw in self.layers] if self._glue else []
        self.ropes = {
            "sliding": _Rope(cfg.rope_theta_swa, cfg.rope_dims_swa, cfg.rope_dims_swa // 2,
                             cfg.rope_dims_swa // 2, self.device),
            "full": _Rope(cfg.rope_theta_full, cfg.rope_dims_full, cfg.rope_full_rotated_pairs,
                          cfg.head_dim_full // 2, self.device),
        }

    # ---- public API ----

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        """input_ids [T] (new tokens of every sequence, flat) -> fp32 hidden [T, H] after the final norm."""
        if use_device_kernels(self.device) and fused_decoder.supported(self):
            return fused_decoder.device_forward(self, input_ids, meta, pool)  # engine/fused: CUDA path
        ids = input_ids.to(self.device)
        positions = meta.positions.to(self.device)  # [T]
        h = embedding(ids, self.embed) * self.embed_scale  # [T, H] fp32 residual stream
        rope = {kind: r.lookup(positions) for kind, r in self.ropes.items()}
        for i, lw in enumerate(self.layers):
            h = self._layer(i, lw, h, rope["sliding" if self._is_sliding[i] else "full"], meta, pool)
        return rms_norm(h, self.final_norm, self.cfg.rms_norm_eps)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, V] (tied lm_head, final softcap)."""
        x = hidden.to(self.dtype)
        out = logits_fp32(x, self.embed) if x.is_cuda else self._linear(x, self.embed).float()  # [N, V]
        cap = self.cfg.final_logit_softcap
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    # ---- internals ----

    def _linear(self, x: torch.Tensor, w: QWeight) -> torch.Tensor:
        packed = w.cache.interleaved  # built at load on the native path (prepare_native)
        if (self._glue and packed is not None and x.dim() == 2 and x.dtype == torch.float32
                and x.is_contiguous() and x.shape[1] == w.shape[1]):
            return native.mm_packed(x, packed, w.shape[0])  # linear()'s dispatch, ~10 us a call, skipped
        return linear(x, w, self.cpu_matmul)

    def _norm(self, x: torch.Tensor, w: torch.Tensor | None, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
        return rms_norm(x, w, self.cfg.rms_norm_eps, dtype)

    def _layer(
        self,
        i: int,
        lw: LayerWeights,
        h: torch.Tensor,  # [T, H] fp32 residual stream
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        pool: KVPool,
    ) -> torch.Tensor:
        if self._glue:
            return self._layer_native(i, lw, h, rope, meta, pool)
        dt, f32 = self.dtype, torch.float32  # branch inputs in the compute dtype, residual in fp32
        a = self._attention(i, lw, self._norm(h, lw.attn_norm, dt), rope, meta, pool)  # [T, H]
        h = h + self._norm(a, lw.post_attention_norm, f32)
        m1 = self._norm(self._mlp(lw, self._norm(h, lw.ffn_norm, dt)), lw.post_ffw_norm_1, f32)  # [T, H]
        topk_ids, topk_w = self._route(lw, h)  # the router reads h itself
        m2 = self.moe.forward(i, self._norm(h, lw.pre_ffw_norm_2, dt), topk_ids, topk_w)  # [T, H]
        h = h + self._norm(m1 + self._norm(m2, lw.post_ffw_norm_2, f32), lw.post_ffw_norm, f32)
        return h * lw.layer_scalar

    def _layer_native(self, i: int, lw: LayerWeights, h: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                      pool: KVPool) -> torch.Tensor:
        """`_layer` with native glue calls; h [T, H] fp32 is updated in place (the caller's fresh tensor)."""
        eps, ops = self.cfg.rms_norm_eps, native_ops
        a = self._attention(i, lw, ops.rms_norm(h, lw.attn_norm, eps), rope, meta, pool)  # [T, H]
        if not ops.fits(h, a):
            return self._layer_torch_tail(i, lw, h, a)
        ops.rms_norm_add_(h, a, lw.post_attention_norm, eps)
        m1 = self._mlp(lw, ops.rms_norm(h, lw.ffn_norm, eps))  # [T, H]
        topk_ids, topk_w = self._route(lw, h, i)
        m2 = self.moe.forward(i, ops.rms_norm(h, lw.pre_ffw_norm_2, eps), topk_ids, topk_w)  # [T, H]
        if not ops.fits(m1, m2):
            m1, m2 = m1.float().contiguous(), m2.float().contiguous()
        return ops.ffn_tail_(h, m1, m2, lw.post_ffw_norm_1, lw.post_ffw_norm_2, lw.post_ffw_norm, eps,
                             self._scalars[i])

    def _layer_torch_tail(self, i: int, lw: LayerWeights, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        f32 = torch.float32
        h = h + self._norm(a, lw.post_attention_norm, f32)
        m1 = self._norm(self._mlp(lw, self._norm(h, lw.ffn_norm, self.dtype)), lw.post_ffw_norm_1, f32)
        topk_ids, topk_w = self._route(lw, h)
        m2 = self.moe.forward(i, self._norm(h, lw.pre_ffw_norm_2, self.dtype), topk_ids, topk_w)
        h = h + self._norm(m1 + self._norm(m2, lw.post_ffw_norm_2, f32), lw.post_ffw_norm, f32)
        return h * lw.layer_scalar

    def _attention(
        self,
        i: int,
        lw: LayerWeights,
        x: torch.Tensor,  # [T, H] normed
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        pool: KVPool,
    ) -> torch.Tensor:  # [T, H]
        cfg = self.cfg
        T = x.shape[0]
        sliding = self._is_sliding[i]
        D = cfg.head_dim_swa if sliding else cfg.head_dim_full
        kvh = cfg.num_kv_heads_swa if sliding else cfg.num_kv_heads_full
        half = self.ropes["sliding" if sliding else "full"].half
        cos, sin = rope
        q = self._linear(x, lw.q_proj).view(T, cfg.num_heads, D)  # [T, NH, D]
        k_raw = self._linear(x, lw.k_proj).view(T, kvh, D)  # [T, KVH, D]
        # K = V on full layers (no v_proj)
        v_raw = k_raw if lw.v_proj is None else self._linear(x, lw.v_proj).view(T, kvh, D)
        if self._glue and native_ops.fits(q, k_raw, v_raw) and cos.is_contiguous() and sin.is_contiguous():
            eps = cfg.rms_norm_eps
            v = native_ops.rms_norm(v_raw, None, eps)  # before k_raw (which may be v_raw) is normed in place
            q = native_ops.norm_rope_(q, lw.q_norm, eps, cos, sin, half)
            k = native_ops.norm_rope_(k_raw, lw.k_norm, eps, cos, sin, half)
        else:
            q = apply_rope(self._norm(q, lw.q_norm), cos, sin, half)
            k = apply_rope(self._norm(k_raw, lw.k_norm), cos, sin, half)
            v = self._norm(v_raw, None)
        o = self.attn.forward(i, q, k, v, meta, pool)  # [T, NH, D]
        return self._linear(o.reshape(T, cfg.num_heads * D), lw.o_proj)

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self._linear(x, lw.gate_proj), approximate="tanh")  # [T, I]
        return self._linear(gate * self._linear(x, lw.up_proj), lw.down_proj)

    def _route(self, lw: LayerWeights, h: torch.Tensor,
               i: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk ids [T, K] int64, weights [T, K] fp32): softmax over all experts, top-k, renormalise,
        times per_expert_scale. With layer `i` on the native path the two scales are one weight."""
        if i is not None and self._glue:  # norm, both scales, linear, softmax, top-k, renorm: one call
            return native_ops.router(h, self._router_w[i], self.cfg.rms_norm_eps, lw.router,
                                     self.cfg.top_k_experts, lw.per_expert_scale)
        t = self._norm(h, None, torch.float32) * lw.router_scale * self.router_input_scale  # [T, H]
        probs = torch.softmax(F.linear(t, lw.router), dim=-1, dtype=torch.float32)  # [T, E]
        w, ids = torch.topk(probs, self.cfg.top_k_experts, dim=-1)  # [T, K]
        w = w / w.sum(dim=-1, keepdim=True)
        return ids, w * lw.per_expert_scale[ids]
