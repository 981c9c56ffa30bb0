"""The second KV tier in the engine (tiny model, exact CPU matmuls): greedy outputs with the tier equal those
without it, promoted KV equals recomputed KV, cached_tokens counts the promoted tokens, no page leaks."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from swaserve.engine.core import EngineClosed, SamplingParams
from swaserve.llm import LLM

P = 16
KW = dict(cpu_matmul="exact", chunked_prefill_size=96, max_running_requests=2, max_total_tokens=512,
          swa_tokens=256)


def fanout_prompts(llm: LLM, groups: int = 4, per_group: int = 2, system: int = 160) -> list[list[int]]:
    rng = random.Random(1)
    V = llm.tokenizer.vocab_size
    systems = [[2] + [rng.randrange(3, V) for _ in range(system - 1)] for _ in range(groups)]
    return [systems[g] + [rng.randrange(3, V) for _ in range(12)]
            for _ in range(per_group) for g in range(groups)]


def run(llm: LLM, prompts: list[list[int]]) -> list:
    outs = []
    for p in prompts:  # one at a time, round-robin over the groups: the pressure that evicts prompts
        outs += llm.generate([p], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        llm.engine.scheduler.check_integrity()
    return outs


@pytest.fixture(scope="module")
def plain() -> LLM:
    with LLM(**KW) as llm:
        yield llm


@pytest.fixture()
def tiered_llm():
    """Builds LLMs with a tier; closes each at the end of the test (their writer threads and host buffers
    do not outlive it)."""
    made: list[LLM] = []

    def make(**kw) -> LLM:
        made.append(LLM(**kw, **KW))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


def test_tier_outputs_equal_and_reuse_more(tmp_path, plain, tiered_llm) -> None:
    tiered = tiered_llm(kv_offload_dir=str(tmp_path), kv_offload_gb=0.05)
    prompts = fanout_prompts(plain)
    a, b = run(plain, prompts), run(tiered, prompts)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    cached_plain = sum(o.cached_tokens for o in a)
    cached_tier = sum(o.cached_tokens for o in b)
    s = tiered.engine.stats()
    assert s["kv_tier"]["promotions"] > 0 and s["kv_tier"]["rejected"] == 0
    assert cached_tier > cached_plain
    by_tier = s["prefix_cache_hit_tokens_by_tier"]
    assert by_tier["memory"] + by_tier["offload"] == cached_tier == s["prefix_cache_hit_tokens"]
    assert by_tier["offload"] > 0
    for pool in ("full_pool", "swa_pool"):
        assert s[pool]["used"] == 0
    tiered.engine.cache.check_integrity(used_full=0, used_swa=0)
    assert tiered.engine.flush_cache() and len(tiered.engine.tier) == 0


def _prefix_kv(llm: LLM, ids: list[int], pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full KV of pages [0, pages) and SWA KV of the window before it, as the cache holds them."""
    eng = llm.engine
    full, swa, _ = eng.cache.probe(ids, pages)
    assert len(full) == pages
    lo = eng.cache.window_start(pages)
    assert all(s is not None for s in swa[lo:pages])
    return (eng.pool.page_tensor("full")[full].clone(),
            eng.pool.page_tensor("swa")[[s for s in swa[lo:pages]]].clone())


def test_promoted_kv_equals_recomputed_kv(tmp_path, plain, tiered_llm) -> None:
    tiered = tiered_llm(kv_offload_dir=str(tmp_path), kv_offload_gb=0.05)
    rng = random.Random(5)
    V = plain.tokenizer.vocab_size
    prompt = [2] + [rng.randrange(3, V) for _ in range(200)]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    tiered.generate([prompt], greedy)
    eng = tiered.engine
    eng.cache.evict_full(10**6)  # everything leaves the arena: written to the tier
    assert eng.cache.stats()["full_cached"] == 0 and len(eng.tier) > 0
    follow = prompt + [rng.randrange(3, V) for _ in range(20)]
    (o,) = tiered.generate([follow], greedy)
    pages = len(prompt) // P  # whole pages of the shared prompt
    assert o.cached_tokens == pages * P and eng.tier.stats()["promotions"] == 1
    plain.engine.flush_cache()
    (ref,) = plain.generate([follow], greedy)
    assert ref.token_ids == o.token_ids
    pf, ps = _prefix_kv(tiered, follow, pages)
    rf, rs = _prefix_kv(plain, follow, pages)
    assert torch.equal(pf, rf) or torch.allclose(pf, rf, atol=1e-5, rtol=1e-5)
    assert torch.allclose(ps, rs, atol=1e-5, rtol=1e-5)


