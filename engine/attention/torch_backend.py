"""Torch attention over the paged KV pools: the reference backend and the CPU fast path.

Per batch and pool kind (full / sliding) a gather plan is built once and cached on the metadata
object (so build a new AttentionMetadata per batch; never mutate one between steps). Decode rows
(q_len 1) are padded into one batched SDPA call; each prefill sequence runs on its own. Only the key
positions a sequence can see are gathered: [0, seq_len) on full layers, [max(0, prefix - W + 1),
seq_len) on sliding layers. GQA folds the query-head group into the query-length dimension, so K/V
are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.kv_pool import KVPool


@dataclass
class _Prefill:
    row0: int  # first row of this sequence in the flat batch
    n: int  # query tokens
    slots: torch.Tensor  # [S] int64 pool slots of the visible keys
    mask: torch.Tensor  # [n, S] bool, True = attend


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None  # [Bd] int64 rows of the q_len-1 sequences
    decode_slots: torch.Tensor | None  # [Bd, S] int64
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, S] bool
    prefills: list[_Prefill]


def _key_start(prefix: int, window: int, sliding: bool) -> int:
    return max(0, prefix - window + 1) if sliding else 0


def build_plan(meta: AttentionMetadata, sliding: bool, device: torch.device) -> _Plan:
    """Gather plan of one pool kind: which pool slots each query row attends to."""
    P, W = meta.page_size, meta.window
    table = meta.swa_page_table if sliding else meta.full_page_table  # [B, max_pages]
    table = table.to(device)
    cu = meta.cu_q_lens
    dec = [b for b, q in enumerate(meta.q_lens) if q == 1]
    plan = _Plan(None, None, None, [])
    if dec:
        lens = torch.tensor([meta.prefix_lens[b] + 1 for b in dec], dtype=torch.int64)  # [Bd]
        starts = torch.tensor([_key_start(meta.prefix_lens[b], W, sliding) for b in dec], dtype=torch.int64)
        s_max = int((lens - starts).max())
        kpos = starts[:, None] + torch.arange(s_max)[None, :]  # [Bd, S]
        valid = kpos < lens[:, None]  # [Bd, S]
        kpos = torch.where(valid, kpos, starts[:, None]).to(device)  # [Bd, S] padded -> a real key
        rows = torch.tensor(dec, dtype=torch.int64, device=device)
        pages = table[rows].gather(1, kpos // P)  # [Bd, S]
        plan.decode_rows = torch.tensor([cu[b] for b in dec], dtype=torch.int64, device=device)
        plan.decode_slots = pages * P + kpos % P  # [Bd, S]
        plan.decode_mask = valid.to(device)[:, None, None, :]  # [Bd, 1, 1, S]
    for b, n in enumerate(meta.q_lens):
        if n == 1 or n == 0:
            continue
        p = meta.prefix_lens[b]
        start, end = _key_start(p, W, sliding), p + n
        kpos = torch.arange(start, end, device=device)  # [S]
        slots = table[b, kpos // P] * P + kpos % P  # [S]
        qpos = torch.arange(p, end, device=device)[:, None]  # [n, 1]
        mask = kpos[None, :] <= qpos  # [n, S]
        if sliding:
            mask &= kpos[None, :] > qpos - W
        plan.prefills.append(_Prefill(cu[b], n, slots, mask))
    return plan


def _get_plan(meta: AttentionMetadata, sliding: bool, device: torch.device) -> _Plan:
    cache = meta.__dict__.setdefault("_torch_attn_plans", {})
    key = (sliding, str(device))
    if key not in cache:
        cache[key] = build_plan(meta, sliding, device)
    return cache[key]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        meta: AttentionMetadata,
        pool: KVPool,
    ) -> torch.Tensor:  # [T, H, D]
        sliding = pool.layer_kind(layer) == "sliding"
        K, V = pool.kv(layer)  # [slots, KVH, D]
        slots = meta.swa_slots if sliding else meta.full_slots  # [T]
        slots = slots.to(K.device)
        K.index_copy_(0, slots, k.to(K.dtype))
        V.index_copy_(0, slots, v.to(V.dtype))

        T, H, D = q.shape
        KVH = k.shape[1]
        G = H // KVH
        out = torch.empty_like(q)  # [T, H, D]
        plan = _get_plan(meta, sliding, q.device)
        if plan.decode_rows is not None:
            rows = plan.decode_rows
            Bd, S = plan.decode_slots.shape
            flat = plan.decode_slots.view(-1)  # [Bd * S]
            kg = K.index_select(0, flat).view(Bd, S, KVH, D).to(q.dtype).transpose(1, 2)  # [Bd, KVH, S, D]
            vg = V.index_select(0, flat).view(Bd, S, KVH, D).to(q.dtype).transpose(1, 2)  # [Bd, KVH, S, D]
            qd = q[rows].view(Bd, KVH, G, D)  # [Bd, KVH, G, D]
            o = F.scaled_dot_product_attention(qd, kg, vg, attn_mask=plan.decode_mask, scale=1.0)
            out[rows] = o.reshape(Bd, H, D)
        for pf in plan.prefills:
            n = pf.n
            kg = K.index_select(0, pf.slots).to(q.dtype).transpose(0, 1)  # [KVH, S, D]
            vg = V.index_select(0, pf.slots).to(q.dtype).transpose(0, 1)  # [KVH, S, D]
            qs = q[pf.row0:pf.row0 + n].view(n, KVH, G, D).permute(1, 2, 0, 3).reshape(KVH, G * n, D)
            mask = pf.mask.repeat(G, 1)  # [G * n, S]
            o = F.scaled_dot_product_attention(qs, kg, vg, attn_mask=mask, scale=1.0)  # [KVH, G * n, D]
            out[pf.row0:pf.row0 + n] = o.view(KVH, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
        return out
