"""Decode steps through static device buffers, one CUDA graph per batch-size bucket.

A decode-only batch of n sequences runs in the smallest bucket b >= n (BUCKETS, up to
--max-running-requests): the step's inputs (token ids, positions, KV slots, both page tables, the
per-sequence lengths) are copied into buffers allocated once, rows n..b-1 repeat the last real row
(the same token at the same position written to the same slot: identical values, so the duplicate
KV writes are harmless, and their logits are dropped), and the bucket's captured graph of forward +
logits replays. Everything a graph bakes in is fixed per bucket: tensor shapes, the GEMV split
counts (from the weight shapes) and the attention decode split count (chosen from the GPU's
occupancy alone, not the context length: `TritonAttentionBackend.length_free_splits`).

Capture happens once at start (`capture_all`, after the KV pool is allocated: a warm-up step per
bucket compiles the Triton kernels first), on CUDA with the triton attention and MoE backends
(`--no-cuda-graphs` turns it off; the offload MoE's host bookkeeping and the CPU backends cannot be
captured). With `capture=False` the same static-buffer path runs eagerly: that is what the CPU tests
check against the plain path (same tokens).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.core import Batch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch-size buckets for up to `max_batch` decodes (the largest is max_batch itself)."""
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


def graphs_supported(model: Any) -> bool:
    """Whether a decode step of `model` can be captured: CUDA, the fused path over the triton attention
    backend, and an MoE backend without host work in the step."""
    return (model.device.type == "cuda" and model.fused_path()
            and getattr(model.moe, "graph_safe", False))


class DecodeGraphs:
    def __init__(self, model: Any, pool: KVPool, page_size: int, window: int, device: torch.device,
                 max_batch: int, max_pages: int, capture: bool):
        self.model, self.pool, self.page_size, self.window = model, pool, page_size, window
        self.device, self.capture = device, capture
        self.buckets = bucket_sizes(max_batch)
        B, P = self.buckets[-1], max_pages
        i64, i32 = torch.int64, torch.int32
        # one set of static inputs; bucket b uses the first b rows
        self.ids = torch.zeros(B, dtype=i64, device=device)
        self.positions = torch.zeros(B, dtype=i64, device=device)
        self.full_slots = torch.zeros(B, dtype=i64, device=device)
        self.swa_slots = torch.zeros(B, dtype=i64, device=device)
        self.full_table = torch.zeros(B, P, dtype=i64, device=device)
        self.swa_table = torch.zeros(B, P, dtype=i64, device=device)
        self.cu = torch.arange(B + 1, dtype=i32, device=device)  # every row one token
        self.prefix = torch.zeros(B, dtype=i32, device=device)
        self.dec = torch.arange(B, dtype=i32, device=device)
        self.max_pages = P
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (CUDAGraph, static logits)
        self.stats = {"steps": 0, "padded_rows": 0}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None

    # -- which batches ---------------------------------------------------------------------
    def bucket(self, batch: Batch) -> int | None:
        """The bucket of a decode-only batch whose rows all sample and whose pages fit, else None."""
        n = len(batch.reqs)
        if n == 0 or n > self.buckets[-1] or any(q != 1 for q in batch.q_lens) or not all(batch.sample):
            return None
        if -(-(max(batch.prefix_lens) + 1) // self.page_size) > self.max_pages:
            return None
        return next(b for b in self.buckets if b >= n)

    # -- running a step --------------------------------------------------------------------
    def run(self, batch: Batch, b: int) -> torch.Tensor:
        """fp32 logits [n, V] of a decode-only batch in bucket b."""
        n = len(batch.reqs)
        prefix = list(batch.prefix_lens) + [batch.prefix_lens[-1]] * (b - n)
        self._fill(batch, b)
        self.stats["steps"] += 1
        self.stats["padded_rows"] += b - n
        if self.capture:
            if b not in self.graphs:
                raise RuntimeError(f"no CUDA graph captured for batch bucket {b} (capture_all first)")
            graph, logits = self.graphs[b]
            graph.replay()
            return logits[:n]
        return self._step(b, self._meta(b, prefix))[:n]

    def _fill(self, batch: Batch, b: int) -> None:
        """The step's rows (padded to b by repeating the last) into the static buffers: one staged
        int64 copy, no wait for the device."""
        P, W, n = self.page_size, self.window, len(batch.reqs)
        ids, pos, fs, ss, ft, st, pre = [], [], [], [], [], [], []
        tokens = batch.input_ids()
        for r, p, t in zip(batch.reqs, batch.prefix_lens, tokens):
            npg = -(-(p + 1) // P)
            full = r.full_pages[:npg] + [-1] * (self.max_pages - npg)
            lo = max(0, p - W + 1) // P
            swa = [-1] * lo + [-1 if s is None else s for s in r.swa_pages[lo:npg]]
            swa += [-1] * (self.max_pages - npg)
            page, off = divmod(p, P)
            ids.append(t)
            pos.append(p)
            fs.append(full[page] * P + off)
            ss.append(swa[page] * P + off)
            ft += full
            st += swa
            pre.append(p)
        pad = b - n
        ids += ids[-1:] * pad
        pos += pos[-1:] * pad
        fs += fs[-1:] * pad
        ss += ss[-1:] * pad
        ft += ft[-self.max_pages:] * pad
        st += st[-self.max_pages:] * pad
        pre += pre[-1:] * pad
        host = torch.tensor(ids + pos + fs + ss + ft + st + pre, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        o = 0
        for dst, k in ((self.ids, b), (self.positions, b), (self.full_slots, b), (self.swa_slots, b),
                       (self.full_table.view(-1), b * self.max_pages),
                       (self.swa_table.view(-1), b * self.max_pages)):
            dst[:k].copy_(dev[o:o + k])
            o += k
        self.prefix[:b].copy_(dev[o:o + b])

    def _meta(self, b: int, prefix_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            self.page_size, self.window, [1] * b, prefix_lens, self.positions[:b], self.full_slots[:b],
            self.swa_slots[:b], self.full_table[:b], self.swa_table[:b], cu_q_lens_t=self.cu[:b + 1],
            prefix_lens_t=self.prefix[:b], decode_seqs_t=self.dec[:b])

    def _step(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.forward(self.ids[:b], meta, self.pool)  # [b, H]
        return self.model.logits(hidden)  # [b, V] fp32

    # -- capture ---------------------------------------------------------------------------
    def capture_all(self) -> None:
        """One warm-up step and one capture per bucket (largest first, sharing one memory pool). The
        dummy rows write position 0 of page 0: no request holds pages yet."""
        attn = self.model.attn
        before = torch.cuda.memory_reserved(self.device)
        old = getattr(attn, "length_free_splits", None)
        if old is not None:
            attn.length_free_splits = True  # a graph needs a split count independent of the context
        try:
            for b in sorted(self.buckets, reverse=True):
                meta = self._meta(b, [0] * b)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._step(b, meta)  # warm-up: compiles the kernels, settles the allocator
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._mempool):
                    logits = self._step(b, meta)
                self.graphs[b] = (graph, logits)
        finally:
            if old is not None:
                attn.length_free_splits = old
        torch.cuda.synchronize(self.device)
        # the graphs' memory pool comes on top of the KV pools sized before it (not budgeted there:
        # the peak-step reservation is what it may take from; to be measured on a GPU)
        log.info("captured CUDA graphs of the decode step for batch buckets %s (%.0f MiB more reserved)",
                 self.buckets, (torch.cuda.memory_reserved(self.device) - before) / 2**20)
