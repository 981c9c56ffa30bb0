"""Building an engine: config + a loaded model -> KV arena, page allocators, prefix cache, scheduler,
model runner, tokenizer and chat template (`EngineParts`).

KV memory (plan_kv_pools): one arena of blocks that both page kinds are carved from
(engine/kvcache/arena.py; a block is one SWA page or full_per_block full pages), sized from
  * explicit token counts (CacheConfig.full_tokens / swa_tokens, `--max-total-tokens`): room for both
    at once, or
  * a memory budget (`--kv-cache-memory-gb`), or
  * the default: on CPU room for min(context, 65536) full tokens and a quarter as many SWA tokens; on
    CUDA `--kv-memory-fraction` (85%) of the device memory left after the weights.
`--swa-full-tokens-ratio R`, when given, caps the SWA pages at what a fixed split with that ratio would
have given them. The arena must hold max_running_requests windows (plus a page and a decode page
each) and one prefill chunk, and the full pages of a chunk; default sizing grows it to that, explicit
sizing that is too small is an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from swaserve.engine.attention.kv_format import KVFormat, kv_format_of
from swaserve.engine.attention.kv_pool import ArenaKVPool, arena_geometry, bytes_per_token
from swaserve.engine.config import (
    SIZING_RATIO,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    VisionSpec,
)
from swaserve.engine.kvcache import PREFIX_CACHES, Arena, PagePool, PrefixCache, SWARadixCache
from swaserve.engine.kvcache.tier.build import build_tier
from swaserve.engine.model_api import ModelBundle
from swaserve.engine.runner.cuda_graphs import DecodeGraphs, graphs_supported
from swaserve.engine.runner.images import ImageEmbedder
from swaserve.engine.runner.model_runner import ModelRunner
from swaserve.engine.runner.peak_step import measure_graph_memory, reserve_peak_step
from swaserve.engine.scheduler import KVManager, Scheduler
from swaserve.engine.scheduler.encoder_budget import EncoderBudget
from swaserve.engine.text.chat_template import ChatTemplate, model_chat_template
from swaserve.engine.text.template_sandbox import RenderLimits
from swaserve.engine.text.tokenizer import Tokenizer

log = logging.getLogger("swaserve.engine")

CPU_DEFAULT_FULL_TOKENS = 65536


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    full_per_block: int
    swa_cap: int  # SWA pages (blocks) at most; num_blocks without --swa-full-tokens-ratio
    dtype: torch.dtype  # of the arena buffer (KVFormat.buffer_dtype: uint8 for q8_0)
    block_bytes: int
    kv_format: KVFormat

    @property
    def full_pages(self) -> int:
        """Full pages the arena could hold (all blocks full)."""
        return self.num_blocks * self.full_per_block

    @property
    def swa_pages(self) -> int:
        """SWA pages the arena could hold (all blocks SWA, or the cap)."""
        return self.swa_cap

    def describe(self, page_size: int, cfg: ModelConfig) -> str:
        cap = f", SWA capped at {self.swa_cap * page_size} tokens" if self.swa_cap < self.num_blocks else ""
        full_b, swa_b = bytes_per_token(cfg, self.kv_format)
        return (f"one arena of {self.num_blocks} blocks x {self.block_bytes / 2**20:.2f} MiB "
                f"({self.num_blocks * self.block_bytes / 2**20:.0f} MiB): {self.full_pages * page_size} full "
                f"tokens or {self.num_blocks * page_size} SWA tokens, or any mix{cap}, "
                f"{self.kv_format.name} ({full_b} / {swa_b} bytes per full / SWA token)")

    def windows(self, page_size: int, cfg: ModelConfig) -> str:
        """The start-up line of what a sliding window costs in this KV type: bytes per token of each kind,
        one window's MiB, windows per GiB and in the arena (all blocks SWA)."""
        full_b, swa_b = bytes_per_token(cfg, self.kv_format)
        window = cfg.sliding_window * swa_b  # bytes of one window over every sliding layer
        held = self.swa_cap * page_size / cfg.sliding_window
        return (f"{self.kv_format.name} stores {full_b} bytes per full token, {swa_b} per SWA token; one "
                f"{cfg.sliding_window}-token sliding window costs {window / 2**20:.1f} MiB: "
                f"{2**30 / window:.1f} windows per GiB, {held:.1f} in this arena")


