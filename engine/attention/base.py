"""Attention backend ABC and the per-batch metadata every backend reads.

A batch is a flat ("varlen") list of new tokens from B sequences. Sequence b contributes
q_lens[b] new tokens at positions prefix_lens[b] .. prefix_lens[b] + q_lens[b] - 1; its KV for
earlier positions is already in the paged pools. Slot = page_id * page_size + offset_in_page.
A query at position p sees keys [0, p] on full layers and (p - window, key_end) on sliding layers, where
key_end is p + 1 (causal) or, for an image soft token under bidirectional image attention, the end of its
image's span (transformers' Gemma 4: AND(sliding window, OR(causal, same image))).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.quant import native_ops
from swaserve.engine.quant.kv_quant import encode


@dataclass
class AttentionMetadata:
    page_size: int
    window: int  # sliding window W of the sliding layers
    q_lens: list[int]  # [B] new tokens per sequence
    prefix_lens: list[int]  # [B] tokens already in the KV cache before this step
    positions: torch.Tensor  # [T] int64, absolute positions of the new tokens
    full_slots: torch.Tensor  # [T] int64, full-pool slot each new token's K/V is written to
    swa_slots: torch.Tensor  # [T] int64, SWA-pool slot each new token's K/V is written to
    # [B, max_pages] int64 page ids of each sequence's logical pages, -1 = no page.
    # Full: every page of [0, prefix + q) is present. SWA: pages covering
    # [max(0, prefix - W + 1), prefix + q) are present; earlier ones may be -1.
    full_page_table: torch.Tensor
    swa_page_table: torch.Tensor
    # What a backend derives from this batch once and reuses in every layer, keyed by the backend
    # (the torch backend's gather plans: ("torch", sliding, device) -> plan). Filled on a backend's
    # first forward of the batch; empty on a new or `to()`-copied metadata. Build a new
    # AttentionMetadata per batch; never mutate one between steps.
    backend_plans: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    # Device copies of the per-sequence lists, staged with the rest by build_metadata (None when the
    # metadata was built by hand: backends then stage them themselves). int32.
    cu_q_lens_t: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [B + 1]
    prefix_lens_t: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [B]
    decode_seqs_t: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [BD] q_len-1 rows
    # Bidirectional image attention, sliding layers only: one past the last key each new token sees
    # ([T], absolute; position + 1 for text, the end of its image's span for an image soft token: the
    # span's keys are all in this batch). None: causal (every token position + 1). Full layers are causal.
    key_ends: list[int] | None = None
    key_ends_t: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [T] int32 device copy

    @property
    def cu_q_lens(self) -> list[int]:
        out = [0]
        for q in self.q_lens:
            out.append(out[-1] + q)
        return out

    def to(self, device: torch.device | str) -> AttentionMetadata:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return AttentionMetadata(
            self.page_size, self.window, self.q_lens, self.prefix_lens,
            self.positions.to(device), self.full_slots.to(device), self.swa_slots.to(device),
            self.full_page_table.to(device), self.swa_page_table.to(device),
            cu_q_lens_t=move(self.cu_q_lens_t), prefix_lens_t=move(self.prefix_lens_t),
            decode_seqs_t=move(self.decode_seqs_t), key_ends=self.key_ends, key_ends_t=move(self.key_ends_t),
        )


class AttentionBackend(ABC):
    """Writes the new K/V into the pool, then attends. Scale is 1.0 (Gemma 4 norms q and k)."""

    @abstractmethod
    def forward(
        self,
        layer: int,  # model layer index; pool.layer_kind(layer) says sliding or full
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D] (roped, normed)
        v: torch.Tensor,  # [T, KVH, D]
        meta: AttentionMetadata,
        pool: KVPool,
    ) -> torch.Tensor:  # [T, H, D]
        ...


def write_kv(
    layer: int,
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    meta: AttentionMetadata,
    pool: KVPool,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Write the new tokens' K/V into their slots in the pool's types (q8_0 / fp8 quantized here);
    returns (sliding, K cache, V cache) ([S, KVH, R]: the pool's views)."""
    sliding = pool.layer_kind(layer) == "sliding"
    k_cache, v_cache = pool.kv(layer)  # [S, KVH, R]
    slots = (meta.swa_slots if sliding else meta.full_slots).to(k_cache.device)  # [T]
    store_kv(k_cache, v_cache, slots, k, v)
    return sliding, k_cache, v_cache


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache[slots] = k, v_cache[slots] = v (k, v [T, KVH, D] values; caches [S, KVH, R] pool views),
    each converted to its view's type."""
    for cache, x in ((k_cache, k), (v_cache, v)):
        if _native_q8(cache, x, slots):  # the same bytes in one native call (CPU decode steps)
            native_ops.kv_store_q8(cache, slots, x.float().contiguous())
            continue
        rows = encode(x, cache.dtype)  # [T, KVH, R]
        if cache.element_size() == 1:  # q8_0 bytes, fp8 (torch has no fp8 index_copy_): as bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.index_copy_(0, slots, rows)


def _native_q8(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether a q8_0 write goes through native_ops.kv_store_q8 (bit-exact with the torch quantizer)."""
    return (cache.dtype == torch.uint8 and x.device.type == "cpu" and slots.dtype == torch.int64
            and slots.is_contiguous() and native_ops.available()
            and native_ops.kv_view_ok(cache, x.shape[-1]))
