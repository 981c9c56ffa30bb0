"""The second KV tier with 8-bit KV: records are the arena's q8_0 bytes (34 per 32 values), they round-trip
bit for bit and survive a reopen; a file written with other KV types (even of the same geometry, fp16 vs
bf16) or by record format 1 is refused with a warning naming both, never read; in the engine, q8_0
outputs with the tier equal those without it."""

from __future__ import annotations

import logging
import random
import struct

import torch

from swaserve.engine.attention.kv_format import KV_TYPES, KVFormat
from swaserve.engine.attention.kv_pool import ArenaKVPool
from swaserve.engine.core import SamplingParams
from swaserve.engine.kvcache.tier.file import FILE_NAME, FORMAT_VERSION, MmapTierIO, fingerprint
from swaserve.engine.kvcache.tier.index import KVTier, chain_keys
from swaserve.llm import LLM
from swaserve.models.demo.tiny import preset_config
from tests.engine.kvcache.tier.helpers import P

FP = fingerprint(["test", 8])
KEYS = chain_keys(list(range(40)), P, 10)


def pool_of(name: str, seed: int = 0) -> ArenaKVPool:
    fmt = KVFormat(KV_TYPES[name], KV_TYPES[name])
    pool = ArenaKVPool(preset_config("tiny"), 6, P, fmt, torch.device("cpu"))
    raw = pool.buffer.view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return pool


def open_tier(path, pool: ArenaKVPool) -> tuple[MmapTierIO, KVTier]:
    io = MmapTierIO(path, pool, 3, FP)
    return io, KVTier(io, 3, pool.full_per_block)


def test_q8_0_records_round_trip_and_survive_a_reopen(tmp_path) -> None:
    pool = pool_of("q8_0")
    io, tier = open_tier(tmp_path, pool)
    # tiny: a full token is 1 layer x 1 head x 2 blocks, K and V (136 bytes), a SWA token 5 x 2 x 1 (680)
    assert io.page_bytes == {"full": P * 136, "swa": P * 680} and pool.full_per_block == 5
    assert tier.save("full", KEYS[0], 7) and tier.save("full", KEYS[1], 12) and tier.save("swa", KEYS[1], 2)
    want = [pool.page_tensor("full")[7].clone(), pool.page_tensor("full")[12].clone(),
            pool.page_tensor("swa")[2].clone()]
    assert want[0].dtype == torch.uint8 and want[0].numel() == P * 136
    io.close()
    pool.buffer.zero_()
    io, tier = open_tier(tmp_path, pool)
    assert not io.reinitialised and tier.reopened == 3
    assert tier.load("full", KEYS[0], 0) and tier.load("full", KEYS[1], 3) and tier.load("swa", KEYS[1], 4)
    got = [pool.page_tensor("full")[0], pool.page_tensor("full")[3], pool.page_tensor("swa")[4]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    io.close()


def test_other_kv_types_are_refused_with_a_warning(tmp_path, caplog) -> None:
    io, tier = open_tier(tmp_path, pool_of("fp16"))
    assert tier.save("full", KEYS[0], 7)
    io.close()
    bf16 = pool_of("bf16")  # the same geometry and the same fingerprint here: only the header's types differ
    with caplog.at_level(logging.WARNING, logger="swaserve.engine"):
        io, tier = open_tier(tmp_path, bf16)
    assert io.reinitialised and len(tier) == 0 and not tier.load("full", KEYS[0], 0)
    assert f"record format {FORMAT_VERSION} with KV fp16,fp16" in caplog.text
    assert f"writes format {FORMAT_VERSION} with KV bf16,bf16" in caplog.text
    io.close()


def test_a_format_1_file_is_refused_with_a_warning(tmp_path, caplog) -> None:
    pool = pool_of("q8_0")
    io, _ = open_tier(tmp_path, pool)
    size = io.size
    io.close()
    path = tmp_path / FILE_NAME
    with open(path, "r+b") as f:  # format 1's header: magic, fingerprint, the same geometry
        f.write(struct.pack("<8s16sQQQQQ", b"SWAKVT01", FP, 3, 5, P * 136, P * 680, 4096))
    assert path.stat().st_size == size
    with caplog.at_level(logging.WARNING, logger="swaserve.engine"):
        io, tier = open_tier(tmp_path, pool)
    assert io.reinitialised and len(tier) == 0
    assert "written by record format 1 with KV fp32, fp16 or bf16" in caplog.text
    io.close()


def test_engine_q8_0_outputs_with_the_tier_equal_without(tmp_path) -> None:
    kw = dict(kv_cache_dtype="q8_0", chunked_prefill_size=96, max_running_requests=2, max_total_tokens=512,
              swa_tokens=256)
    rng = random.Random(3)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(**kw) as plain, LLM(kv_offload_dir=str(tmp_path), kv_offload_gb=0.05, **kw) as tiered:
        V = plain.tokenizer.vocab_size
        systems = [[2] + [rng.randrange(3, V) for _ in range(159)] for _ in range(4)]
        prompts = [s + [rng.randrange(3, V) for _ in range(12)] for _ in range(2) for s in systems]
        a = [plain.generate([p], greedy)[0].token_ids for p in prompts]  # round-robin: evicts prefixes
        b = [tiered.generate([p], greedy)[0].token_ids for p in prompts]
        assert a == b
        s = tiered.engine.stats()
        assert s["kv_tier"]["promotions"] > 0 and s["kv_tier"]["rejected"] == 0
        assert s["kv_cache_dtype"] == "q8_0"
