"""Measure the largest step the scheduler can plan, before the KV pools take the free memory.

The KV pools are sized from the device memory left after the weights. A step also needs
transient memory: activations of a `--chunked-prefill-size` chunk, the MoE and attention
workspaces, and logits + top-p over the whole vocabulary for every running request. Without a
measurement that memory is only covered by the fraction the pools leave over (an OOM on a small
card). `reserve_peak_step` runs one dummy step of that shape over a small temporary pool, then
keeps the step's peak reserved in torch's caching allocator: `torch.cuda.mem_get_info`, which the
pool sizing reads, no longer counts it as free, and serving steps reuse those cached blocks.
"""

from __future__ import annotations

import logging

import torch

from swaserve.engine.attention.kv_format import kv_format_of
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.config import EngineConfig
from swaserve.engine.core import Batch, Req, SamplingParams
from swaserve.engine.model_api import ModelBundle
from swaserve.engine.runner.model_runner import build_metadata
from swaserve.engine.runner.sampling import top_p_mask

log = logging.getLogger("swaserve.engine")


def max_chunk_tokens(cfg: EngineConfig, bundle: ModelBundle) -> int:
    """The most prefill tokens one step may plan: --chunked-prefill-size, plus one image less a token under
    bidirectional image attention (a chunk that starts in an image runs to its end: Req.chunk_end)."""
    spec = bundle.vision_spec
    if bundle.vision is None or spec is None or not spec.bidirectional_attention:
        return cfg.scheduler.chunked_prefill_size
    return cfg.scheduler.chunked_prefill_size + spec.max_soft_tokens - 1


def peak_batch(chunk: int, decodes: int, page_size: int) -> tuple[Batch, int]:
    """A batch of one `chunk`-token prefill and `decodes` decodes of one token after a one-token
    prefix, with page ids of one private page range each; returns (batch, pages used)."""
    reqs, q_lens, prefix_lens = [], [], []
    next_page = 0

    def pages(n: int) -> list[int]:
        nonlocal next_page
        out = list(range(next_page, next_page + n))
        next_page += n
        return out

    prefill_pages = pages(-(-chunk // page_size))
    reqs.append(Req("peak-prefill", "peak-prefill", 0, [0] * chunk, chunk, SamplingParams(),
                    full_pages=prefill_pages, swa_pages=list(prefill_pages)))
    q_lens.append(chunk)
    prefix_lens.append(0)
    for d in range(decodes):
        p = pages(1)
        reqs.append(Req(f"peak-decode-{d}", "peak", d, [0, 0], 1, SamplingParams(), full_pages=p,
                        swa_pages=list(p)))
        q_lens.append(1)
        prefix_lens.append(1)
    return Batch(reqs, q_lens, prefix_lens, [True] * len(reqs)), next_page


@torch.no_grad()
def run_peak_step(bundle: ModelBundle, cfg: EngineConfig) -> tuple[torch.Tensor, int]:
    """One dummy step of the largest planned shape: forward, logits of every row that samples, and
    top-p over the vocabulary (the sampler's largest [rows, V] intermediates); returns (the logits
    [B, V], the bytes of the temporary KV pool it ran over)."""
    model, mcfg, device = bundle.model, bundle.config, bundle.device
    page_size = cfg.cache.page_size
    batch, num_pages = peak_batch(max_chunk_tokens(cfg, bundle), cfg.scheduler.max_running_requests,
                                  page_size)
    fmt = kv_format_of(cfg.cache, device, cfg.cpu_matmul)
    pool = KVPool(mcfg, num_pages, num_pages, page_size, fmt, device)
    meta = build_metadata(batch, page_size, mcfg.sliding_window, device)
    ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=device)  # [T]
    hidden = model.forward(ids, meta, pool)  # [T, H]
    rows = torch.tensor(meta.cu_q_lens[1:], dtype=torch.int64, device=device) - 1  # [B] last row of each
    logits = model.logits(hidden[rows])  # [B, V] fp32
    top_p_mask(logits, torch.full((logits.shape[0],), 0.9, device=device))
    return logits, pool.nbytes()


def reserve_peak_step(bundle: ModelBundle, cfg: EngineConfig) -> int:
    """On CUDA: run the peak step and keep its transient memory reserved for serving; returns the
    step's peak bytes above the weights. On the CPU nothing is measured (the pools have a fixed
    default size there): 0."""
    device = bundle.device
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _, pool_bytes = run_peak_step(bundle, cfg)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - pool_bytes  # activations and workspaces
    torch.cuda.empty_cache()  # drop the temporary pool's blocks ...
    hold = torch.empty(peak, dtype=torch.uint8, device=device)  # ... and keep the step's peak reserved
    del hold
    log.info("peak step (%d-token chunk + %d decodes): %.0f MiB kept for activations",
             max_chunk_tokens(cfg, bundle), cfg.scheduler.max_running_requests, peak / 2**20)
    return peak


def measure_graph_memory(bundle: ModelBundle, cfg: EngineConfig) -> int:
    """CUDA, before the KV pools are sized: the transient bytes of the largest bucket's decode step (what
    the graphs' private memory pool will hold), measured by running it eagerly over a small temporary
    pool. The builder holds that many bytes while it sizes and allocates the pools."""
    device, mcfg, P = bundle.device, bundle.config, cfg.cache.page_size
    n = cfg.scheduler.max_running_requests
    batch, pages = peak_batch(1, n - 1, P)  # n rows of one new token each
    pool = KVPool(mcfg, pages, pages, P, kv_format_of(cfg.cache, device, cfg.cpu_matmul), device)
    meta = build_metadata(batch, P, mcfg.sliding_window, device)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    bundle.model.logits(bundle.model.forward(ids, meta, pool))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
