"""TorchAttentionBackend vs dense brute-force attention over random scattered page tables."""

from __future__ import annotations

import random

import pytest
import torch

import swaserve.engine.attention.torch_backend as tb
from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import ArenaKVPool, KVPool, arena_geometry
from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.config import ModelConfig

H = 4


def _cfg(window: int, kvh_swa: int = 2, kvh_full: int = 1, head_dim_full: int = 32) -> ModelConfig:
    return ModelConfig(
        vocab_size=16, hidden_size=32, num_layers=2, num_heads=H, layer_types=("sliding", "full"),
        head_dim_swa=16, head_dim_full=head_dim_full, num_kv_heads_swa=kvh_swa, num_kv_heads_full=kvh_full,
        sliding_window=window, intermediate_size=8, moe_intermediate_size=8, num_experts=2, top_k_experts=1,
    )


def _brute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
           window: int | None) -> torch.Tensor:
    """q [n, H, D] at positions prefix.., k/v [L, KVH, D] positions 0..L-1 -> [n, H, D] in float64."""
    n, nh, _ = q.shape
    G = nh // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        qi = prefix + i
        for h in range(nh):
            ks = k[:, h // G].double()  # [L, D]
            vs = v[:, h // G].double()
            s = ks @ q[i, h].double()  # [L]
            pos = torch.arange(k.shape[0])
            ok = pos <= qi
            if window is not None:
                ok &= pos > qi - window
            s = s.masked_fill(~ok, float("-inf"))
            out[i, h] = torch.softmax(s, 0) @ vs
    return out


def make_pool(cfg: ModelConfig, n_pages: int, P: int, kv_dtype: torch.dtype, layout: str,
              rng: random.Random) -> tuple[KVPool, list[int], list[int]]:
    """A pool with room for n_pages of each kind, and shuffled page ids of each kind to use (in an
    arena: SWA pages and full pages in disjoint blocks, full pages scattered over their blocks)."""
    if layout == "split":
        pool = KVPool(cfg, n_pages, n_pages, P, kv_dtype, torch.device("cpu"))
        ids_full, ids_swa = list(range(n_pages)), list(range(n_pages))
    else:
        k = arena_geometry(cfg)[0]
        blocks = list(range(n_pages + -(-n_pages // k) + 2))
        pool = ArenaKVPool(cfg, len(blocks), P, kv_dtype, torch.device("cpu"))
        rng.shuffle(blocks)
        ids_swa = blocks[:n_pages]
        ids_full = [b * k + j for b in blocks[n_pages:] for j in range(k)]
    rng.shuffle(ids_full)
    rng.shuffle(ids_swa)
    for t in pool.tensors():
        t.normal_()  # garbage everywhere: reading a wrong slot shows up
    return pool, ids_full, ids_swa


def _run_case(page_size: int, window: int, prefixes: list[int], q_lens: list[int], seed: int,
              kv_dtype: torch.dtype = torch.float32, tol: float = 1e-5,
              be: TorchAttentionBackend | None = None, layout: str = "split", kvh_swa: int = 2,
              head_dim_full: int = 32) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cfg = _cfg(window, kvh_swa=kvh_swa, head_dim_full=head_dim_full)
    P = page_size
    seq_lens = [p + q for p, q in zip(prefixes, q_lens)]
    max_pages = max((s + P - 1) // P for s in seq_lens)
    n_pages = sum((s + P - 1) // P for s in seq_lens) + 3
    pool, ids_full, ids_swa = make_pool(cfg, n_pages, P, kv_dtype, layout, rng)
    full_pt = torch.full((len(prefixes), max_pages), -1, dtype=torch.int64)
    swa_pt = torch.full((len(prefixes), max_pages), -1, dtype=torch.int64)
    dense: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    full_slots, swa_slots, qs = [], [], {}
    for b, (p, n) in enumerate(zip(prefixes, q_lens)):
        L = p + n
        npg = (L + P - 1) // P
        full_pt[b, :npg] = torch.tensor([ids_full.pop() for _ in range(npg)])
        swa_first = max(0, p - window + 1) // P
        swa_pt[b, swa_first:npg] = torch.tensor([ids_swa.pop() for _ in range(npg - swa_first)])
        pos = torch.arange(p, L)
        full_slots.append(full_pt[b, pos // P] * P + pos % P)
        swa_slots.append(swa_pt[b, pos // P] * P + pos % P)
        for kind, layer, pt in (("sliding", 0, swa_pt), ("full", 1, full_pt)):
            K, V = pool.kv(layer)
            kvh, d = K.shape[1], K.shape[2]
            kd = torch.randn(L, kvh, d).to(kv_dtype)
            vd = torch.randn(L, kvh, d).to(kv_dtype)
            lo = max(0, p - window + 1) if kind == "sliding" else 0
            prev = torch.arange(lo, p)
            K[pt[b, prev // P] * P + prev % P] = kd[lo:p]  # the cached prefix
            V[pt[b, prev // P] * P + prev % P] = vd[lo:p]
            dense[(kind, b)] = (kd.float(), vd.float())
            qs[(kind, b)] = torch.randn(n, H, d)
    meta = AttentionMetadata(
        page_size=P, window=window, q_lens=q_lens, prefix_lens=prefixes,
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, q_lens)]),
        full_slots=torch.cat(full_slots), swa_slots=torch.cat(swa_slots),
        full_page_table=full_pt, swa_page_table=swa_pt,
    )
    be = be or TorchAttentionBackend()
    for kind, layer in (("sliding", 0), ("full", 1)):
        B = len(prefixes)
        q = torch.cat([qs[(kind, b)] for b in range(B)])
        k = torch.cat([dense[(kind, b)][0][prefixes[b]:] for b in range(B)])
        v = torch.cat([dense[(kind, b)][1][prefixes[b]:] for b in range(B)])
        out = be.forward(layer, q, k, v, meta, pool)
        row = 0
        for b in range(B):
            n = q_lens[b]
            kd, vd = dense[(kind, b)]
            ref = _brute(qs[(kind, b)], kd, vd, prefixes[b], window if kind == "sliding" else None)
            err = (out[row:row + n].double() - ref).abs().max().item()
            assert err < tol, (kind, b, err)
            row += n


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", ["split", "arena"])
def test_mixed_batch_prefill_and_decode(page_size: int, layout: str) -> None:
    # decodes beyond and within the window, prefills with and without cached prefix, one
    # prefill longer than the window, one chunk starting mid-page; in an arena (2 full pages per
    # block here) every layer's K and V are strided views into one buffer
    prefixes = [0, 13, 37, 5, 0, 50, 21, 1]
    q_lens = [9, 1, 1, 20, 1, 31, 1, 7]
    _run_case(page_size, window=8, prefixes=prefixes, q_lens=q_lens, seed=page_size, layout=layout,
              kvh_swa=4 if layout == "arena" else 2)


def test_arena_layout_bf16_and_padding() -> None:
    # bf16, and a geometry where the SWA record is not a multiple of the full one (padded full records)
    _run_case(4, window=6, prefixes=[9, 0, 30], q_lens=[1, 11, 1], seed=4, kv_dtype=torch.bfloat16, tol=1e-4,
              layout="arena", kvh_swa=4, head_dim_full=48)
    # SWA 2 x 4 x 16 = 128 elements a token, full 2 x 1 x 48 = 96: one full page a block, padded to 128
    assert arena_geometry(_cfg(6, kvh_swa=4, head_dim_full=48)) == (1, 128, 128)
    assert arena_geometry(_cfg(6, kvh_swa=4, head_dim_full=24)) == (2, 64, 128)


@pytest.mark.parametrize("window", [1, 3, 16, 64])
def test_windows(window: int) -> None:
    _run_case(4, window=window, prefixes=[0, 30, 17, 2], q_lens=[25, 1, 12, 1], seed=window)


def test_single_decode_and_single_prefill() -> None:
    _run_case(16, window=8, prefixes=[40], q_lens=[1], seed=1)
    _run_case(16, window=8, prefixes=[0], q_lens=[40], seed=2)


def test_bf16_pool() -> None:
    _run_case(4, window=6, prefixes=[9, 0], q_lens=[1, 11], seed=3, kv_dtype=torch.bfloat16, tol=1e-4)


def test_gqa_mha_and_mqa_layouts() -> None:
    # KVH == H (no grouping) on sliding, KVH 1 on full
    cfg = _cfg(4, kvh_swa=H, kvh_full=1)
    pool = KVPool(cfg, 4, 4, 4, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    n = 6
    meta = AttentionMetadata(4, 4, [n], [0], torch.arange(n), torch.arange(n), torch.arange(n),
                             torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))
    be = TorchAttentionBackend()
    for layer, kvh, d, win in ((0, H, 16, 4), (1, 1, 32, None)):
        q, k, v = torch.randn(n, H, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
        out = be.forward(layer, q, k, v, meta, pool)
        ref = _brute(q, k, v, 0, win)
        assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [5, 20])
def test_blocked_prefill_small_blocks(page_size: int, window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # blocks of 8 query rows: windows smaller and larger than a block, prefills spanning several
    # blocks with and without a cached prefix (chunks starting mid-block and mid-page), decodes mixed in
    monkeypatch.setattr(tb, "QUERY_BLOCK", 8)
    prefixes = [0, 19, 5, 40, 3, 0]
    q_lens = [37, 30, 1, 25, 8, 9]
    _run_case(page_size, window=window, prefixes=prefixes, q_lens=q_lens, seed=100 + page_size + window)


@pytest.mark.parametrize("window", [64, 300])
def test_blocked_prefill_default_block(window: int) -> None:
    # default block size: a 600-token chunk after a 70-token cached prefix spans three blocks
    assert tb.QUERY_BLOCK < 600 // 2
    _run_case(16, window=window, prefixes=[70, 0], q_lens=[600, 1], seed=window)


def test_backend_reused_across_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # one backend (reused gather buffers) over batches that grow, shrink and change dtype
    monkeypatch.setattr(tb, "QUERY_BLOCK", 8)
    be = TorchAttentionBackend()
    _run_case(4, window=6, prefixes=[30, 0, 12], q_lens=[20, 33, 1], seed=7, be=be)
    _run_case(4, window=6, prefixes=[3], q_lens=[1], seed=8, be=be)
    _run_case(4, window=6, prefixes=[9, 0], q_lens=[1, 11], seed=9, kv_dtype=torch.bfloat16, tol=1e-4, be=be)
    _run_case(1, window=6, prefixes=[50, 2, 0], q_lens=[17, 1, 40], seed=10, be=be)
