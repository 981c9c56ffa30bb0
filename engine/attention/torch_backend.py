"""Torch attention over the paged KV pools: the reference backend and the CPU fast path.

Per batch and pool kind (full / sliding) a gather plan is built once and kept in the metadata's
`backend_plans` (so build a new AttentionMetadata per batch; never mutate one between steps).
Decode rows (q_len 1) are padded into one batched SDPA call. Prefill rows are cut into blocks
of `QUERY_BLOCK` query rows on absolute positions ([k * QUERY_BLOCK, (k + 1) * QUERY_BLOCK), a chunk's
first and last blocks partial); a block attends to the keys its positions can see: [max(0, A - window + 1),
B) on sliding layers (so the cost is linear in the prompt length) and [0, B) on full layers, [A, B) the
block's whole span, with a small [QUERY_BLOCK, keys] mask (on sliding layers under bidirectional image
attention a block's keys reach the end of the last image it holds: AttentionMetadata.key_ends). A partial
block is padded to QUERY_BLOCK rows (zero queries) and reads the keys of its whole span (past the chunk's
end: a real slot, masked), so every SDPA call that computes a row has the same shape and the row the same
place in it whatever the chunking: torch's CPU flash kernel rounds by the call's key count and query tile,
and the same row then gives the same bits with its prefix cached or not (chunk-invariant; docs/cache.md
"Reuse that does not change answers"). No is_causal call for the same reason.
Each sequence's visible keys are gathered from the pool once per layer; blocks slice them. Inputs
are 4-D so torch picks its fused (flash) CPU kernel; GQA uses `enable_gqa`, K/V are never repeated.
q8_0 / fp8 pools are dequantized as they are gathered (the oracle of the other backends' 8-bit paths:
attention over the dequantized keys, nothing else changes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from swaserve.engine.attention.base import AttentionBackend, AttentionMetadata, write_kv
from swaserve.engine.attention.kv_format import Q8_BLOCK, Q8_BLOCK_BYTES
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.quant.blocks_legacy import decode_q8_0
from swaserve.engine.quant.kv_quant import head_dim

QUERY_BLOCK = 64  # query rows per prefill block (64: a small chunk pads little; measured no slower at 2048)
# Chunk-invariant prefill blocks (see the module docstring); False: blocks from the chunk's first row, as
# before (tools/cpu/chunk_invariance.py measures both)
INVARIANT = True


@dataclass
class _Block:
    first_row: int  # first query row in the flat batch
    num_rows: int  # query rows
    key_start: int  # first visible key, as an offset into the sequence's gathered keys
    key_end: int  # one past the last visible key (same offsets)
    mask: torch.Tensor | None  # [rows, key_end - key_start] bool, True = attend; None = is_causal
    pad_before: int = -1  # invariant blocks (QUERY_BLOCK rows): zero query rows before the first real one


@dataclass
class _Prefill:
    slots: torch.Tensor  # [S] int64 pool slots of every key any block of this sequence sees
    blocks: list[_Block] = field(default_factory=list)


@dataclass
class Plan:
    decode_rows: torch.Tensor | None  # [Bd] int64 rows of the q_len-1 sequences
    decode_slots: torch.Tensor | None  # [Bd, S] int64
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, S] bool
    decode_counts: torch.Tensor | None  # [Bd] int64 valid keys per row (the first ones of its S)
    prefills: list[_Prefill]


def _key_start(pos: int, window: int, sliding: bool) -> int:
    """First key a query at `pos` can see."""
    return max(0, pos - window + 1) if sliding else 0


def _plan_decodes(meta: AttentionMetadata, decodes: list[int], table: torch.Tensor, sliding: bool,
                  plan: Plan, device: torch.device) -> None:
    """The decode rows' slots, mask and key counts. Built in numpy on the host (~1 us an op against
    torch's ~5-10: this runs every decode step, ~0.3 ms of a 5 ms batch-1 `small` step in torch ops)."""
    page_size, window = meta.page_size, meta.window
    cu = meta.cu_q_lens
    prefix = np.array([meta.prefix_lens[b] for b in decodes], dtype=np.int64)  # [Bd]
    lens = prefix + 1
    starts = np.maximum(prefix - window + 1, 0) if sliding else np.zeros_like(prefix)  # [Bd]
    counts = lens - starts
    kpos = starts[:, None] + np.arange(int(counts.max()), dtype=np.int64)[None, :]  # [Bd, S]
    valid = kpos < lens[:, None]  # [Bd, S]
    kpos = np.where(valid, kpos, starts[:, None])  # padded -> a real key
    rows = table.cpu().numpy()[decodes]  # [Bd, max_pages]
    pages = np.take_along_axis(rows, kpos // page_size, axis=1).astype(np.int64, copy=False)  # [Bd, S]
    plan.decode_rows = torch.tensor([cu[b] for b in decodes], dtype=torch.int64, device=device)
    plan.decode_slots = torch.from_numpy(pages * page_size + kpos % page_size).to(device)  # [Bd, S]
    plan.decode_mask = torch.from_numpy(valid).to(device)[:, None, None, :]  # [Bd, 1, 1, S]
    plan.decode_counts = torch.from_numpy(counts).to(device)  # [Bd]


def _plan_prefill(first_row: int, prefix: int, num_rows: int, window: int, page_size: int,
                  table_row: torch.Tensor, sliding: bool, device: torch.device,
                  ends: list[int] | None = None, invariant: bool = False) -> _Prefill:
    """`ends`: the rows' key ends (AttentionMetadata.key_ends; sliding layers; None: causal).
    `invariant`: blocks on absolute multiples of QUERY_BLOCK, each padded to the same SDPA call whatever
    the chunk (QUERY_BLOCK query rows, keys [first key of the block's first position, block end)), so a
    row's result does not depend on where its chunk starts or ends."""
    end = prefix + num_rows
    if not invariant and not sliding and prefix == 0:
        kpos = torch.arange(0, end, device=device)  # [S]
        pf = _Prefill(table_row[kpos // page_size] * page_size + kpos % page_size)
        pf.blocks.append(_Block(first_row, num_rows, 0, num_rows, None))  # plain causal, whole sequence
        return pf
    qb = QUERY_BLOCK
    cuts = [prefix, *range((prefix // qb + 1) * qb, end, qb)] if invariant else [*range(prefix, end, qb)]
    spans = []  # (a, b, first position of the call's rows, its rows, first key, key end)
    for a in cuts:
        if invariant:
            a0 = a // qb * qb
            b, r0, nr, hi = min(end, a0 + qb), a0, qb, a0 + qb
        else:
            b = min(end, a + qb)
            r0, nr, hi = a, b - a, b
        if ends is not None:  # an image's tokens also see its later tokens (all in this chunk)
            hi = max(hi, *ends[a - prefix:b - prefix])
        spans.append((a, b, r0, nr, _key_start(r0, window, sliding), hi))
    start, stop = min(s[4] for s in spans), max(s[5] for s in spans)
    # [S]; keys only padding rows see (before the chunk's first visible key, past its end): a real slot
    kpos = torch.arange(start, stop, device=device).clamp_(_key_start(prefix, window, sliding), end - 1)
    pf = _Prefill(table_row[kpos // page_size] * page_size + kpos % page_size)
    for a, b, r0, nr, lo, hi in spans:
        qpos = torch.arange(r0, r0 + nr, device=device)[:, None]  # [nr, 1]
        mask_end = qpos + 1  # [nr, 1]
        if ends is not None:
            row_ends = torch.tensor(ends[a - prefix:b - prefix], device=device)
            mask_end = mask_end.clone()
            mask_end[a - r0:b - r0, 0] = row_ends
        kp = torch.arange(lo, hi, device=device)[None, :]  # [1, Sb]
        mask = kp < mask_end  # [nr, Sb]
        if sliding:
            mask &= kp > qpos - window
        pf.blocks.append(_Block(first_row + a - prefix, b - a, lo - start, hi - start, mask,
                                a - r0 if invariant else -1))
    return pf


def build_plan(meta: AttentionMetadata, sliding: bool, device: torch.device) -> Plan:
    """Gather plan of one pool kind: which pool slots (and mask) each query row attends to."""
    table = meta.swa_page_table if sliding else meta.full_page_table  # [B, max_pages]
    table = table.to(device)
    plan = Plan(None, None, None, None, [])
    decodes = [b for b, q in enumerate(meta.q_lens) if q == 1]
    if decodes:
        _plan_decodes(meta, decodes, table, sliding, plan, device)
    cu = meta.cu_q_lens
    bidir = sliding and meta.key_ends is not None
    for b, n in enumerate(meta.q_lens):
        if n > 1:
            ends = meta.key_ends[cu[b]:cu[b] + n] if bidir else None  # type: ignore[index]
            plan.prefills.append(_plan_prefill(cu[b], meta.prefix_lens[b], n, meta.window, meta.page_size,
                                               table[b], sliding, device, ends, INVARIANT))
    return plan


def get_plan(meta: AttentionMetadata, sliding: bool, device: torch.device) -> Plan:
    key = ("torch", sliding, str(device))
    plan = meta.backend_plans.get(key)
    if plan is None:
        plan = meta.backend_plans[key] = build_plan(meta, sliding, device)
    return plan


class TorchAttentionBackend(AttentionBackend):
    def __init__(self) -> None:
        # reused gather buffers: a fresh multi-MB tensor per layer costs more in page faults than the copy
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _buf(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (tag, dtype, device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:numel].view(shape)

    def _decode(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, plan: Plan,
                out: torch.Tensor) -> None:
        """The q_len-1 rows: padded into one batched SDPA call over their gathered keys."""
        T, H, D = q.shape
        KVH = K.shape[1]
        rows = plan.decode_rows
        Bd, S = plan.decode_slots.shape
        flat = plan.decode_slots.view(-1)  # [Bd * S]
        kg = self._gather("k", K, flat, q.dtype).view(Bd, S, KVH, D).transpose(1, 2)  # [Bd, KVH, S, D]
        vg = self._gather("v", V, flat, q.dtype).view(Bd, S, KVH, D).transpose(1, 2)  # [Bd, KVH, S, D]
        qd = q[rows].view(Bd, KVH, H // KVH, D)  # [Bd, KVH, G, D] (group folded into the query length)
        o = F.scaled_dot_product_attention(qd, kg, vg, attn_mask=plan.decode_mask, scale=1.0)
        out[rows] = o.reshape(Bd, H, D)

    def _gather(self, tag: str, src: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values of src[idx] ([n, KVH, D]) in `dtype` (src: a pool view [S, KVH, R]; q8_0 rows are
        dequantized), written into a reused buffer (valid until the next call)."""
        n, kvh = idx.numel(), src.shape[1]
        raw = self._buf(tag, (n, *src.shape[1:]), src.dtype, src.device)  # [n, KVH, R]
        if src.dtype == torch.float8_e4m3fn:  # torch has no fp8 index_select: as bytes
            torch.index_select(src.view(torch.uint8), 0, idx, out=raw.view(torch.uint8))
        else:
            torch.index_select(src, 0, idx, out=raw)
        if src.dtype == dtype:
            return raw
        if src.dtype == torch.uint8:  # q8_0 blocks -> fp32 (exact), then dtype
            vals = self._buf(tag + "_q8", (n, kvh, head_dim(src)), torch.float32, src.device)
            decode_q8_0(raw.view(-1, Q8_BLOCK_BYTES), out=vals.view(-1, Q8_BLOCK))
            if dtype == torch.float32:
                return vals
            raw = vals
        return self._buf(tag + "_cast", (n, kvh, raw.shape[2]), dtype, src.device).copy_(raw)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        meta: AttentionMetadata,
        pool: KVPool,
    ) -> torch.Tensor:  # [T, H, D]
        sliding, K, V = write_kv(layer, k, v, meta, pool)  # [slots, KVH, R]
        out = torch.empty_like(q)  # [T, H, D]
        plan = get_plan(meta, sliding, q.device)
        if plan.decode_rows is not None:
            self._decode(q, K, V, plan, out)
        if plan.prefills:
            self._prefill(q, K, V, meta, sliding, plan, out)
        return out

    def _prefill(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, meta: AttentionMetadata,
                 sliding: bool, plan: Plan, out: torch.Tensor) -> None:
        """The q_len > 1 rows: per sequence its visible keys gathered once, one SDPA call per block."""
        G = q.shape[1] // K.shape[1]
        for pf in plan.prefills:
            kg = self._gather("k", K, pf.slots, q.dtype).transpose(0, 1)[None]  # [1, KVH, S, D]
            vg = self._gather("v", V, pf.slots, q.dtype).transpose(0, 1)[None]  # [1, KVH, S, D]
            for blk in pf.blocks:
                r0, r1 = blk.first_row, blk.first_row + blk.num_rows
                k0, k1 = blk.key_start, blk.key_end
                p0 = max(blk.pad_before, 0)
                if blk.pad_before < 0 or blk.num_rows == QUERY_BLOCK:
                    qb = q[r0:r1].transpose(0, 1)[None]  # [1, H, n, D]
                else:  # a partial block: its real rows at their place among QUERY_BLOCK rows
                    qb = q.new_zeros(1, q.shape[1], QUERY_BLOCK, q.shape[2])  # [1, H, QUERY_BLOCK, D]
                    qb[0, :, p0:p0 + blk.num_rows] = q[r0:r1].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    qb, kg[:, :, k0:k1], vg[:, :, k0:k1], attn_mask=blk.mask,
                    is_causal=blk.mask is None, scale=1.0, enable_gqa=G > 1)  # [1, H, rows, D]
                out[r0:r1] = o[0, :, p0:p0 + blk.num_rows].transpose(0, 1)
