"""The engine with an 8-bit KV cache on the tiny demo model (CPU): greedy tokens of a prompt run alone
(naive cache), in one batch, and again from the prefix cache are the same (the KV is quantized on write,
before any attention reads it, so a cached page holds exactly what a recomputed one would); the stats,
/v1/cache/state and /metrics report the KV type and bytes per token."""

from __future__ import annotations

import random

import pytest

from swaserve.engine.core import SamplingParams
from swaserve.llm import LLM

W, CHUNK = 64, 96  # the tiny preset's window; a prefill chunk
LENS = [17, 63, 65, 97, 200]  # around the window, the chunk and the 16-token pages


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def prompts(llm: LLM) -> list[list[int]]:
    rng = random.Random(0)
    V = llm.tokenizer.vocab_size
    return [[2] + [rng.randrange(3, V) for _ in range(n - 1)] for n in LENS]


def check_alone_batched_cached(kw: dict, batch: int = 16) -> LLM:
    naive = LLM(cache_type="naive", chunked_prefill_size=CHUNK, max_running_requests=16, **kw)
    ps = prompts(naive)
    alone = [naive.generate([p], greedy(6 + i % 4))[0].token_ids for i, p in enumerate(ps)]
    radix = LLM(cache_type="radix", chunked_prefill_size=CHUNK, max_running_requests=batch, **kw)
    params = [greedy(6 + i % 4) for i in range(len(ps))]
    batched = radix.generate(ps, params)
    assert [o.token_ids for o in batched] == alone
    cached = radix.generate(ps, params)  # the same prompts again: their pages come from the prefix cache
    assert [o.token_ids for o in cached] == alone
    assert all(o.cached_tokens >= (len(p) - 1) // 16 * 16 for o, p in zip(cached, ps) if len(p) > 16)
    fan = [p + [5, 6, 7] for p in ps[-2:]]  # extensions of cached prompts: a hit, then new tokens
    assert [o.token_ids for o in radix.generate(fan, greedy(5))] == \
        [naive.generate([p], greedy(5))[0].token_ids for p in fan]
    return radix


def test_q8_0_native_path() -> None:
    radix = check_alone_batched_cached({"kv_cache_dtype": "q8_0"})  # --cpu-matmul native: native attention
    eng = radix.engine
    from swaserve.engine.quant import native

    if native.available():
        assert type(eng.runner.model.attn).__name__ == "NativeAttentionBackend"
    assert eng.pool.buffer.dtype.itemsize == 1 and eng.pool.kv_format.name == "q8_0"
    # tiny: full 1 layer x 1 head x 64 values, SWA 5 layers x 2 heads x 32, K and V, 34 bytes a block
    want = {"full": 2 * 68, "swa": 2 * 5 * 2 * 34}
    stats = eng.stats()
    assert stats["kv_cache_dtype"] == "q8_0" and stats["kv_bytes_per_token"] == want
    state = eng.cache_state(4)
    assert state["kv_cache_dtype"] == "q8_0" and state["kv_bytes_per_token"] == want
    from prometheus_client import CollectorRegistry, generate_latest

    from swaserve.server.metrics import _EngineCollector

    reg = CollectorRegistry()
    reg.register(_EngineCollector(lambda: stats, lambda: "m"))
    text = generate_latest(reg).decode()
    assert 'swaserve:kv_bytes_per_token{dtype="q8_0",model_name="m",pool="swa"} 680.0' in text
    assert 'swaserve:kv_bytes_per_token{dtype="q8_0",model_name="m",pool="full"} 136.0' in text


@pytest.mark.parametrize("kw,batch", [
    # the torch backend, the oracle path: one request at a time, since torch's fp32 GEMMs round a row
    # differently in a batch of several on some CPUs' kernels (AVX512 boxes of round 3: a greedy token flips)
    ({"kv_cache_dtype": "q8_0", "cpu_matmul": "exact"}, 1),
    ({"kv_cache_dtype": "fp16", "kv_cache_dtype_k": "q8_0"}, 16),  # K q8_0, V fp16, native
])
def test_other_paths(kw: dict, batch: int) -> None:
    radix = check_alone_batched_cached(kw, batch)
    if "kv_cache_dtype_k" in kw:
        assert radix.engine.stats()["kv_cache_dtype"] == "K q8_0 / V fp16"


def test_fused_device_path_stores_q8_0() -> None:
    """engine/fused (Triton interpreter here): the layer's K/V go through a scratch and are quantized into
    the q8_0 pool; the stored KV and the hidden states match the reference path's."""
    import torch

    from swaserve.engine.fused.ops import device_kernels
    from swaserve.engine.runner.model_runner import build_metadata
    from swaserve.engine.runner.peak_step import peak_batch

    llm = LLM(attention_backend="triton", moe_backend="triton", chunked_prefill_size=48, cpu_matmul="exact",
              kv_cache_dtype="q8_0")
    model, pool = llm.engine.runner.model, llm.engine.pool
    page = llm.engine.config.cache.page_size
    batch, _ = peak_batch(chunk=40, decodes=3, page_size=page)
    meta = build_metadata(batch, page, model.cfg.sliding_window)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (batch.num_tokens,), generator=g)
    pool.buffer.zero_()
    ref = model.forward(ids, meta, pool)
    ref_bytes = pool.buffer.clone()
    pool.buffer.zero_()
    with device_kernels():
        got = model.forward(ids, meta, pool)
    # the stores agree to the bit but where fp32 sums in another order move a value across a rounding edge
    # of q8_0 (one code, by one step; seen: 1 of 2752 V codes in the last two layers); such a flip moves
    # its token's later rows by up to ~4e-3, every other row agrees to fp32 rounding
    same = (pool.buffer == ref_bytes).float().mean().item()
    assert same > 0.999, same
    def codes(buf: torch.Tensor) -> torch.Tensor:  # every 34-byte block's int8 codes (no padding here)
        return buf.view(-1, 34)[:, 2:].view(torch.int8).int()

    assert (codes(pool.buffer) - codes(ref_bytes)).abs().max().item() <= 1
    row_err = (got - ref).abs().max(1).values  # [T]
    assert (row_err < 2e-4).float().mean().item() >= 0.9 and row_err.max().item() < 5e-2, row_err


def test_a_bare_cpu_engine_stores_q8_0_and_the_exact_path_fp16() -> None:
    """What a bare `swaserve serve` gets on CPU (`--kv-cache-dtype auto`): q8_0 pools; fp16 with
    `--cpu-matmul exact`, the accuracy path."""
    bare = LLM(device="cpu")
    assert bare.engine.pool.kv_format.name == "q8_0" and bare.engine.stats()["kv_cache_dtype"] == "q8_0"
    bare.close()
    exact = LLM(device="cpu", cpu_matmul="exact")
    assert exact.engine.pool.kv_format.name == "fp16"
    exact.close()
