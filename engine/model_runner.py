"""Glue between the scheduler's Batch and the model: attention metadata, forward, logits, sampling.

Also sizes the two KV pools (plan_kv_pools):
  * explicit token counts (CacheConfig.full_tokens / swa_tokens, `--max-total-tokens`), or
  * a memory budget (`--kv-cache-memory-gb`) split so that swa_tokens = ratio * full_tokens, or
  * the default: on CPU full = min(context, 65536) tokens, SWA = ratio * full; on CUDA 85% of the
    device memory left after the weights, split like a budget.
The SWA pool must hold max_running_requests windows (plus a page and a decode page each) and one
prefill chunk; default sizing grows it to that, explicit sizing that is too small is an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool, bytes_per_token, resolve_kv_dtype
from swaserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from swaserve.engine.core import Batch, TokenLogprob
from swaserve.engine.sampling import SampleRow, make_generator, sample

log = logging.getLogger(__name__)

CPU_DEFAULT_FULL_TOKENS = 65536


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PoolPlan:
    full_pages: int
    swa_pages: int
    dtype: torch.dtype

    def describe(self, page_size: int, cfg: ModelConfig) -> str:
        bf, bs = bytes_per_token(cfg, self.dtype)
        ft, st = self.full_pages * page_size, self.swa_pages * page_size
        return (f"full pool {ft} tokens ({ft * bf / 2**20:.0f} MiB), SWA pool {st} tokens "
                f"({st * bs / 2**20:.0f} MiB), {str(self.dtype).removeprefix('torch.')}")


def min_swa_pages(cfg: ModelConfig, page_size: int, sched: SchedulerConfig) -> int:
    """SWA pages needed so that every running request can hold its window and one chunk can run."""
    per_req = _cdiv(cfg.sliding_window, page_size) + 2
    return sched.max_running_requests * per_req + _cdiv(sched.chunked_prefill_size, page_size) + 1


def plan_kv_pools(cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, context_length: int,
                  device: torch.device) -> PoolPlan:
    """Pool sizes in pages (see the module docstring); ValueError when explicit sizes are too small."""
    P = cache.page_size
    dtype = resolve_kv_dtype(cache.kv_cache_dtype, device)
    bf, bs = bytes_per_token(cfg, dtype)
    ratio = cache.swa_full_tokens_ratio
    need_swa = min_swa_pages(cfg, P, sched)
    explicit = cache.full_tokens is not None or cache.kv_cache_memory_gb is not None
    if cache.full_tokens is not None:
        full_tokens = cache.full_tokens
        swa_tokens = cache.swa_tokens if cache.swa_tokens is not None else int(full_tokens * ratio)
    else:
        if cache.kv_cache_memory_gb is not None:
            budget = cache.kv_cache_memory_gb * 2**30
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = 0.85 * free
        else:
            budget = None
        if budget is None:
            full_tokens = min(context_length, CPU_DEFAULT_FULL_TOKENS)
            swa_tokens = int(full_tokens * ratio)
        else:
            full_tokens = int(budget / (bf + ratio * bs))
            swa_tokens = int(full_tokens * ratio)
    full_pages = max(1, full_tokens // P)
    swa_pages = swa_tokens // P
    if swa_pages < need_swa:
        if explicit:
            raise ValueError(
                f"the SWA KV pool ({swa_pages * P} tokens) cannot hold --max-running-requests "
                f"{sched.max_running_requests} windows of {cfg.sliding_window} tokens plus one "
                f"--chunked-prefill-size chunk of {sched.chunked_prefill_size} (needs {need_swa * P} "
                f"tokens): raise --swa-full-tokens-ratio or the pool size, or lower --max-running-requests")
        swa_pages = need_swa
    return PoolPlan(full_pages, swa_pages, dtype)


def build_metadata(batch: Batch, page_size: int, window: int, device: torch.device | str = "cpu"
                   ) -> AttentionMetadata:
    """Positions, slots and page tables of both pools for one batch (built on the CPU, then moved)."""
    P, W = page_size, window
    B = len(batch.reqs)
    npages = [_cdiv(p + q, P) for p, q in zip(batch.prefix_lens, batch.q_lens)]
    width = max(npages)
    full_rows: list[list[int]] = []
    swa_rows: list[list[int]] = []
    for r, p, n in zip(batch.reqs, batch.prefix_lens, npages):
        full_rows.append(r.full_pages[:n] + [-1] * (width - n))
        lo = max(0, p - W + 1) // P  # first page a new token can see on sliding layers
        swa = [-1] * lo + [-1 if s is None else s for s in r.swa_pages[lo:n]] + [-1] * (width - n)
        swa_rows.append(swa)
    full_table = torch.tensor(full_rows, dtype=torch.int64)  # [B, width]
    swa_table = torch.tensor(swa_rows, dtype=torch.int64)  # [B, width]
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor(batch.q_lens))  # [T]
    starts = torch.tensor(batch.prefix_lens, dtype=torch.int64)
    cu = torch.tensor([0] + batch.q_lens, dtype=torch.int64).cumsum(0)  # [B + 1]
    positions = torch.arange(int(cu[-1]), dtype=torch.int64) - cu[seq] + starts[seq]  # [T]
    page_idx, off = positions // P, positions % P  # [T]
    full_slots = full_table[seq, page_idx] * P + off  # [T]
    swa_pg = swa_table[seq, page_idx]  # [T]
    assert bool((swa_pg >= 0).all()) and bool((full_table[seq, page_idx] >= 0).all()), "unmapped slot"
    swa_slots = swa_pg * P + off  # [T]
    meta = AttentionMetadata(P, W, list(batch.q_lens), list(batch.prefix_lens), positions, full_slots,
                             swa_slots, full_table, swa_table)
    return meta.to(device) if torch.device(device).type != "cpu" else meta


class ModelRunner:
    """Runs one Batch: forward over the paged pools, logits of the sampling rows, sampling."""

    def __init__(self, model, pool: KVPool, page_size: int, window: int, device: torch.device):
        self.model = model
        self.pool = pool
        self.P = page_size
        self.W = window
        self.device = device

    def execute(self, batch: Batch) -> tuple[list[int | None], list[TokenLogprob | None]]:
        meta = build_metadata(batch, self.P, self.W, self.device)
        ids = torch.tensor(batch.input_ids(), dtype=torch.int64, device=self.device)  # [T]
        hidden = self.model.forward(ids, meta, self.pool)  # [T, H]
        cu = meta.cu_q_lens
        sel = [b for b, s in enumerate(batch.sample) if s]
        tokens: list[int | None] = [None] * len(batch.reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(batch.reqs)
        if not sel:
            return tokens, logprobs
        rows_idx = torch.tensor([cu[b + 1] - 1 for b in sel], dtype=torch.int64, device=hidden.device)
        logits = self.model.logits(hidden[rows_idx])  # [S, V] fp32
        rows = []
        for b in sel:
            r = batch.reqs[b]
            p = r.params
            if p.temperature > 0 and r.generator is None:
                r.generator = make_generator(r.seed)
            penal = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            rows.append(SampleRow(p, r.generator if p.temperature > 0 else None,  # type: ignore[arg-type]
                                  r.token_ids[:r.prompt_len] if p.repetition_penalty != 1.0 else (),
                                  r.output_ids if penal else ()))
        res = sample(logits, rows)
        for j, b in enumerate(sel):
            tokens[b] = res.token_ids[j]
            logprobs[b] = res.logprobs[j]
        return tokens, logprobs
