"""Decode steps on the native CPU path in one flat loop: the same calls as `Gemma4Model._layer` with
`NativeOps` and `NativeAttentionBackend`, in the same order on the same tensors (so the same bits:
tests/models/test_decode_path.py), without the per-layer ops dispatch and the checks those layers make
per call (made once per step here).

Why: at batch 1 a `small` decode step was ~8 ms, of which ~2 ms was Python between the kernels (~20
calls a layer, each through its wrapper's checks; docs/benchmarks.md, "Batch-1 decode"). Taken when
every row of the step decodes one token, the pool's K/V are views the native decode attention reads and
no image is placed; any other step runs the general layer body.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from swaserve.engine.attention.base import AttentionMetadata, store_kv
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.attention.native_backend import NativeAttentionBackend
from swaserve.engine.attention.torch_backend import Plan, get_plan
from swaserve.engine.quant import native_ops
from swaserve.models.gemma4_ops import Branches, LayerOps, ModelParts, NativeOps
from swaserve.models.gemma4_step import NativeStep


class LoopModel(ModelParts, Protocol):
    """What the loop reads of models/gemma4.py's Gemma4Model beyond the layer ops' parts."""

    _ops: LayerOps
    _is_sliding: list[bool]
    ropes: dict[str, Any]  # kind -> its rope (the `half` offset of its pairs)


class DecodePath:
    """The flat decode loop of one model; per layer its kind, head dim and KV heads, read once."""

    def __init__(self, model: LoopModel):
        self.model = model
        self.linear = type(model)._linear  # the native packed matmul's outputs fit the native glue
        cfg = model.cfg
        self.eps = cfg.rms_norm_eps
        self.layers = [(s, cfg.head_dim_swa if s else cfg.head_dim_full,
                        cfg.num_kv_heads_swa if s else cfg.num_kv_heads_full) for s in model._is_sliding]
        self._views: tuple[KVPool | None, bool] = (None, False)  # (pool, its views suit decode_attn)
        self.native = NativeStep(model)  # the same loop in one native call, where the weights allow

    def takes(self, meta: AttentionMetadata, pool: KVPool) -> bool:
        """Whether this step is one the loop serves: the model on the native glue, its own linear and
        native decode attention (a test may switch any of them between steps), decode rows only, pool
        views decode_attn reads."""
        model = self.model
        if not (isinstance(model._ops, NativeOps) and type(model.attn) is NativeAttentionBackend
                and getattr(model._linear, "__func__", None) is self.linear):
            return False  # another linear (a test's, a tool's) may return what the native glue cannot take
        if any(n != 1 for n in meta.q_lens) or meta.key_ends is not None:
            return False
        if self._views[0] is not pool:  # a pool's views never change: checked once per pool
            self._views = (pool, all(native_ops.kv_view_ok(k, d) and native_ops.kv_view_ok(v, d)
                                     for (k, v), (_, d, _) in zip(map(pool.kv, range(len(self.layers))),
                                                                  self.layers, strict=True)))
        return self._views[1]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                rope: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The layers over the embedded rows h [T, H] fp32 (updated in place): the residual stream before
        the final norm, as Gemma4Model.forward's layer loop makes it."""
        model, cfg, eps = self.model, self.model.cfg, self.eps
        ops = model._ops  # NativeOps: its router weights and layer scalars
        linear = model._linear
        T, nh = h.shape[0], cfg.num_heads
        plans = {s: get_plan(meta, s, h.device) for s in (True, False)}
        if self.native.takes():
            return self.native.forward(h, meta, pool, rope, plans)
        for i, lw in enumerate(model.layers):
            sliding, d, kvh = self.layers[i]
            kind = "sliding" if sliding else "full"
            cos, sin = rope[kind]
            x = native_ops.rms_norm(h, lw.attn_norm, eps)
            q = linear(x, lw.q_proj).view(T, nh, d)
            k = linear(x, lw.k_proj).view(T, kvh, d)
            v = k if lw.v_proj is None else linear(x, lw.v_proj).view(T, kvh, d)
            v = native_ops.rms_norm(v, None, eps)  # before k (which may be v) is normed in place
            native_ops.norm_rope_(q, lw.q_norm, eps, cos, sin, model.ropes[kind].half)
            native_ops.norm_rope_(k, lw.k_norm, eps, cos, sin, model.ropes[kind].half)
            a = self.attend(i, q, k, v, meta, pool, plans[sliding])
            native_ops.rms_norm_add_(h, linear(a.view(T, nh * d), lw.o_proj), lw.post_attention_norm, eps)
            xm = native_ops.rms_norm(h, lw.ffn_norm, eps)
            m1 = ops._dense(lw, xm)  # NativeOps': gate / up / down through the model's linear
            topk_ids, topk_w = ops.route(i, lw, Branches(h))
            m2 = model.moe.forward(i, native_ops.rms_norm(h, lw.pre_ffw_norm_2, eps), topk_ids, topk_w)
            if not native_ops.fits(m1, m2):
                m1, m2 = m1.float().contiguous(), m2.float().contiguous()
            native_ops.ffn_tail_(h, m1, m2, lw.post_ffw_norm_1, lw.post_ffw_norm_2, lw.post_ffw_norm, eps,
                                 ops.scalars[i])
        return h

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               pool: KVPool, plan: Plan) -> torch.Tensor:
        """K/V of the new rows into the pool, then every row's decode attention: [T, NH, D]."""
        k_cache, v_cache = pool.kv(i)
        store_kv(k_cache, v_cache, meta.swa_slots if self.layers[i][0] else meta.full_slots, k, v)
        out = torch.empty_like(q)
        native_ops.decode_attn(q, plan.decode_rows, k_cache, v_cache, plan.decode_slots, plan.decode_counts,
                               out)
        return out
