"""KV storage types (engine/attention/kv_format.py): bytes per token, the arena geometry of mixed K / V types
(a hypothesis property: every layer's rows tile their page without overlap, aligned, and the views write
the arena's own bytes), pool sizing from a memory budget, and the flags with their errors."""

from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.engine.args import add_engine_args, engine_config_from_args
from swaserve.engine.attention.base import store_kv
from swaserve.engine.attention.kv_format import KV_TYPES, KVFormat, auto_type, kv_format, kv_format_of
from swaserve.engine.attention.kv_pool import (
    ArenaKVPool,
    KVPool,
    arena_geometry,
    bytes_per_token,
    resolve_kv_dtype,
)
from swaserve.engine.builder import plan_kv_pools
from swaserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from swaserve.engine.quant.kv_quant import decode, encode
from swaserve.models.demo.tiny import preset_config

CPU = torch.device("cpu")
GEMMA = preset_config("26b-a4b")


def two_layers(d_swa: int, d_full: int) -> ModelConfig:
    """One sliding and one full layer of one KV head each."""
    return ModelConfig(vocab_size=8, hidden_size=16, num_layers=2, num_heads=2,
                       layer_types=("sliding", "full"), head_dim_swa=d_swa, head_dim_full=d_full,
                       num_kv_heads_swa=1, num_kv_heads_full=1, sliding_window=4, intermediate_size=8,
                       moe_intermediate_size=8, num_experts=2, top_k_experts=1)


def both(name: str) -> KVFormat:
    return KVFormat(KV_TYPES[name], KV_TYPES[name])


def test_bytes_per_token_of_gemma_4() -> None:
    assert bytes_per_token(GEMMA, torch.float32) == (40960, 409600)
    assert bytes_per_token(GEMMA, both("fp16")) == bytes_per_token(GEMMA, both("bf16")) == (20480, 204800)
    assert bytes_per_token(GEMMA, both("q8_0")) == (10880, 108800)  # 34 bytes per 32 values
    assert bytes_per_token(GEMMA, both("fp8_e4m3")) == (10240, 102400)
    assert bytes_per_token(GEMMA, KVFormat(KV_TYPES["q8_0"], KV_TYPES["fp16"])) == (15680, 156800)
    assert arena_geometry(GEMMA, both("q8_0")) == (10, 10880, 108800)  # bytes: no padding
    assert arena_geometry(GEMMA, both("fp16")) == arena_geometry(GEMMA) == (10, 10240, 102400)  # elements


def test_memory_budget_holds_about_twice_the_fp16_tokens() -> None:
    sched = SchedulerConfig(max_running_requests=4, chunked_prefill_size=512)
    plans = {name: plan_kv_pools(GEMMA, CacheConfig(kv_cache_dtype=name, kv_cache_memory_gb=4.0), sched,
                                 131072, CPU) for name in ("fp16", "q8_0")}
    ratio = plans["q8_0"].full_pages / plans["fp16"].full_pages
    assert abs(ratio - 2 / 1.0625) < 0.01, ratio  # 2 bytes a value against 34 / 32
    assert plans["q8_0"].dtype == torch.uint8 and plans["q8_0"].block_bytes == 16 * 108800
    assert "q8_0 (10880 / 108800 bytes per full / SWA token)" in plans["q8_0"].describe(16, GEMMA)
    # the start-up line: a 26B-A4B window is 200 MiB of fp16, 106.25 MiB of q8_0 (1.88x the windows)
    assert plans["fp16"].windows(16, GEMMA).startswith(
        "fp16 stores 20480 bytes per full token, 204800 per SWA token; one 1024-token sliding window costs "
        "200.0 MiB: 5.1 windows per GiB, ")
    line = plans["q8_0"].windows(16, GEMMA)
    assert "costs 106.2 MiB: 9.6 windows per GiB" in line
    assert line.endswith(f"{plans['q8_0'].swa_cap * 16 / 1024:.1f} in this arena")


def _parse(*argv: str) -> CacheConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv))).cache


