"""Triton paged attention vs a dense float64 brute force (and the torch backend when present).

Fresh random inputs each run; the seed is in every failure message (SWASERVE_TEST_SEED reproduces
it). Unused pool slots and the output buffer are poisoned with NaN, so a kernel that reads a
slot outside its keys, or leaves an output row unwritten, fails.
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass

import pytest
import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import ArenaKVPool, KVPool, arena_geometry
from swaserve.engine.config import ModelConfig

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must set TRITON_INTERPRET=1"

import swaserve.engine.attention.triton_backend as tb  # noqa: E402
from swaserve.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # max err / max |ref|
SWA, FULL = 0, 1  # layer indices in the test config


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output and partial buffer the backend allocates starts as NaN."""

    def nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tb, "empty", nan_empty)


def new_seed() -> int:
    return int(os.environ.get("SWASERVE_TEST_SEED", random.randrange(2**31)))


def make_cfg(h: int, kvh_swa: int, kvh_full: int, d_swa: int, d_full: int, window: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32, hidden_size=32, num_layers=2, num_heads=h, layer_types=("sliding", "full"),
        head_dim_swa=d_swa, head_dim_full=d_full, num_kv_heads_swa=kvh_swa, num_kv_heads_full=kvh_full,
        sliding_window=window, intermediate_size=32, moe_intermediate_size=32, num_experts=4,
        top_k_experts=2,
    )


@dataclass
class Case:
    meta: AttentionMetadata
    pool: KVPool
    q: list[torch.Tensor]  # per layer [T, H, D]
    k_new: list[torch.Tensor]  # per layer [T, KVH, D]
    v_new: list[torch.Tensor]
    k_all: list[list[torch.Tensor]]  # per layer, per sequence [L, KVH, D] ground truth (pool dtype)
    v_all: list[list[torch.Tensor]]