def min_swa_pages(cfg: ModelConfig, page_size: int, sched: SchedulerConfig) -> int:
    """SWA pages needed so that every running request can hold its window and one chunk can run."""
    per_req = _cdiv(cfg.sliding_window, page_size) + 2
    return sched.max_running_requests * per_req + _cdiv(sched.chunked_prefill_size, page_size) + 1


def plan_kv_pools(cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, context_length: int,
                  device: torch.device, cpu_matmul: str = "native") -> PoolPlan:
    """The arena's size and SWA cap (see the module docstring); ValueError when explicit sizes are too
    small."""
    page_size = cache.page_size
    fmt = kv_format_of(cache, device, cpu_matmul)  # --kv-cache-dtype (-k, -v)
    full_bytes, swa_bytes = bytes_per_token(cfg, fmt)
    k, _, swa_record = arena_geometry(cfg, fmt)
    block_bytes = page_size * swa_record * fmt.buffer_dtype.itemsize
    ratio = cache.swa_full_tokens_ratio if cache.swa_full_tokens_ratio is not None else SIZING_RATIO
    need_swa = min_swa_pages(cfg, page_size, sched)
    # the running windows and a chunk, and full pages for a chunk
    need_blocks = need_swa + _cdiv(_cdiv(sched.chunked_prefill_size, page_size) + 1, k)
    explicit = cache.full_tokens is not None or cache.kv_cache_memory_gb is not None
    if cache.full_tokens is not None:
        full_tokens = cache.full_tokens
        swa_tokens = cache.swa_tokens if cache.swa_tokens is not None else int(full_tokens * ratio)
        blocks = _cdiv(full_tokens, page_size * k) + _cdiv(swa_tokens, page_size)
    else:
        if cache.kv_cache_memory_gb is not None:
            budget: float | None = cache.kv_cache_memory_gb * 2**30
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = cache.kv_memory_fraction * free
        else:
            budget = None
        if budget is None:
            full_tokens = min(context_length, CPU_DEFAULT_FULL_TOKENS)
            swa_tokens = int(full_tokens * ratio)
            blocks = _cdiv(full_tokens, page_size * k) + _cdiv(swa_tokens, page_size)
        else:
            full_tokens = int(budget / (full_bytes + ratio * swa_bytes))
            swa_tokens = int(full_tokens * ratio)
            blocks = int(budget // block_bytes)
    swa_cap = blocks if cache.swa_full_tokens_ratio is None else swa_tokens // page_size
    if blocks < need_blocks or swa_cap < need_swa:
        what = (f"the KV arena ({blocks} blocks: {blocks * page_size} SWA tokens"
                + (f", SWA capped at {swa_cap * page_size}" if swa_cap < blocks else "") + ")")
        if explicit:
            raise ValueError(
                f"{what} cannot hold --max-running-requests {sched.max_running_requests} windows of "
                f"{cfg.sliding_window} tokens plus one --chunked-prefill-size chunk of "
                f"{sched.chunked_prefill_size} (needs {need_swa * page_size} SWA tokens and a chunk of full "
                f"tokens): raise the memory (or --swa-full-tokens-ratio), or lower --max-running-requests")
        blocks = max(blocks, need_blocks)
        swa_cap = blocks if cache.swa_full_tokens_ratio is None else max(swa_cap, need_swa)
    return PoolPlan(blocks, k, min(swa_cap, blocks), fmt.buffer_dtype, block_bytes, fmt)


@dataclass
class EngineParts:
    """Everything an engine runs on, built once by build_engine_parts."""

    model_config: ModelConfig
    model_name: str
    device: torch.device
    context_length: int  # the model's (or --context-length), capped by the KV arena
    tokenizer: Tokenizer
    tokenizer_metadata: dict[str, Any]  # the GGUF's tokenizer.* keys (a server process rebuilds from them)
    chat_template: ChatTemplate | None  # None when the GGUF has no tokenizer.chat_template
    eos_ids: frozenset[int]
    pool: ArenaKVPool
    arena: Arena
    full_alloc: PagePool
    swa_alloc: PagePool
    cache: PrefixCache
    scheduler: Scheduler
    runner: ModelRunner
    vision_spec: VisionSpec | None = None  # the image encoder's preprocessing (the runner has the encoder)


def build_cache(cache_cfg: CacheConfig, window: int, full_alloc: PagePool,
                swa_alloc: PagePool) -> PrefixCache:
    """The prefix cache `--cache-type` names (PREFIX_CACHES); ValueError for an unknown name."""
    return PREFIX_CACHES.load(cache_cfg.cache_type).create(cache_cfg, window, full_alloc, swa_alloc)


def build_engine_parts(cfg: EngineConfig, bundle: ModelBundle) -> EngineParts:
    """Size and allocate the KV arena (after the weights: from what memory is left), then build the
    cache, the scheduler and the runner around it."""
    model_cfg, cache_cfg, sched_cfg = bundle.config, cfg.cache, cfg.scheduler
    device = bundle.device
    tokenizer = Tokenizer.from_metadata(bundle.metadata)
    # --chat-template-timeout / --chat-template-max-chars
    chat_template = model_chat_template(bundle.metadata, tokenizer, RenderLimits.of(cfg))
    context = sched_cfg.context_length or model_cfg.context_length
    graphs_on = not cfg.no_cuda_graphs and graphs_supported(bundle.model)
    graph_hold = None
    if graphs_on:  # the graphs' private memory pool (allocated after the KV pools) stays out of their budget
        graph_bytes = measure_graph_memory(bundle, cfg)
        torch.cuda.empty_cache()
        graph_hold = torch.empty(graph_bytes, dtype=torch.uint8, device=device)  # a fresh block, held
    reserve_peak_step(bundle, cfg)  # CUDA: the largest step's activations stay out of the pool budget
    plan = plan_kv_pools(model_cfg, cache_cfg, sched_cfg, context, device, cfg.cpu_matmul)
    P = cache_cfg.page_size
    capacity = (plan.num_blocks - _cdiv(model_cfg.sliding_window, P) - 2) * plan.full_per_block * P
    if context > capacity:
        log.warning("context length %d exceeds what the KV arena holds beside one window (%d tokens); "
                    "serving up to %d", context, capacity, capacity)
        context = capacity
    pool = ArenaKVPool(model_cfg, plan.num_blocks, P, plan.kv_format, device)
    if device.type == "cpu":  # make the memory resident now: it stays flat while serving
        for t in pool.tensors():
            t.fill_(0)
    log.info("KV memory: %s", plan.describe(P, model_cfg))
    log.info("KV windows: %s", plan.windows(P, model_cfg))
    # prompt logprobs: as many all-vocabulary logit rows at a time as a full sampling step (the peak step)
    runner = ModelRunner(bundle.model, pool, P, model_cfg.sliding_window, device,
                         logprob_rows=sched_cfg.max_running_requests + 1)
    if bundle.vision is not None:
        runner.images = ImageEmbedder(bundle.vision, device, cfg.image_cache_size)
    if graphs_on:  # CUDA: capture at start, not mid-serving
        del graph_hold
        torch.cuda.empty_cache()  # the held bytes (and the peak-step reservation) back to the driver: the
        # pools are sized without them, so the graphs' pool and the eager peak step both fit
        runner.graphs = DecodeGraphs(bundle.model, pool, P, model_cfg.sliding_window, device,
                                     sched_cfg.max_running_requests, _cdiv(context, P) + 1, capture=True)
        try:
            runner.graphs.capture_all()
        except Exception as e:  # noqa: BLE001 - any capture failure: serve eagerly rather than not at all
            log.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly (--no-cuda-graphs "
                        "skips the capture)", type(e).__name__, e)
            runner.graphs = None
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    arena = Arena(plan.num_blocks, plan.full_per_block, swa_cap=plan.swa_cap, block_bytes=plan.block_bytes)
    cache = build_cache(cache_cfg, model_cfg.sliding_window, arena.full, arena.swa)
    if cache_cfg.kv_offload_dir is not None:
        if not isinstance(cache, SWARadixCache):
            raise ValueError("--kv-offload-dir needs --cache-type radix")
        cache.set_tier(build_tier(cfg, bundle, pool))
    kv = KVManager(cache, arena.full, arena.swa, P, model_cfg.sliding_window)
    if sched_cfg.admission_policy == "auto":  # cache-aware where prefill is slow against a step: the CPU
        sched_cfg = replace(sched_cfg, admission_policy="cache-aware" if device.type == "cpu" else "fcfs")
    log.info("admission: %s", sched_cfg.admission_policy)
    scheduler = Scheduler(sched_cfg, kv, context)
    if runner.images is not None:
        scheduler.encoder_budget = EncoderBudget(cfg.image_encoder_budget or sched_cfg.chunked_prefill_size,
                                                 runner.images.has)
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
        arena=arena,
        full_alloc=arena.full,
        swa_alloc=arena.swa,
        cache=cache,
        scheduler=scheduler,
        runner=runner,
        vision_spec=bundle.vision_spec if bundle.vision is not None else None,
    )