def test_host_level_and_queued_prefetch_keep_outputs_exact(tmp_path, plain, tiered_llm) -> None:
    """A small host level in front of the file (--kv-offload-host-gb): the second round is submitted at once,
    so requests wait in the queue while their records are fetched in the background."""
    tiered = tiered_llm(kv_offload_dir=str(tmp_path), kv_offload_gb=0.05, kv_offload_host_gb=0.0002)
    prompts = fanout_prompts(plain)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    a = run(plain, prompts) + plain.generate(prompts, greedy)
    b = run(tiered, prompts) + tiered.generate(prompts, greedy)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    eng = tiered.engine
    s = eng.stats()
    t = s["kv_tier"]
    assert t["host_level"] and t["promotions"] > 0 and t["rejected"] == 0
    assert t["fetch_queued"] > 0 and t["host_hits"] > 0  # (how many fetches finish first depends on timing)
    assert t["pages_read_full"] + t["pages_read_swa"] == t["host_hits"] + t["disk_reads"]
    by_tier = s["prefix_cache_hit_tokens_by_tier"]
    assert by_tier["memory"] + by_tier["offload"] == s["prefix_cache_hit_tokens"]
    eng.scheduler.check_integrity()
    eng.cache.check_integrity(used_full=0, used_swa=0)
    eng.tier.io.drain()
    assert eng.tier.stats()["pending_writes"] == 0
    assert eng.flush_cache() and len(eng.tier) == 0 and eng.tier.stats()["host_bytes"] == 0


def _tier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "swaserve-kv-tier"]


@pytest.mark.parametrize("host_gb", [0, 0.0002])  # write-behind staging only / a host level
def test_close_joins_the_writer_keeps_the_records_and_refuses_requests(tmp_path, plain, tiered_llm,
                                                                        host_gb) -> None:
    """Engine.close() (through LLM.close()): queued writes are sealed, the tier's thread is joined and its
    host buffer freed; a second close is harmless; a request afterwards fails at once; a new engine on the
    same directory finds every record and promotes the prefix from it."""
    before = set(_tier_threads())
    llm = tiered_llm(kv_offload_dir=str(tmp_path), kv_offload_gb=0.05, kv_offload_host_gb=host_gb)
    io = llm.engine.tier.io
    assert io.thread in _tier_threads() and io.thread not in before
    rng = random.Random(7)
    V = plain.tokenizer.vocab_size
    prompt = [2] + [rng.randrange(3, V) for _ in range(200)]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (first,) = llm.generate([prompt], greedy)
    llm.engine.cache.evict_full(10**6)  # written to the tier: queued to the thread, not yet sealed
    records = len(llm.engine.tier)
    assert records > 0
    llm.close()
    assert not io.thread.is_alive() and set(_tier_threads()) <= before
    s = io.stats()
    assert s["pending_writes"] == 0 and s["disk_writes"] + s["sync_writes"] == records
    assert io.buffer.numel() == 0 and io.stats()["host_bytes"] == 0  # the host level's memory released
    llm.close()  # harmless
    t0 = time.monotonic()
    with pytest.raises(EngineClosed, match="closed"):
        llm.generate([prompt], greedy)
    assert time.monotonic() - t0 < 1.0 and not llm.engine.has_unfinished()
    again = tiered_llm(kv_offload_dir=str(tmp_path), kv_offload_gb=0.05, kv_offload_host_gb=host_gb)
    assert again.engine.tier.reopened == records
    (o,) = again.generate([prompt], greedy)
    assert o.token_ids == first.token_ids and o.cached_tokens == (len(prompt) - 1) // P * P
    s = again.engine.stats()
    assert s["prefix_cache_hit_tokens_by_tier"]["offload"] == o.cached_tokens
    assert s["kv_tier"]["rejected"] == 0


def test_server_shutdown_closes_the_engine_it_loaded(tmp_path, tiered_llm) -> None:
    """The server's shutdown (ServerState.shutdown, `swaserve serve` without an engine process) closes the
    AsyncEngine it loaded and so the core: the tier's thread is joined; a request afterwards fails with
    EngineClosed (the server answers 503) instead of waiting."""
    from swaserve.engine.client.in_process import AsyncEngine
    from swaserve.server.errors import from_exception
    from swaserve.server.state import ServerConfig, ServerState

    llm = tiered_llm(kv_offload_dir=str(tmp_path), kv_offload_gb=0.05)
    io = llm.engine.tier.io
    state = ServerState(ServerConfig(), None, loader=lambda: AsyncEngine(llm.engine))
    state.start_loading()
    assert state.wait_loaded(60)
    eng = state.engine
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def run(rid: str) -> list:
        return [o async for o in eng.generate(rid, [2, 5, 6, 7, 8], greedy)]

    assert sum(len(o.token_ids) for o in asyncio.run(run("a"))) == 2
    state.shutdown()
    assert llm.engine.closed and not io.thread.is_alive() and eng._thread is None
    t0 = time.monotonic()
    with pytest.raises(EngineClosed) as e:
        asyncio.run(run("b"))
    assert time.monotonic() - t0 < 1.0 and from_exception(e.value).status == 503