def make_case(seed: int, cfg: ModelConfig, q_lens: list[int], prefix_lens: list[int], page: int,
              dtype: torch.dtype, q_dtype: torch.dtype | None = None, layout: str = "split") -> Case:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    W, B = cfg.sliding_window, len(q_lens)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    n_pages = [-(-s // page) for s in seq_lens]
    total = sum(n_pages) + 3
    if layout == "split":
        pool: KVPool = KVPool(cfg, total, total, page, dtype, DEV)
        full_ids, swa_ids = list(range(total)), list(range(total))
    else:  # one buffer: SWA pages and full pages in disjoint blocks (views with the token record as stride)
        k = arena_geometry(cfg)[0]
        blocks = list(range(total + -(-total // k) + 2))
        pool = ArenaKVPool(cfg, len(blocks), page, dtype, DEV)
        rng.shuffle(blocks)
        swa_ids, full_ids = blocks[:total], [b * k + j for b in blocks[total:] for j in range(k)]
    for t in pool.tensors():
        t.fill_(float("nan"))  # poison: only slots of live pages get real K/V
    rng.shuffle(full_ids)
    rng.shuffle(swa_ids)
    mp = max(n_pages)
    full_pt = torch.full((B, mp), -1, dtype=torch.int64)
    swa_pt = torch.full((B, mp), -1, dtype=torch.int64)
    for b in range(B):
        first_swa = max(0, prefix_lens[b] - W + 1) // page  # earlier SWA pages are evicted
        for j in range(n_pages[b]):
            full_pt[b, j] = full_ids.pop()
            sid = swa_ids.pop()
            if j >= first_swa:
                swa_pt[b, j] = sid
    heads = {SWA: (cfg.num_kv_heads_swa, cfg.head_dim_swa), FULL: (cfg.num_kv_heads_full, cfg.head_dim_full)}
    q, k_new, v_new, k_all, v_all = [], [], [], [], []
    for layer, pt in ((SWA, swa_pt), (FULL, full_pt)):
        kvh, d = heads[layer]
        kc, vc = pool.kv(layer)
        ks = [torch.randn(s, kvh, d, generator=g).to(dtype) for s in seq_lens]
        vs = [torch.randn(s, kvh, d, generator=g).to(dtype) for s in seq_lens]
        for b in range(B):
            pos = torch.arange(prefix_lens[b])
            slot = pt[b, pos // page] * page + pos % page
            keep = slot >= 0  # no page: evicted SWA KV stays NaN
            kc[slot[keep].to(DEV)] = ks[b][: prefix_lens[b]][keep].to(DEV)
            vc[slot[keep].to(DEV)] = vs[b][: prefix_lens[b]][keep].to(DEV)
        k_all.append(ks)
        v_all.append(vs)
        k_new.append(torch.cat([ks[b][prefix_lens[b]:] for b in range(B)]).to(DEV))
        v_new.append(torch.cat([vs[b][prefix_lens[b]:] for b in range(B)]).to(DEV))
        q.append(torch.randn(sum(q_lens), cfg.num_heads, d, generator=g).to(q_dtype or dtype).to(DEV))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, q_lens)])
    b_of = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
    full_slots = full_pt[b_of, positions // page] * page + positions % page
    swa_slots = swa_pt[b_of, positions // page] * page + positions % page
    assert (full_slots >= 0).all() and (swa_slots >= 0).all()
    meta = AttentionMetadata(page, W, list(q_lens), list(prefix_lens), positions, full_slots, swa_slots,
                             full_pt, swa_pt).to(DEV)
    return Case(meta, pool, q, k_new, v_new, k_all, v_all)


def brute_force(case: Case, layer: int, window: int | None) -> torch.Tensor:
    """Dense float64 attention from the ground-truth K/V (no pool involved). [T, H, D]"""
    meta, outs = case.meta, []
    q_all = case.q[layer].double().cpu()
    for b, (p, n) in enumerate(zip(meta.prefix_lens, meta.q_lens)):
        q = q_all[meta.cu_q_lens[b]: meta.cu_q_lens[b] + n]  # [n, H, D]
        k = case.k_all[layer][b].double()  # [L, KVH, D]
        v = case.v_all[layer][b].double()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [L, H, D]
        s = torch.einsum("qhd,khd->hqk", q, k)  # scale 1.0
        qpos = torch.arange(p, p + n)[:, None]
        kpos = torch.arange(p + n)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int, what: str,
          tol_scale: float = 1.0) -> None:
    out = out.double().cpu()
    assert not out.isnan().any(), f"{what}: NaN in output (seed {seed})"
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    tol = TOL[dtype] * tol_scale
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol:.1e} (seed {seed})"


def run_layers(case: Case, backend, seed: int, dtype: torch.dtype, what: str, tol_scale: float = 1.0) -> None:
    for layer, window in ((SWA, case.meta.window), (FULL, None)):
        out = backend.forward(layer, case.q[layer], case.k_new[layer], case.v_new[layer], case.meta,
                              case.pool)
        check(out, brute_force(case, layer, window), dtype, seed, f"{what} layer {layer}", tol_scale)


def mixed_lens(rng: random.Random, n: int, max_prefix: int, max_q: int, decode_frac: float):
    q_lens, prefix_lens = [], []
    for _ in range(n):
        q_lens.append(1 if rng.random() < decode_frac else rng.randint(2, max_q))
        prefix_lens.append(rng.choice([0, rng.randint(0, max_prefix)]))
    return q_lens, prefix_lens


# (H, KVH swa, KVH full, D swa, D full): GQA 16/8 and 16/2 like Gemma 4, and 2/1 with D 64.
SHAPES = [(16, 8, 2, 16, 32), (2, 1, 1, 64, 32)]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_prefix_and_decode_mixed(page: int, dtype: torch.dtype) -> None:
    seed = new_seed()
    rng = random.Random(seed)
    h, kvh_s, kvh_f, d_s, d_f = SHAPES[rng.randrange(len(SHAPES))]
    cfg = make_cfg(h, kvh_s, kvh_f, d_s, d_f, window=rng.choice([5, 16, 23]))
    q_lens, prefix_lens = mixed_lens(rng, 4, max_prefix=50, max_q=40, decode_frac=0.4)
    case = make_case(seed, cfg, q_lens, prefix_lens, page, dtype)
    be = TritonAttentionBackend(block_m=16, block_n=16, decode_splits=rng.choice([None, 3]))
    run_layers(case, be, seed, dtype, f"mixed {q_lens=} {prefix_lens=} page={page} shape={h, kvh_s, kvh_f}")


@pytest.mark.parametrize("page", [1, 16])
def test_arena_layout(page: int) -> None:
    """The engine's arena layout: K and V of every layer are strided views into one buffer (row stride
    = the token record, 2 full pages per block here), prefill with a prefix and decodes mixed."""
    seed = new_seed()
    rng = random.Random(seed)
    cfg = make_cfg(16, 8, 2, 16, 32, window=rng.choice([5, 16]))
    assert arena_geometry(cfg)[0] == 2
    q_lens, prefix_lens = mixed_lens(rng, 4, max_prefix=50, max_q=30, decode_frac=0.4)
    case = make_case(seed, cfg, q_lens, prefix_lens, page, torch.float32, layout="arena")
    be = TritonAttentionBackend(block_m=16, block_n=16, decode_splits=rng.choice([None, 3]))
    run_layers(case, be, seed, torch.float32, f"arena {q_lens=} {prefix_lens=} page={page}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_split_k(dtype: torch.dtype) -> None:
    seed = new_seed()
    rng = random.Random(seed)
    cfg = make_cfg(16, 8, 2, 16, 32, window=rng.choice([7, 32]))
    prefix_lens = [rng.randint(0, 90) for _ in range(3)] + [0]
    case = make_case(seed, cfg, [1] * 4, prefix_lens, rng.choice([1, 4, 16]), dtype)
    for splits in (1, 5):
        be = TritonAttentionBackend(block_n=16, decode_splits=splits)
        run_layers(case, be, seed, dtype, f"decode {prefix_lens=} splits={splits}")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_default_blocks_fp32_query_half_kv(kv_dtype: torch.dtype) -> None:
    """Default block sizes (the GPU ones), a long prefill chunk crossing several windows, queries
    in another dtype than the pool (fp16 runs the GPU dot path: operands cast to the KV dtype)."""
    seed = new_seed()
    rng = random.Random(seed)
    cfg = make_cfg(4, 2, 1, 32, 64, window=24)
    case = make_case(seed, cfg, [rng.randint(70, 100), 1], [rng.randint(0, 20), 40], 16,
                     kv_dtype, q_dtype=torch.float32)
    # fp32 queries are rounded to the KV dtype for the dot (the reference keeps them in fp32)
    run_layers(case, TritonAttentionBackend(), seed, kv_dtype, "default blocks", tol_scale=3.0)


def test_poisoned_output_fully_written() -> None:
    seed = new_seed()
    cfg = make_cfg(4, 2, 2, 16, 16, window=8)
    case = make_case(seed, cfg, [17, 1, 3], [5, 30, 0], 4, torch.float32)
    be = TritonAttentionBackend(block_m=16, block_n=16)
    kc, vc = case.pool.kv(SWA)
    slots = case.meta.swa_slots
    kc[slots] = case.k_new[SWA].to(kc.dtype)
    vc[slots] = case.v_new[SWA].to(vc.dtype)
    out = torch.full_like(case.q[SWA], float("nan"))
    be.attend(case.q[SWA], kc, vc, case.meta.swa_page_table, case.meta, True, out=out)
    check(out, brute_force(case, SWA, case.meta.window), torch.float32, seed, "poisoned out")


@pytest.mark.skipif(importlib.util.find_spec("swaserve.engine.attention.torch_backend") is None,
                    reason="engine.attention.torch_backend not written yet")
def test_matches_torch_backend() -> None:
    from swaserve.engine.attention.torch_backend import TorchAttentionBackend

    seed = new_seed()
    rng = random.Random(seed)
    cfg = make_cfg(16, 8, 2, 16, 32, window=rng.choice([6, 19]))
    q_lens, prefix_lens = mixed_lens(rng, 3, max_prefix=40, max_q=30, decode_frac=0.3)
    page = rng.choice([1, 16])
    tri = make_case(seed, cfg, q_lens, prefix_lens, page, torch.float32)
    ref = make_case(seed, cfg, q_lens, prefix_lens, page, torch.float32)
    for pool in (ref.pool,):  # the torch backend may read whole pages: no NaN poison there
        for t in (pool.full_k, pool.full_v, pool.swa_k, pool.swa_v):
            t.nan_to_num_(0.0)
    be_t, be_r = TritonAttentionBackend(block_m=16, block_n=16), TorchAttentionBackend()
    for layer in (SWA, FULL):
        out_t = be_t.forward(layer, tri.q[layer], tri.k_new[layer], tri.v_new[layer], tri.meta, tri.pool)
        out_r = be_r.forward(layer, ref.q[layer], ref.k_new[layer], ref.v_new[layer], ref.meta, ref.pool)
        what = f"vs torch layer {layer} {q_lens=} {prefix_lens=}"
        check(out_t, out_r.double().cpu(), torch.float32, seed, what)


def test_rejects_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEV.type == "cuda":
        pytest.skip("CUDA present: the CPU guard does not apply")
    be = TritonAttentionBackend()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        TritonAttentionBackend()
    cfg = make_cfg(2, 1, 1, 16, 16, window=4)
    case = make_case(0, cfg, [2], [0], 1, torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        be.forward(SWA, case.q[SWA], case.k_new[SWA], case.v_new[SWA], case.meta, case.pool)


def test_real_head_dims_default_blocks() -> None:
    """Gemma 4's head dims (256 with GQA 16/8, 512 with 16/2) and the GPU block sizes, fp16 KV (the
    GPU dot path), a short mixed batch."""
    seed = new_seed()
    rng = random.Random(seed)
    cfg = make_cfg(16, 8, 2, 256, 512, window=rng.choice([9, 40]))
    q_lens, prefix_lens = [rng.randint(2, 24), 1, 1], [rng.randint(0, 30), rng.randint(0, 60), 0]
    case = make_case(seed, cfg, q_lens, prefix_lens, 16, torch.float16)
    be = TritonAttentionBackend(decode_splits=2)
    run_layers(case, be, seed, torch.float16, f"real dims {q_lens=} {prefix_lens=}")
