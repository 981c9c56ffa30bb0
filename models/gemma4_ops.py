"""The steps of a Gemma 4 decoder layer that differ by backend, one implementation per backend.

models/gemma4.py's `Gemma4Model._layer` is the one layer body (attention, then the dense MLP and the
routed experts, then the tail); it calls a `LayerOps` for every step that is not the same everywhere:
- `TorchOps`: the reference, torch ops (CPU, and CUDA without the fused path);
- `NativeOps`: the CPU native glue (engine/quant/native_ops.py: ~1 call where torch takes 5-20 ops);
- `FusedOps` (models/gemma4_fused.py): the Triton kernels of engine/fused on the device path.
The model picks one at build (and the fused one per step, when the step runs the device kernels).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from swaserve.engine.attention.base import AttentionBackend, AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.config import ModelConfig
from swaserve.engine.moe.base import MoEBackend
from swaserve.engine.quant import native_ops
from swaserve.engine.quant.base import QWeight
from swaserve.models.weights import LayerWeights

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, n] fp32 of one layer kind at the step's positions


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


class ModelParts(Protocol):
    """What the ops read of their model (models/gemma4.py's Gemma4Model), at each call: a test may swap
    the model's attention backend or linear between steps."""

    cfg: ModelConfig
    dtype: torch.dtype  # compute dtype of the linears and attention; the residual stream is fp32
    attn: AttentionBackend
    moe: MoEBackend
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H] fp32
    router_input_scale: float

    def _linear(self, x: torch.Tensor, w: QWeight) -> torch.Tensor: ...


class Branches(NamedTuple):
    """The residual after attention and, where a backend makes them with it (fused), the normed inputs
    of the dense MLP, the routed experts and the router; the CPU ops norm `h` in each branch instead."""

    h: torch.Tensor  # [T, H] fp32
    mlp: torch.Tensor | None = None  # [T, H] compute dtype
    moe: torch.Tensor | None = None  # [T, H] compute dtype
    router: torch.Tensor | None = None  # [T, H] fp32, with both router scales