def test_flags_and_per_side_types() -> None:
    c = _parse("--kv-cache-dtype", "q8_0")
    assert kv_format_of(c, CPU) == both("q8_0")
    c = _parse("--kv-cache-dtype", "q8_0", "--kv-cache-dtype-v", "fp16")
    assert kv_format_of(c, CPU) == KVFormat(KV_TYPES["q8_0"], KV_TYPES["fp16"])
    assert kv_format_of(c, CPU).name == "K q8_0 / V fp16"
    c = _parse("--kv-cache-dtype-v", "fp16")  # auto K: q8_0 on CPU, bf16 on CUDA
    assert kv_format_of(c, CPU) == KVFormat(KV_TYPES["q8_0"], KV_TYPES["fp16"])
    c = _parse("--kv-cache-dtype-k", "q8_0")  # auto V: fp16 under --cpu-matmul exact, bf16 on CUDA
    assert kv_format_of(c, CPU, "exact") == KVFormat(KV_TYPES["q8_0"], KV_TYPES["fp16"])
    assert kv_format(c.kv_cache_dtype, torch.device("cuda"), "q8_0").v == KV_TYPES["bf16"]
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype-v", "q4_0")


def test_auto_is_q8_0_on_cpu_fp16_on_the_exact_path_and_fp32_stays_selectable() -> None:
    """A bare `swaserve serve` on CPU stores q8_0 KV (docs/benchmarks.md, KV accuracy), fp16 under
    --cpu-matmul exact; fp32 on request."""
    assert kv_format_of(_parse(), CPU) == both("q8_0") and auto_type(CPU) == "q8_0"
    assert kv_format_of(_parse(), CPU, "fast") == both("q8_0")
    assert kv_format_of(_parse(), CPU, "exact") == both("fp16") and auto_type(CPU, "exact") == "fp16"
    assert kv_format("auto", torch.device("cuda"), cpu_matmul="exact") == both("bf16")
    assert kv_format("auto", torch.device("cuda")) == both("bf16")
    assert kv_format_of(_parse("--kv-cache-dtype", "fp32"), CPU) == both("fp32")
    assert resolve_kv_dtype("auto", CPU) == torch.float16


def test_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 needs CUDA"):
        kv_format("fp8_e4m3", CPU)
    with pytest.raises(ValueError, match="--kv-cache-dtype-v fp8_e4m3 needs CUDA"):
        kv_format("q8_0", CPU, v="fp8_e4m3")
    with pytest.raises(ValueError, match="--kv-cache-dtype-k 'int4'"):
        kv_format("auto", CPU, k="int4")
    odd = two_layers(16, 48)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype q8_0 \(for K\) .* head_dim 48 .* multiple of 32"):
        KVPool(odd, 2, 2, 4, both("q8_0"), CPU)
    with pytest.raises(ValueError, match=r"q8_0 \(for V\)"):
        ArenaKVPool(odd, 2, 4, KVFormat(KV_TYPES["fp16"], KV_TYPES["q8_0"]), CPU)


def test_v_rows_after_odd_q8_0_k_rows_are_aligned() -> None:
    """K q8_0 / V fp32, one sliding layer of one 32-wide head: K takes 34 bytes of the record, V starts at
    36 (fp32 alignment), records of 36 + 128 = 164 bytes."""
    cfg = two_layers(32, 32)
    pool = ArenaKVPool(cfg, 2, 4, KVFormat(KV_TYPES["q8_0"], KV_TYPES["fp32"]), CPU)
    assert arena_geometry(cfg, pool.kv_format) == (1, 164, 164) and pool.dtype == torch.uint8
    kc, vc = pool.kv(0)
    assert vc.data_ptr() - kc.data_ptr() == 36 and kc.stride(0) == 164 and vc.stride(0) == 164 // 4
    x = torch.randn(2, 1, 32)
    store_kv(kc, vc, torch.tensor([5, 2]), x, 2 * x)
    assert torch.equal(vc[[5, 2]], 2 * x) and torch.equal(decode(kc[[5, 2]], torch.float32),
                                                          decode(encode(x, torch.uint8), torch.float32))


def test_fp8_on_cpu_fails_before_the_model_loads() -> None:
    from swaserve.llm import LLM

    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 needs CUDA"):
        LLM(kv_cache_dtype="fp8_e4m3", device="cpu")


