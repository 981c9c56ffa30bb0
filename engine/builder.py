"""Building an engine: config + a loaded model -> KV pools, page allocators, prefix cache, scheduler,
model runner, tokenizer and chat template (`EngineParts`).

KV pool sizes (plan_kv_pools):
  * explicit token counts (CacheConfig.full_tokens / swa_tokens, `--max-total-tokens`), or
  * a memory budget (`--kv-cache-memory-gb`) split so that swa_tokens = ratio * full_tokens, or
  * the default: on CPU full = min(context, 65536) tokens, SWA = ratio * full; on CUDA
    `--kv-memory-fraction` (85%) of the
    device memory left after the weights, split like a budget.
The SWA pool must hold max_running_requests windows (plus a page and a decode page each) and one
prefill chunk; default sizing grows it to that, explicit sizing that is too small is an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from swaserve.engine.attention.kv_pool import KVPool, bytes_per_token, resolve_kv_dtype
from swaserve.engine.chat_template import ChatTemplate
from swaserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from swaserve.engine.kvcache import NaiveCache, PageAllocator, PrefixCache, SWARadixCache
from swaserve.engine.model_api import ModelBundle
from swaserve.engine.model_runner import ModelRunner
from swaserve.engine.peak_step import reserve_peak_step
from swaserve.engine.scheduler import KVManager, Scheduler
from swaserve.engine.tokenizer import Tokenizer

log = logging.getLogger("swaserve.engine")

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
    page_size = cache.page_size
    dtype = resolve_kv_dtype(cache.kv_cache_dtype, device)
    full_bytes, swa_bytes = bytes_per_token(cfg, dtype)
    ratio = cache.swa_full_tokens_ratio
    need_swa = min_swa_pages(cfg, page_size, sched)
    explicit = cache.full_tokens is not None or cache.kv_cache_memory_gb is not None
    if cache.full_tokens is not None:
        full_tokens = cache.full_tokens
        swa_tokens = cache.swa_tokens if cache.swa_tokens is not None else int(full_tokens * ratio)
    else:
        if cache.kv_cache_memory_gb is not None:
            budget = cache.kv_cache_memory_gb * 2**30
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = cache.kv_memory_fraction * free
        else:
            budget = None
        if budget is None:
            full_tokens = min(context_length, CPU_DEFAULT_FULL_TOKENS)
            swa_tokens = int(full_tokens * ratio)
        else:
            full_tokens = int(budget / (full_bytes + ratio * swa_bytes))
            swa_tokens = int(full_tokens * ratio)
    full_pages = max(1, full_tokens // page_size)
    swa_pages = swa_tokens // page_size
    if swa_pages < need_swa:
        if explicit:
            raise ValueError(
                f"the SWA KV pool ({swa_pages * page_size} tokens) cannot hold --max-running-requests "
                f"{sched.max_running_requests} windows of {cfg.sliding_window} tokens plus one "
                f"--chunked-prefill-size chunk of {sched.chunked_prefill_size} (needs "
                f"{need_swa * page_size} tokens): raise --swa-full-tokens-ratio or the pool size, or lower "
                f"--max-running-requests")
        swa_pages = need_swa
    return PoolPlan(full_pages, swa_pages, dtype)


@dataclass
class EngineParts:
    """Everything an engine runs on, built once by build_engine_parts."""

    model_config: ModelConfig
    model_name: str
    device: torch.device
    context_length: int  # the model's (or --context-length), capped by the full KV pool
    tokenizer: Tokenizer
    tokenizer_metadata: dict[str, Any]  # the GGUF's tokenizer.* keys (a server process rebuilds from them)
    chat_template: ChatTemplate | None  # None when the GGUF has no tokenizer.chat_template
    eos_ids: frozenset[int]
    pool: KVPool
    full_alloc: PageAllocator
    swa_alloc: PageAllocator
    cache: PrefixCache
    scheduler: Scheduler
    runner: ModelRunner


def build_cache(cache_cfg: CacheConfig, window: int, full_alloc: PageAllocator,
                swa_alloc: PageAllocator) -> PrefixCache:
    """The prefix cache `--cache-type` names."""
    if cache_cfg.cache_type == "naive":
        return NaiveCache(cache_cfg.page_size, full_alloc, swa_alloc)
    return SWARadixCache(cache_cfg.page_size, window, full_alloc, swa_alloc,
                         swa_retain_tokens=cache_cfg.swa_retain_budget, policy=cache_cfg.swa_retain_policy)


def build_engine_parts(cfg: EngineConfig, bundle: ModelBundle) -> EngineParts:
    """Size and allocate the KV pools (after the weights: from what memory is left), then build the
    cache, the scheduler and the runner around them."""
    model_cfg, cache_cfg, sched_cfg = bundle.config, cfg.cache, cfg.scheduler
    device = bundle.device
    tokenizer = Tokenizer.from_metadata(bundle.metadata)
    template_source = bundle.metadata.get("tokenizer.chat_template")
    chat_template = ChatTemplate(template_source, tokenizer) if template_source else None
    context = sched_cfg.context_length or model_cfg.context_length
    reserve_peak_step(bundle, cfg)  # CUDA: the largest step's activations stay out of the pool budget
    plan = plan_kv_pools(model_cfg, cache_cfg, sched_cfg, context, device)
    capacity = plan.full_pages * cache_cfg.page_size
    if context > capacity:
        log.warning("context length %d exceeds the full KV pool (%d tokens); serving up to %d", context,
                    capacity, capacity)
        context = capacity
    pool = KVPool(model_cfg, plan.full_pages, plan.swa_pages, cache_cfg.page_size, plan.dtype, device)
    if device.type == "cpu":  # make the pools resident now: memory stays flat while serving
        for t in (pool.full_k, pool.full_v, pool.swa_k, pool.swa_v):
            t.fill_(0)
    log.info("KV pools: %s", plan.describe(cache_cfg.page_size, model_cfg))
    full_alloc = PageAllocator(plan.full_pages)
    swa_alloc = PageAllocator(plan.swa_pages)
    cache = build_cache(cache_cfg, model_cfg.sliding_window, full_alloc, swa_alloc)
    kv = KVManager(cache, full_alloc, swa_alloc, cache_cfg.page_size, model_cfg.sliding_window)
    return EngineParts(
        model_config=model_cfg,
        model_name=bundle.name,
        device=device,
        context_length=context,
        tokenizer=tokenizer,
        tokenizer_metadata={k: v for k, v in bundle.metadata.items() if k.startswith("tokenizer.")},
        chat_template=chat_template,
        eos_ids=frozenset(tokenizer.eos_ids) | frozenset(model_cfg.eos_token_ids),
        pool=pool,
        full_alloc=full_alloc,
        swa_alloc=swa_alloc,
        cache=cache,
        scheduler=Scheduler(sched_cfg, kv, context),
        runner=ModelRunner(bundle.model, pool, cache_cfg.page_size, model_cfg.sliding_window, device),
    )