class LayerOps(ABC):
    """One backend's implementation of the layer steps. h is the fp32 residual stream [T, H] (a backend
    may update it in place: the forward's own tensor), x a normed input in the compute dtype."""

    def __init__(self, model: ModelParts):
        self.model = model

    @abstractmethod
    def linear(self, x: torch.Tensor, w: QWeight) -> torch.Tensor:
        """x [T, K] @ W^T -> [T, N]."""

    def first_input(self, h: torch.Tensor) -> torch.Tensor | None:
        """Layer 0's input norm when each tail makes the next layer's (fused), else None."""
        return None

    @abstractmethod
    def input_norm(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """norm(h) * attn_norm [T, H]."""

    @abstractmethod
    def attend(self, i: int, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
               half: int, sliding: bool, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        """q [T, NH, D], k / v [T, KVH, D] raw projections (v may be k) -> attention output [T, NH, D]:
        q and k normed and roped, v normed, K/V stored to the pool, paged attention."""

    def after_attention(self, h: torch.Tensor, a: torch.Tensor) -> LayerOps:
        """The ops for the rest of the layer (the native glue hands tensors it cannot take to torch)."""
        return self

    @abstractmethod
    def post_attention(self, lw: LayerWeights, h: torch.Tensor, a: torch.Tensor) -> Branches:
        """The residual h + norm(a) * post_attention_norm (and the branch inputs, where made here)."""

    @abstractmethod
    def mlp(self, lw: LayerWeights, b: Branches) -> torch.Tensor:
        """The dense MLP on norm(h) * ffn_norm, [T, H] as this backend's tail takes it."""

    @abstractmethod
    def route(self, i: int, lw: LayerWeights, b: Branches) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk ids [T, K] int64, weights [T, K] fp32): softmax over all experts of the router on the
        scaled norm(h), top-k, renormalised, times per_expert_scale."""

    @abstractmethod
    def experts(self, i: int, lw: LayerWeights, b: Branches, topk_ids: torch.Tensor,
                topk_w: torch.Tensor) -> torch.Tensor:
        """The routed experts on norm(h) * pre_ffw_norm_2, as this backend's tail takes them."""

    @abstractmethod
    def tail(self, i: int, lw: LayerWeights, h: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(h + norm(norm(m1) * w1 + norm(m2) * w2) * post_ffw_norm) * layer_scalar, and the next
        layer's input norm (the final norm after the last layer) when this backend makes it here."""

    @abstractmethod
    def final_norm(self, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        """The fp32 hidden [T, H] after the final norm (x: what the last tail made)."""


class TorchOps(LayerOps):
    """The reference: torch ops, branch inputs in the compute dtype, the residual and norms in fp32."""

    def linear(self, x: torch.Tensor, w: QWeight) -> torch.Tensor:
        return self.model._linear(x, w)

    def _norm(self, x: torch.Tensor, w: torch.Tensor | None, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
        return rms_norm(x, w, self.model.cfg.rms_norm_eps, dtype)

    def input_norm(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h, lw.attn_norm, self.model.dtype)

    def attend(self, i: int, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
               half: int, sliding: bool, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        cos, sin = rope
        q = apply_rope(self._norm(q, lw.q_norm), cos, sin, half)  # [T, NH, D]
        k = apply_rope(self._norm(k, lw.k_norm), cos, sin, half)  # [T, KVH, D]
        v = self._norm(v, None)  # the raw v (k's tensor on K = V layers)
        return self.model.attn.forward(i, q, k, v, meta, pool)

    def post_attention(self, lw: LayerWeights, h: torch.Tensor, a: torch.Tensor) -> Branches:
        return Branches(h + self._norm(a, lw.post_attention_norm, torch.float32))

    def _dense(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.linear(x, lw.gate_proj), approximate="tanh")  # [T, I]
        return self.linear(gate * self.linear(x, lw.up_proj), lw.down_proj)  # [T, H]

    def mlp(self, lw: LayerWeights, b: Branches) -> torch.Tensor:
        m = self._dense(lw, self._norm(b.h, lw.ffn_norm, self.model.dtype))  # [T, H]
        return self._norm(m, lw.post_ffw_norm_1, torch.float32)

    def route(self, i: int, lw: LayerWeights, b: Branches) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._norm(b.h, None, torch.float32) * lw.router_scale * self.model.router_input_scale  # [T, H]
        probs = torch.softmax(F.linear(t, lw.router), dim=-1, dtype=torch.float32)  # [T, E]
        w, ids = torch.topk(probs, self.model.cfg.top_k_experts, dim=-1)  # [T, K]
        w = w / w.sum(dim=-1, keepdim=True)
        return ids, w * lw.per_expert_scale[ids]

    def experts(self, i: int, lw: LayerWeights, b: Branches, topk_ids: torch.Tensor,
                topk_w: torch.Tensor) -> torch.Tensor:
        x = self._norm(b.h, lw.pre_ffw_norm_2, self.model.dtype)  # [T, H]
        return self.model.moe.forward(i, x, topk_ids, topk_w)  # [T, H]

    def tail(self, i: int, lw: LayerWeights, h: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        f32 = torch.float32  # m1 came normed from mlp()
        h = h + self._norm(m1 + self._norm(m2, lw.post_ffw_norm_2, f32), lw.post_ffw_norm, f32)
        return h * lw.layer_scalar, None

    def final_norm(self, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        return self._norm(h, self.model.final_norm)


def native_glue_fits(layers: list[LayerWeights]) -> bool:
    """Whether every layer's norm weights suit the native glue calls (CPU fp32 contiguous, sizes of 8s)."""
    for lw in layers:
        norms = (lw.attn_norm, lw.post_attention_norm, lw.ffn_norm, lw.pre_ffw_norm_2, lw.post_ffw_norm_1,
                 lw.post_ffw_norm_2, lw.post_ffw_norm, lw.q_norm, lw.k_norm, lw.router_scale)
        pes = lw.per_expert_scale
        if not (native_ops.fits(*norms, lw.router) and pes.dtype == torch.float32 and pes.is_contiguous()
                and lw.layer_scalar.numel() == 1):
            return False
    return True


class NativeOps(TorchOps):
    """The CPU native glue (fp32): norms, rope, residual adds, router and tail as one native call each;
    h is updated in place. Tensors the calls cannot take go through the torch ops."""

    def __init__(self, model: ModelParts):
        super().__init__(model)
        self.torch = TorchOps(model)
        self.eps = model.cfg.rms_norm_eps
        self.scalars = [float(lw.layer_scalar) for lw in model.layers]
        self.router_w = [(lw.router_scale * model.router_input_scale).float().contiguous()
                         for lw in model.layers]  # the router's two scales as one weight

    def input_norm(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return native_ops.rms_norm(h, lw.attn_norm, self.eps)

    def final_norm(self, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        w = self.model.final_norm
        return native_ops.rms_norm(h, w, self.eps) if native_ops.fits(h, w) else super().final_norm(h, x)

    def attend(self, i: int, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
               half: int, sliding: bool, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        cos, sin = rope
        if not (native_ops.fits(q, k, v) and cos.is_contiguous() and sin.is_contiguous()):
            return super().attend(i, lw, q, k, v, rope, half, sliding, meta, pool)
        v = native_ops.rms_norm(v, None, self.eps)  # before k (which may be v) is normed in place
        q = native_ops.norm_rope_(q, lw.q_norm, self.eps, cos, sin, half)
        k = native_ops.norm_rope_(k, lw.k_norm, self.eps, cos, sin, half)
        return self.model.attn.forward(i, q, k, v, meta, pool)

    def after_attention(self, h: torch.Tensor, a: torch.Tensor) -> LayerOps:
        return self if native_ops.fits(h, a) else self.torch

    def post_attention(self, lw: LayerWeights, h: torch.Tensor, a: torch.Tensor) -> Branches:
        return Branches(native_ops.rms_norm_add_(h, a, lw.post_attention_norm, self.eps))

    def mlp(self, lw: LayerWeights, b: Branches) -> torch.Tensor:
        return self._dense(lw, native_ops.rms_norm(b.h, lw.ffn_norm, self.eps))  # the tail norms it

    def _dense(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(x, lw.gate_proj), self.linear(x, lw.up_proj)  # [T, I] each
        act = (native_ops.gelu_mul(gate, up) if native_ops.fits(gate, up)  # the experts' gelu: same bits
               else F.gelu(gate, approximate="tanh") * up)
        return self.linear(act, lw.down_proj)  # [T, H]

    def route(self, i: int, lw: LayerWeights, b: Branches) -> tuple[torch.Tensor, torch.Tensor]:
        # norm, both scales, linear, softmax, top-k, renorm: one call
        return native_ops.router(b.h, self.router_w[i], self.eps, lw.router, self.model.cfg.top_k_experts,
                                 lw.per_expert_scale)

    def experts(self, i: int, lw: LayerWeights, b: Branches, topk_ids: torch.Tensor,
                topk_w: torch.Tensor) -> torch.Tensor:
        x = native_ops.rms_norm(b.h, lw.pre_ffw_norm_2, self.eps)  # [T, H]
        return self.model.moe.forward(i, x, topk_ids, topk_w)  # [T, H]

    def tail(self, i: int, lw: LayerWeights, h: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not native_ops.fits(m1, m2):
            m1, m2 = m1.float().contiguous(), m2.float().contiguous()
        return native_ops.ffn_tail_(h, m1, m2, lw.post_ffw_norm_1, lw.post_ffw_norm_2, lw.post_ffw_norm,
                                    self.eps, self.scalars[i]), None
