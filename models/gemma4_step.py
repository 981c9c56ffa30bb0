"""Decode steps in one native call: models/gemma4_decode.py's flat loop run by native_step.c.

The layer loop of a decode step (the same calls as the flat loop, same order) runs in C: descriptors of
every layer's weights and pool views are built once per model and pool, each step passes its rope rows,
slots, attention plans and scratch buffers in one struct. Taken where the flat loop is and, beyond it,
every linear is Q4_0 in the interleaved form, the routed experts are Q4_0 in host memory (`CpuMoE`), and
the dense MLP's width is the same in every layer; otherwise the flat loop runs.

Numerics: the flat loop's calls on the same values, so the same bits (tests/models/test_decode_path.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.attention.torch_backend import Plan
from swaserve.engine.moe.cpu_backend import CpuMoE
from swaserve.engine.quant import native_ops, native_step
from swaserve.engine.quant.linear import native_ok

_SCRATCH = ("x", "q", "k", "v", "a", "gu", "m1", "m2", "wts")


def _packed(w: Any) -> torch.Tensor | None:
    """The interleaved Q4_0 form of a linear's weight, or None where it has none."""
    return w.cache.interleaved if w is not None and native_ok(w) else None


class NativeStep:
    """The native step of one model (`ok`: whether its weights are ones native_step.c runs)."""

    def __init__(self, model: Any):
        self.model = model
        self.enabled = True  # tests and tools switch it to compare with the flat loop
        self._pool: KVPool | None = None
        self._layers: ctypes.Array | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._ok: tuple[Any, bool] | None = None  # (the MoE backend it was checked with, ok)

    @property
    def ok(self) -> bool:
        """Whether the model's weights are ones native_step.c runs (checked once per MoE backend)."""
        if self._ok is None or self._ok[0] is not self.model.moe:
            self._ok = (self.model.moe, self._weights_ok())
        return self._ok[1]

    def _weights_ok(self) -> bool:
        model = self.model
        moe = model.moe
        if not (native_step.available() and isinstance(moe, CpuMoE) and all(k == "q4" for k in moe.kinds)):
            return False
        widths = {lw.gate_proj.shape[0] for lw in model.layers}
        for lw in model.layers:
            linears = (lw.q_proj, lw.k_proj, lw.o_proj, lw.gate_proj, lw.up_proj, lw.down_proj)
            if any(_packed(w) is None for w in linears):
                return False
            if lw.v_proj is not None and _packed(lw.v_proj) is None:
                return False
        return len(widths) == 1 and widths.pop() % 8 == 0

    def takes(self) -> bool:
        return self.enabled and self.ok

    def _layer_table(self, pool: KVPool) -> ctypes.Array:
        """The StepLayer array of the model's layers over `pool` (built once per pool)."""
        if self._pool is pool and self._layers is not None:
            return self._layers
        model, ops = self.model, self.model._ops
        table = (native_step.StepLayer * len(model.layers))()
        for i, lw in enumerate(model.layers):
            sliding, d, kvh = model._decode.layers[i]
            k, v = pool.kv(i)
            gu, dn = model.moe.weights[i]
            ptrs = dict(attn_norm=lw.attn_norm, q_norm=lw.q_norm, k_norm=lw.k_norm,
                        post_attn_norm=lw.post_attention_norm, ffn_norm=lw.ffn_norm,
                        pre_ffw_norm_2=lw.pre_ffw_norm_2, post_ffw_norm_1=lw.post_ffw_norm_1,
                        post_ffw_norm_2=lw.post_ffw_norm_2, post_ffw_norm=lw.post_ffw_norm,
                        router_rw=ops.router_w[i], router_w=lw.router, expert_scale=lw.per_expert_scale,
                        wq=_packed(lw.q_proj), wk=_packed(lw.k_proj), wv=_packed(lw.v_proj),
                        wo=_packed(lw.o_proj), wgate=_packed(lw.gate_proj), wup=_packed(lw.up_proj),
                        wdown=_packed(lw.down_proj), moe_gu=gu, moe_dn=dn)
            e = table[i]
            for name, t in ptrs.items():
                setattr(e, name, None if t is None else t.data_ptr())
            e.kc, e.k_rs, e.k_hs, e.kt = native_ops.kv_layout(k)
            e.vc, e.v_rs, e.v_hs, e.vt = native_ops.kv_layout(v)
            e.kind, e.D, e.KVH, e.scalar = 0 if sliding else 1, d, kvh, ops.scalars[i]
        self._pool, self._layers = pool, table
        return table

    def _scratch(self, T: int) -> dict[str, torch.Tensor]:
        """Scratch buffers for T rows (kept at the largest T seen)."""
        cfg = self.model.cfg
        d, kvh = max(cfg.head_dim_swa, cfg.head_dim_full), max(cfg.num_kv_heads_swa, cfg.num_kv_heads_full)
        ff, h = self.model.layers[0].gate_proj.shape[0], cfg.hidden_size
        per_row = dict(x=h, q=cfg.num_heads * d, k=kvh * d, v=kvh * d, a=cfg.num_heads * d, gu=2 * ff, m1=h,
                       m2=h, wts=cfg.top_k_experts)
        bufs = self._buffers
        if not bufs or bufs["ids"].shape[0] < T:
            bufs = {n: torch.empty(T, per_row[n], dtype=torch.float32) for n in _SCRATCH}
            bufs["ids"] = torch.empty(T, cfg.top_k_experts, dtype=torch.int64)
            self._buffers = bufs
        return bufs

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                rope: dict[str, tuple[torch.Tensor, torch.Tensor]], plans: dict[bool, Plan]) -> torch.Tensor:
        """The flat loop's result: the layers over the embedded decode rows h [T, H] fp32, in place."""
        model, cfg = self.model, self.model.cfg
        T = h.shape[0]
        assert native_ops.fits(h) and all(plans[s].decode_rows.numel() == T for s in plans), T
        keep = []  # the tensors the struct points to, alive until the call returns
        s = native_step.Step()
        s.h, s.T, s.H, s.NH = h.data_ptr(), T, cfg.hidden_size, cfg.num_heads
        s.FF, s.MI = model.layers[0].gate_proj.shape[0], cfg.moe_intermediate_size
        s.E, s.TOPK = model.layers[0].router.shape[0], cfg.top_k_experts
        s.nthreads, s.eps = torch.get_num_threads(), cfg.rms_norm_eps
        for kd, (kind, sliding) in enumerate((("sliding", True), ("full", False))):
            cos, sin = (t.contiguous() for t in rope[kind])
            plan = plans[sliding]
            store = (meta.swa_slots if sliding else meta.full_slots).to(torch.int64).contiguous()
            slots = plan.decode_slots.contiguous()
            keep += [cos, sin, store, slots]
            s.cos[kd], s.sin[kd], s.rope_n[kd] = cos.data_ptr(), sin.data_ptr(), cos.shape[-1]
            s.rope_half[kd] = model.ropes[kind].half
            s.store_slots[kd], s.rows[kd], s.slots[kd] = store.data_ptr(), plan.decode_rows.data_ptr(), \
                slots.data_ptr()
            s.counts[kd], s.S[kd] = plan.decode_counts.data_ptr(), slots.shape[1]
        for name, buf in self._scratch(T).items():
            setattr(s, name, buf.data_ptr())
        native_step.run(self._layer_table(pool), s)
        del keep
        return h