def _cfg(data: st.DataObject) -> ModelConfig:
    ns, nf = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    kinds = data.draw(st.permutations(["sliding"] * ns + ["full"] * nf))
    return ModelConfig(
        vocab_size=8, hidden_size=16, num_layers=ns + nf, num_heads=4, layer_types=tuple(kinds),
        head_dim_swa=32 * data.draw(st.integers(1, 4)), head_dim_full=32 * data.draw(st.integers(1, 4)),
        num_kv_heads_swa=data.draw(st.integers(1, 3)), num_kv_heads_full=data.draw(st.integers(1, 2)),
        sliding_window=8, intermediate_size=8, moe_intermediate_size=8, num_experts=2, top_k_experts=1)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_arena_rows_tile_their_pages(data: st.DataObject) -> None:
    cfg = _cfg(data)
    names = st.sampled_from(list(KV_TYPES))
    fmt = KVFormat(KV_TYPES[data.draw(names)], KV_TYPES[data.draw(names)])
    page = data.draw(st.sampled_from([1, 2, 3, 16]))
    pool = ArenaKVPool(cfg, 3, page, fmt, CPU)
    k, full_rec, swa_rec = pool.full_per_block, pool.full_record, pool.swa_record
    unit = pool.buffer.element_size()
    full_b, swa_b = bytes_per_token(cfg, fmt)
    assert swa_rec == k * full_rec and full_rec * unit >= full_b and swa_rec * unit >= swa_b
    assert (k + 1) * (full_b + fmt.align) > swa_b  # as many full pages a block as fit (records padded)
    assert pool.nbytes() == 3 * page * swa_rec * unit
    base = pool.buffer.data_ptr()
    # every page of block 1, as one SWA page and as k full pages (a block holds one kind at a time)
    pages = {"sliding": [1], "full": list(range(k, 2 * k))}
    spans: dict[str, list[tuple[int, int]]] = {"sliding": [], "full": []}
    for layer, kind in enumerate(cfg.layer_types):
        tensor_kind = "swa" if kind == "sliding" else "full"
        for view, typ in zip(pool.kv(layer), (fmt.k, fmt.v)):
            d = cfg.head_dim_swa if kind == "sliding" else cfg.head_dim_full
            row = typ.row_bytes(d)
            assert view.dtype == typ.storage and view.shape[2] * view.element_size() == row
            el = view.element_size()
            for p in pages[kind]:
                lo = pool.page_tensor(tensor_kind)[p].data_ptr() - base
                hi = lo + page * (full_rec if tensor_kind == "full" else swa_rec) * unit
                for s in range(p * page, (p + 1) * page):
                    for h in range(view.shape[1]):
                        start = view.data_ptr() - base + (s * view.stride(0) + h * view.stride(1)) * el
                        assert lo <= start and start + row <= hi and start % typ.align == 0
                        spans[kind].append((start, start + row))
    for s in spans.values():
        s.sort()
        assert all(a[1] <= b[0] for a, b in zip(s, s[1:])), "two rows share bytes"
    # the views are the arena's bytes: a store changes exactly that slot's rows
    layer = data.draw(st.integers(0, cfg.num_layers - 1))
    kc, vc = pool.kv(layer)
    d = cfg.head_dim_swa if cfg.layer_types[layer] == "sliding" else cfg.head_dim_full
    slot = torch.tensor([data.draw(st.integers(0, kc.shape[0] - 1))])
    x = torch.randn(1, kc.shape[1], d) * 3
    before = pool.buffer.view(torch.uint8).clone()
    store_kv(kc, vc, slot, x, -x)
    assert torch.equal(decode(kc[slot], torch.float32), decode(encode(x, kc.dtype), torch.float32))
    assert torch.equal(decode(vc[slot], torch.float32), decode(encode(-x, vc.dtype), torch.float32))
    changed = (pool.buffer.view(torch.uint8) != before).nonzero().flatten().tolist()
    el_k, el_v = kc.element_size(), vc.element_size()
    rows = [(kc[slot[0]].data_ptr() - base, kc.shape[1] * kc.shape[2] * el_k, kc.stride(1) * el_k),
            (vc[slot[0]].data_ptr() - base, vc.shape[1] * vc.shape[2] * el_v, vc.stride(1) * el_v)]
    mine = {a + h * stride + i for a, n, stride in rows for h in range(kc.shape[1])
            for i in range(n // kc.shape[1])}
    assert set(changed) <= mine
