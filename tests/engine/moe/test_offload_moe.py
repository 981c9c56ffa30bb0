"""OffloadMoE vs TorchMoE: the host path (what a CPU machine runs), and the device LRU cache and
double-buffered streaming paths emulated on CPU tensors (Triton interpreter).

Besides the outputs, the emulated paths check their bookkeeping: every cached (layer, expert)
slot and every stream buffer holds exactly the host bytes of what it claims to hold.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from swaserve.engine.moe.offload_backend import OffloadMoE, expert_bytes, experts_fit
from swaserve.engine.moe.torch_backend import TorchMoE
from tests.engine.moe.moe_cases import (
    OFFLOAD_DEV,
    OFFLOAD_EMULATE,
    make_cfg,
    make_layers,
    new_seed,
    on_offload_dev,
    rel_err,
    routing,
)

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must set TRITON_INTERPRET=1"

E, HID, INTER, K, LAYERS = 8, 64, 64, 2, 3


def setup(seed: int, qtype: str = "Q4_0"):
    g = torch.Generator().manual_seed(seed)
    layers = make_layers(g, qtype, LAYERS, E, HID, INTER)
    cfg = make_cfg(E, K, HID, INTER, num_layers=LAYERS)
    return g, cfg, layers, TorchMoE(cfg, layers, "cpu")


def check_bookkeeping(moe: OffloadMoE) -> None:
    cache = moe._cache
    if cache is not None:
        slots = list(cache.lru.values()) + [slot for slot, _ in cache.pending.values()]
        assert len(slots) == len(set(slots)) and not set(slots) & set(cache.free)
        assert len(slots) + len(cache.free) == cache.size
        for (layer, e), slot in cache.lru.items():
            assert torch.equal(cache.slots[0].data[slot].cpu(), moe.gate_up[layer].data[e]), (layer, e)
            assert torch.equal(cache.slots[1].data[slot].cpu(), moe.down[layer].data[e]), (layer, e)
        assert torch.equal(cache.table.cpu(), cache.mirror)  # CPU: every table update has landed
        on_host = cache.mirror == cache.host_off
        published = {(li, e) for li in range(moe.num_layers) for e in range(cache.num_experts)
                     if not on_host[li, :, e].all()}
        assert published == set(cache.lru), "table entries off the host = the published slots"
    for b, layer in enumerate(moe._stream_buffer_layer):
        if layer >= 0:
            assert torch.equal(moe._stream_buffers[b][0].data.cpu(), moe.gate_up[layer].data), (b, layer)
            assert torch.equal(moe._stream_buffers[b][1].data.cpu(), moe.down[layer].data), (b, layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_host_path_equals_torch_moe(qtype: str, dtype: torch.dtype) -> None:
    seed = new_seed()
    g, cfg, layers, ref = setup(seed, qtype)
    moe = OffloadMoE(cfg, layers, "cpu", cache_size=4)  # a CPU device has no cache: host path
    assert moe.cache_size == 0
    for t in (1, 6, 70):
        x = torch.randn(t, HID, generator=g).to(dtype)
        ids, w = routing(g, t, E, K)
        for li in range(LAYERS):
            y = moe.forward(li, *on_offload_dev(x, ids, w))
            r = ref.forward(li, x, ids, w)
            assert y.dtype == dtype and y.shape == (t, HID)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert rel_err(y, r.double()) <= tol, f"{qtype} T={t} layer {li} seed {seed}"
    assert moe.stats["host"] == 3 * LAYERS and moe.stats["cache"] == moe.stats["stream"] == 0


def test_emulated_cache_lru_decode() -> None:
    seed = new_seed()
    g, cfg, layers, ref = setup(seed)
    rng = random.Random(seed)
    moe = OffloadMoE(cfg, layers, OFFLOAD_DEV, cache_size=5, emulate_device=OFFLOAD_EMULATE,
                     stream_min_tokens=8)
    for step in range(6):
        t = rng.choice([1, 2])  # at most 4 distinct experts <= 5 slots
        x = torch.randn(t, HID, generator=g)
        ids, w = routing(g, t, E, K)
        for li in range(LAYERS):
            y = moe.forward(li, *on_offload_dev(x, ids, w))
            err = rel_err(y, ref.forward(li, x, ids, w).double())
            assert err <= 1e-4, f"step {step} layer {li} seed {seed}"
            check_bookkeeping(moe)
    st = moe.stats
    assert st["cache"] == 6 * LAYERS and st["stream"] == 0 and st["host"] == 0
    assert st["misses"] > moe.cache_size, "the cache never evicted: LRU replacement untested"
    # a repeated step: the cache is filled one step behind, so the third call finds every expert
    x = torch.randn(2, HID, generator=g)
    ids, w = routing(g, 2, E, K)
    moe.forward(0, *on_offload_dev(x, ids, w))
    moe.forward(0, *on_offload_dev(x, ids, w))
    hits = st["hits"]
    y = moe.forward(0, *on_offload_dev(x, ids, w))
    assert st["hits"] - hits == len(torch.unique(ids))
    assert rel_err(y, ref.forward(0, x, ids, w).double()) <= 1e-4


def test_emulated_stream_double_buffer_and_fallbacks() -> None:
    seed = new_seed()
    g, cfg, layers, ref = setup(seed)
    moe = OffloadMoE(cfg, layers, OFFLOAD_DEV, cache_size=3, emulate_device=OFFLOAD_EMULATE,
                     stream_min_tokens=8)
    order = [0, 1, 2, 0, 1, 2, 2, 0]  # in order (prefetch hits), a repeat, a wrap-around
    for li in order:
        t = 9  # >= stream_min_tokens: whole-layer streaming
        x = torch.randn(t, HID, generator=g)
        ids, w = routing(g, t, E, K, skew=li == 1)
        y = moe.forward(li, *on_offload_dev(x, ids, w))
        assert rel_err(y, ref.forward(li, x, ids, w).double()) <= 1e-4, f"layer {li} seed {seed}"
        check_bookkeeping(moe)
    assert moe.stats["stream"] == len(order)
    # one synchronous fill (the first layer), then every layer arrives by prefetch; the repeated
    # layer 2 finds layer 0 already prefetched: len(order) copies in all
    assert moe.stats["layer_copies"] == len(order)
    # a decode step needing more experts than the cache holds: the rest are read from host memory
    x = torch.randn(3, HID, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    w = torch.rand(3, K, generator=g)
    for _ in range(3):
        y = moe.forward(1, *on_offload_dev(x, ids, w))
        assert rel_err(y, ref.forward(1, x, ids, w).double()) <= 1e-4
        check_bookkeeping(moe)
    assert moe.stats["stream"] == len(order) and moe.stats["cache"] == 3


def test_emulated_without_cache_reads_host_memory() -> None:
    """cache_size 0: every expert is read by the kernel from the host stacks (zero copy), no copies."""
    seed = new_seed()
    g, cfg, layers, ref = setup(seed)
    moe = OffloadMoE(cfg, layers, OFFLOAD_DEV, cache_size=0, emulate_device=OFFLOAD_EMULATE,
                     stream_min_tokens=8)
    for _ in range(2):
        x = torch.randn(2, HID, generator=g)
        ids, w = routing(g, 2, E, K)
        y = moe.forward(2, *on_offload_dev(x, ids, w))
        assert rel_err(y, ref.forward(2, x, ids, w).double()) <= 1e-4
    assert moe.stats["cache"] == 2 and moe.stats["host"] == 0 and moe.stats["expert_copies"] == 0


def test_sizes_and_registry() -> None:
    from swaserve.engine.moe import get_moe_backend

    g, cfg, layers, _ = setup(0)
    per_layer = E * 2 * INTER * (HID // 32 * 18) + E * HID * (INTER // 32 * 18)
    assert expert_bytes(layers) == LAYERS * per_layer
    assert experts_fit(layers, torch.device("cpu"))
    moe = get_moe_backend("offload", cfg, layers, "cpu", cache_size=7)
    assert isinstance(moe, OffloadMoE) and moe.cache_size == 0
    with pytest.raises(ValueError, match="cache-size"):
        OffloadMoE(cfg, layers, "cpu", cache_size=-1)


def test_one_exact_size_host_buffer() -> None:
    """The CUDA host copy: every expert stack a view of one buffer of exactly the logical bytes (plus
    < 64 B alignment per tensor), with the stored bytes; pinning is CUDA-only and not tried here."""
    from swaserve.engine.moe.offload_backend import HOST_ALIGN, host_buffer

    g = torch.Generator().manual_seed(new_seed())
    layers = make_layers(g, "Q4_0", LAYERS, E, HID, INTER)
    flat = [t for ew in layers for t in (ew.gate_up, ew.down)]
    views, buf, registered = host_buffer(flat, pin=False)
    assert not registered
    logical = expert_bytes(layers)
    assert logical <= buf.numel() < logical + HOST_ALIGN * len(flat)
    for w, v in zip(flat, views):
        assert torch.equal(v.data, w.data) and v.shape == w.shape and v.qtype == w.qtype
        assert v.data.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert (v.data.data_ptr() - buf.data_ptr()) % HOST_ALIGN == 0


def test_host_buffer_repacks_q4_0_losslessly() -> None:
    from swaserve.engine.moe.offload_backend import host_buffer
    from swaserve.engine.quant.q4_repack import Q4_0_PAIRS, unpack_q4_0

    layers = make_layers(torch.Generator().manual_seed(new_seed()), "Q4_0", 1, E, HID, INTER)
    flat = [layers[0].gate_up, layers[0].down]
    views, buf, _ = host_buffer(flat, pin=False, repack=True)
    for w, v in zip(flat, views):
        assert v.layout == Q4_0_PAIRS and torch.equal(unpack_q4_0(v.data, w.shape[-1]), w.data)
