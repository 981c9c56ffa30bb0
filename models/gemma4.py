"""The Gemma 4 text model (26B-A4B architecture) over the paged KV pools.

Facts: docs/model.md. Sliding and full layers differ in head_dim, KV heads and rope;
full layers use K = V (no v_proj) and "proportional" rope (only the first pairs rotate). Every
decoder layer has a dense MLP and a routed MoE whose outputs are summed. Norms run in fp32 with
the raw weight (no 1 + w); v_norm and the router norm have no weight. Linears go through
engine.quant.linear in the weights' stored form (with the engine's `cpu_matmul` numerics); routed
experts go to the MoE backend. One layer body (`Gemma4Model._layer`) serves every backend: the steps
that differ are a `LayerOps` chosen at build (models/gemma4_ops.py: torch, the native CPU glue;
models/gemma4_fused.py: the fused device kernels, taken by the steps that run them).
"""

from __future__ import annotations

import math

import torch

from swaserve.engine.attention.base import AttentionBackend, AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.config import CpuMatmul, ModelConfig
from swaserve.engine.fused.ops import use_device_kernels
from swaserve.engine.fused.weights import float_weight_to, logits_fp32
from swaserve.engine.moe.base import MoEBackend
from swaserve.engine.quant import native, native_ops
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.linear import embedding, linear, prepare_native
from swaserve.models.gemma4_decode import DecodePath
from swaserve.models.gemma4_fused import FusedOps
from swaserve.models.gemma4_ops import LayerOps, NativeOps, Rope, TorchOps, native_glue_fits
from swaserve.models.weights import Gemma4Weights, LayerWeights


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
        # the layer steps' backend (models/gemma4_ops.py): on the native CPU path the norms, rope,
        # residual adds, router and tail run as native calls; the exact path and CUDA keep torch
        glue = (self.device.type == "cpu" and cpu_matmul == "native" and dtype == torch.float32
                and native_ops.available() and native_glue_fits(self.layers))
        self._ops: LayerOps = NativeOps(self) if glue else TorchOps(self)
        self._fused = FusedOps(self)  # the device path's, for steps that run the device kernels
        self._decode = DecodePath(self)  # decode-only steps on the native glue (models/gemma4_decode.py)
        self.ropes = {
            "sliding": _Rope(cfg.rope_theta_swa, cfg.rope_dims_swa, cfg.rope_dims_swa // 2,
                             cfg.rope_dims_swa // 2, self.device),
            "full": _Rope(cfg.rope_theta_full, cfg.rope_dims_full, cfg.rope_full_rotated_pairs,
                          cfg.head_dim_full // 2, self.device),
        }

    # ---- public API ----

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T] (new tokens of every sequence, flat) -> fp32 hidden [T, H] after the final norm.
        images: (row index [M], fp32 rows [M, H]) placed in the embedded stream at those rows, unscaled
        (image soft tokens; their ids, pad ids past the vocabulary, are not looked up)."""
        ops = self._fused if self.fused_path() else self._ops
        ids = input_ids.to(self.device)
        positions = meta.positions.to(self.device)  # [T]
        if images is not None:
            ids = torch.where(ids < self.cfg.vocab_size, ids, torch.zeros_like(ids))
        h = embedding(ids, self.embed) * self.embed_scale  # [T, H] fp32 residual stream
        if images is not None:
            h[images[0].to(self.device)] = images[1].to(self.device, h.dtype)  # [M, H]
        rope = {kind: r.lookup(positions) for kind, r in self.ropes.items()}
        if images is None and ops is self._ops and self._decode.takes(meta, pool):
            return ops.final_norm(self._decode.forward(h, meta, pool, rope), None)  # the flat decode loop
        x = ops.first_input(h)  # [T, H] layer 0's input norm, or None: each layer norms its own
        for i, lw in enumerate(self.layers):
            kind = "sliding" if self._is_sliding[i] else "full"
            h, x = self._layer(i, lw, h, x, rope[kind], meta, pool, ops)
        return ops.final_norm(h, x)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, V] (tied lm_head, final softcap)."""
        x = hidden.to(self.dtype)
        out = logits_fp32(x, self.embed) if x.is_cuda else self._linear(x, self.embed).float()  # [N, V]
        cap = self.cfg.final_logit_softcap
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def fused_path(self) -> bool:
        """Whether forward runs the fused device kernels: on CUDA (or in the interpreter under
        engine.fused.ops.device_kernels()) with an attention backend that attends over the pool."""
        return use_device_kernels(self.device) and hasattr(self.attn, "attend")

    # ---- internals ----

    @property
    def _glue(self) -> bool:
        """Whether the layer steps run the native CPU glue (tests switch it to compare the two)."""
        return isinstance(self._ops, NativeOps)

    @_glue.setter
    def _glue(self, on: bool) -> None:
        self._ops = NativeOps(self) if on else TorchOps(self)

    def _linear(self, x: torch.Tensor, w: QWeight) -> torch.Tensor:
        packed = w.cache.interleaved  # built at load on the native path (prepare_native)
        if (self._glue and packed is not None and x.dim() == 2 and x.dtype == torch.float32
                and x.is_contiguous() and x.shape[1] == w.shape[1]):
            return native.mm_packed(x, packed, w.shape[0])  # linear()'s dispatch, ~10 us a call, skipped
        return linear(x, w, self.cpu_matmul)

    def _layer(
        self,
        i: int,
        lw: LayerWeights,
        h: torch.Tensor,  # [T, H] fp32 residual stream
        x: torch.Tensor | None,  # [T, H] this layer's input norm when the previous tail made it
        rope: Rope,
        meta: AttentionMetadata,
        pool: KVPool,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder layer, every backend: (the new h, the next layer's input norm or None)."""
        if x is None:
            x = ops.input_norm(lw, h)  # [T, H] compute dtype
        a = self._attention(i, lw, x, rope, meta, pool, ops)  # [T, H]
        ops = ops.after_attention(h, a)
        b = ops.post_attention(lw, h, a)  # the residual after attention (and the fused branch inputs)
        m1 = ops.mlp(lw, b)  # [T, H] dense MLP
        topk_ids, topk_w = ops.route(i, lw, b)  # [T, K] each
        m2 = ops.experts(i, lw, b, topk_ids, topk_w)  # routed experts
        return ops.tail(i, lw, b.h, m1, m2)

    def _attention(self, i: int, lw: LayerWeights, x: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                   pool: KVPool, ops: LayerOps) -> torch.Tensor:
        """x [T, H] normed -> the attention block's output [T, H] (before its post norm)."""
        cfg = self.cfg
        T = x.shape[0]
        sliding = self._is_sliding[i]
        D = cfg.head_dim_swa if sliding else cfg.head_dim_full
        kvh = cfg.num_kv_heads_swa if sliding else cfg.num_kv_heads_full
        half = self.ropes["sliding" if sliding else "full"].half
        q = ops.linear(x, lw.q_proj).view(T, cfg.num_heads, D)  # [T, NH, D]
        k = ops.linear(x, lw.k_proj).view(T, kvh, D)  # [T, KVH, D]
        v = k if lw.v_proj is None else ops.linear(x, lw.v_proj).view(T, kvh, D)  # K = V on full layers
        o = ops.attend(i, lw, q, k, v, rope, half, sliding, meta, pool)  # [T, NH, D]
        return ops.linear(o.reshape(T, cfg.num_heads * D), lw.o_proj)
