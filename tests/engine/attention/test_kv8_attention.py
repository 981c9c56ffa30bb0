"""Attention over 8-bit KV pools (q8_0, fp8_e4m3, and K / V of different types) against the same backend
over an fp32 (or fp16) pool holding the dequantized values: torch, native and triton (interpreter here).

The 8-bit pool quantizes the new tokens' K/V on write; the reference pool is given the values those
bytes decode to, so both attend over identical numbers and must agree to the last bits. The batches put
decodes and prefill chunks with a cached prefix on page boundaries and on the edges of the sliding window;
unused bytes of the 8-bit pool are random (NaN / huge scales: reading a wrong slot shows). The reference
is itself checked against dense float64 attention.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_format import KV_TYPES, KVFormat
from swaserve.engine.attention.kv_pool import ArenaKVPool, KVPool, arena_geometry
from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.config import ModelConfig
from swaserve.engine.quant import native
from swaserve.engine.quant.kv_quant import decode, encode

H, W = 6, 7  # query heads (3 KV heads on sliding layers, 1 on full); the window (not a multiple of the page)
SWA, FULL = 0, 1
FORMATS = {
    "q8_0": ("q8_0", "q8_0"),
    "k_q8_0_v_fp16": ("q8_0", "fp16"),
    "k_q8_0_v_fp32": ("q8_0", "fp32"),  # in an arena V's rows start after 3 x 34 bytes of K padded to 104
    "fp8_e4m3": ("fp8_e4m3", "fp8_e4m3"),
}
# decodes just before / on / after page (4) and window (7) edges, prefill chunks over a cached prefix that
# start mid-page and on a page, reach back past the window, and one without a prefix
PREFIXES = [3, 4, 7, 8, 6, 13, 0, 5, 8, 0, 20]
Q_LENS = [1, 1, 1, 1, 1, 1, 1, 9, 4, 11, 1]


def cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=16, hidden_size=32, num_layers=2, num_heads=H, layer_types=("sliding", "full"),
        head_dim_swa=32, head_dim_full=64, num_kv_heads_swa=3, num_kv_heads_full=1, sliding_window=W,
        intermediate_size=8, moe_intermediate_size=8, num_experts=2, top_k_experts=1,
    )


def fmt(name: str) -> KVFormat:
    k, v = FORMATS[name]
    return KVFormat(KV_TYPES[k], KV_TYPES[v])


@dataclass
class Case:
    meta: AttentionMetadata
    pool: KVPool  # the 8-bit pool
    ref: KVPool  # the same pages, the decoded values, fp32 (or the query dtype)
    q: list[torch.Tensor]  # per layer [T, H, D]
    new: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: the new tokens' K, V values [T, KVH, D]
    new_ref: list[tuple[torch.Tensor, torch.Tensor]]  # what the 8-bit pool's bytes decode to
    dense: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per layer, per sequence: decoded K, V [L, KVH, D]


def make_case(name: str, layout: str, page: int, seed: int, q_dtype: torch.dtype = torch.float32,
              prefixes: list[int] = PREFIXES, q_lens: list[int] = Q_LENS) -> Case:
    c, f = cfg(), fmt(name)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    need = sum(-(-s // page) for s in seq_lens) + 2
    if layout == "split":
        pool: KVPool = KVPool(c, need, need, page, f, torch.device("cpu"))
        full_ids, swa_ids = list(range(need)), list(range(need))
    else:
        k = arena_geometry(c, f)[0]
        blocks = list(range(need + -(-need // k) + 2))
        pool = ArenaKVPool(c, len(blocks), page, f, torch.device("cpu"))
        rng.shuffle(blocks)
        swa_ids, full_ids = blocks[:need], [b * k + j for b in blocks[need:] for j in range(k)]
    ref_dtype = torch.float32 if q_dtype == torch.float32 else q_dtype
    ref = KVPool(c, pool.full_pages, pool.swa_pages, page, ref_dtype, torch.device("cpu"))
    for t in pool.tensors():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    for t in ref.tensors():
        t.normal_(generator=g)
    rng.shuffle(full_ids)
    rng.shuffle(swa_ids)
    B, mp = len(prefixes), max(-(-s // page) for s in seq_lens)
    full_pt = torch.full((B, mp), -1, dtype=torch.int64)
    swa_pt = torch.full((B, mp), -1, dtype=torch.int64)
    for b, p in enumerate(prefixes):
        for j in range(-(-seq_lens[b] // page)):
            full_pt[b, j] = full_ids.pop()
            if j >= max(0, p - W + 1) // page:  # earlier SWA pages are evicted
                swa_pt[b, j] = swa_ids.pop()
    q, new, new_ref, dense = [], [], [], []
    for layer, pt in ((SWA, swa_pt), (FULL, full_pt)):
        K8, V8 = pool.kv(layer)
        KR, VR = ref.kv(layer)
        kvh, d = KR.shape[1], KR.shape[2]
        per_seq, ks, vs, ks_ref, vs_ref = [], [], [], [], []
        for b, p in enumerate(prefixes):
            L = seq_lens[b]
            kd = torch.randn(L, kvh, d, generator=g) * torch.exp(torch.randn(L, kvh, 1, generator=g))
            vd = torch.randn(L, kvh, d, generator=g) * torch.exp(torch.randn(L, kvh, 1, generator=g))
            kq, vq = decode(encode(kd, K8.dtype), ref_dtype), decode(encode(vd, V8.dtype), ref_dtype)
            lo = max(0, p - W + 1) if layer == SWA else 0
            pos = torch.arange(lo, p)  # the cached prefix still in the pool
            slots = pt[b, pos // page] * page + pos % page
            K8[slots], V8[slots] = encode(kd[lo:p], K8.dtype), encode(vd[lo:p], V8.dtype)
            KR[slots], VR[slots] = kq[lo:p], vq[lo:p]
            per_seq.append((kq, vq))
            ks.append(kd[p:])
            vs.append(vd[p:])
            ks_ref.append(kq[p:])
            vs_ref.append(vq[p:])
        dense.append(per_seq)
        new.append((torch.cat(ks), torch.cat(vs)))
        new_ref.append((torch.cat(ks_ref), torch.cat(vs_ref)))
        q.append(torch.randn(sum(q_lens), H, KR.shape[2], generator=g).to(q_dtype))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, q_lens)])
    b_of = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
    meta = AttentionMetadata(page, W, list(q_lens), list(prefixes), positions,
                             full_pt[b_of, positions // page] * page + positions % page,
                             swa_pt[b_of, positions // page] * page + positions % page, full_pt, swa_pt)
    return Case(meta, pool, ref, q, new, new_ref, dense)


def brute(case: Case, layer: int) -> torch.Tensor:
    """Dense float64 attention over the decoded values: [T, H, D]."""
    outs = []
    for b, (p, n) in enumerate(zip(case.meta.prefix_lens, case.meta.q_lens)):
        q = case.q[layer][case.meta.cu_q_lens[b]:case.meta.cu_q_lens[b] + n].double()  # [n, H, D]
        k, v = (t.double().repeat_interleave(H // t.shape[1], 1) for t in case.dense[layer][b])  # [L, H, D]
        s = torch.einsum("qhd,khd->hqk", q, k)
        qpos, kpos = torch.arange(p, p + n)[:, None], torch.arange(p + n)[None, :]
        mask = kpos <= qpos
        if layer == SWA:
            mask &= kpos > qpos - W
        outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def run(case: Case, make_backend, tol: float = 1e-5, brute_tol: float = 1e-4) -> None:
    for layer in (SWA, FULL):
        got = make_backend().forward(layer, case.q[layer], *case.new[layer], case.meta, case.pool)
        want = make_backend().forward(layer, case.q[layer], *case.new_ref[layer], case.meta, case.ref)
        scale = want.abs().max().item()
        assert not got.isnan().any(), f"layer {layer}: NaN (a wrong slot was read)"
        err = (got.double() - want.double()).abs().max().item() / scale
        assert err <= tol, f"layer {layer}: 8-bit pool vs decoded pool rel err {err:.2e}"
        err = (want.double() - brute(case, layer)).abs().max().item() / scale
        assert err <= brute_tol, f"layer {layer}: reference vs float64 rel err {err:.2e}"
    for layer in (SWA, FULL):  # the new tokens were stored exactly as encode() stores them
        K8, V8 = case.pool.kv(layer)
        slots = case.meta.swa_slots if layer == SWA else case.meta.full_slots
        k, v = case.new[layer]
        assert torch.equal(K8[slots].view(torch.uint8), encode(k, K8.dtype).view(torch.uint8))
        assert torch.equal(V8[slots].view(torch.uint8), encode(v, V8.dtype).view(torch.uint8))


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("layout", ["split", "arena"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_torch_backend(name: str, layout: str, page: int) -> None:
    run(make_case(name, layout, page, seed=page + 10 * len(name)), TorchAttentionBackend)


needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernels: {native.why_unavailable()}")


def native_backend() -> TorchAttentionBackend:
    from swaserve.engine.attention.native_backend import NativeAttentionBackend

    return NativeAttentionBackend()


@needs_native
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("layout", ["split", "arena"])
@pytest.mark.parametrize("name", ["q8_0", "k_q8_0_v_fp16", "k_q8_0_v_fp32"])
def test_native_backend(name: str, layout: str, page: int) -> None:
    run(make_case(name, layout, page, seed=page + 7 * len(name)), native_backend)


@needs_native
def test_native_paths_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """q8_0 decode rows go through the native call and prefill keys through the native gather, not the
    torch dequantization (which would pass the oracle too)."""
    import swaserve.engine.attention.torch_backend as tb

    def fail(*a: object, **k: object) -> None:
        raise AssertionError("torch path taken")

    monkeypatch.setattr(TorchAttentionBackend, "_decode", fail)
    monkeypatch.setattr(tb, "decode_q8_0", fail)
    case = make_case("q8_0", "arena", 4, seed=5)
    for layer in (SWA, FULL):
        native_backend().forward(layer, case.q[layer], *case.new[layer], case.meta, case.pool)


@pytest.mark.parametrize(("name", "layout", "page", "q_dtype", "blocks"), [
    ("q8_0", "arena", 4, torch.float32, "small"),
    ("q8_0", "split", 16, torch.float32, "small"),
    ("q8_0", "arena", 4, torch.float16, "small"),  # the GPU dot path: dequantized K / V converted to fp16
    ("q8_0", "arena", 16, torch.float16, "default"),  # the GPU tiles (q8_0: key blocks of 32)
    ("k_q8_0_v_fp16", "arena", 4, torch.float32, "small"),
    ("k_q8_0_v_fp32", "arena", 16, torch.float32, "small"),
    ("fp8_e4m3", "split", 4, torch.float32, "small"),
])
def test_triton_backend(name: str, layout: str, page: int, q_dtype: torch.dtype, blocks: str) -> None:
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend

    def backend() -> TritonAttentionBackend:
        if blocks == "default":
            return TritonAttentionBackend()
        return TritonAttentionBackend(block_m=16, block_n=16, decode_splits=3)

    case = make_case(name, layout, page, seed=page + len(name), q_dtype=q_dtype)
    half = q_dtype != torch.float32
    run(case, backend, tol=2e-3 if half else 1e-5, brute_tol=5e-3 if half else 1e-4)
