"""GPU check of the Triton kernels at gemma-4-26B-A4B shapes: correctness vs torch, speed vs torch and
vs the measured memory-bandwidth (copy) and bf16 matmul ceilings, plus an end-to-end decode rate.

    python -m tools.gpu_check [--quick] [--budget-s 480] [--out table.md]

Every check runs in try/except (a failure prints FAIL and the error, the rest go on); checks
past the time budget print SKIP. Exit status: 0 if nothing failed, 1 otherwise. Without CUDA it
prints a message and exits 0; `--cpu-smoke` runs the same checks at tiny shapes in the Triton CPU
interpreter (what CI uses to keep this script working).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REAL = SimpleNamespace(
    num_heads=16,
    kv_heads=(8, 2),
    head_dims=(256, 512),
    window=1024,
    page_size=16,
    prefill=8192,
    context=8192,
    batches=(1, 8, 32),
    hidden=2816,
    intermediate=2112,
    experts=128,
    top_k=8,
    expert_intermediate=704,
    moe_tokens=(1, 8, 32, 2048),
    gemm_rows=2048,
    # (name, N, K): attention projections (sliding / full), dense MLP, tied lm_head
    projections=[
        ("q swa", 4096, 2816),
        ("k swa", 2048, 2816),
        ("o swa", 2816, 4096),
        ("q full", 8192, 2816),
        ("k full", 1024, 2816),
        ("o full", 2816, 8192),
        ("gate/up", 2112, 2816),
        ("down", 2816, 2112),
        ("lm_head", 262144, 2816),
    ],
    # the other block types (tools/gpu_check_quant.py): (name, N, K) with K whole 256-weight blocks,
    # and the MoE shape (experts, hidden, expert intermediate)
    quant_projections=[("q swa", 4096, 2816), ("o swa", 2816, 4096), ("gate/up", 2112, 2816)],
    quant_moe=(128, 2816, 704),
    preset="26b-a4b",
    e2e_prompt=1024,
    e2e_batches=(1, 8),
    e2e_steps=32,
)
TINY = SimpleNamespace(
    num_heads=4,
    kv_heads=(2, 1),
    head_dims=(32, 64),
    window=16,
    page_size=4,
    prefill=70,
    context=50,
    batches=(1, 3),
    hidden=64,
    intermediate=64,
    experts=8,
    top_k=2,
    expert_intermediate=32,
    moe_tokens=(1, 9),
    gemm_rows=40,
    projections=[("q", 96, 64), ("o", 64, 96)],
    quant_projections=[("q", 96, 256)],
    quant_moe=(4, 256, 32),
    preset="tiny",
    e2e_prompt=12,
    e2e_batches=(2,),
    e2e_steps=3,
)


@dataclass
class Row:
    check: str
    shape: str
    status: str  # ok / FAIL / SKIP / info
    err: float | None = None
    ms: float | None = None
    ref_ms: float | None = None
    rate: str = ""
    note: str = ""


class Ctx:
    def __init__(self, dev: Any, quick: bool, budget_s: float, check_timeout: float):
        import torch

        self.torch = torch
        self.dev = dev
        self.cuda = dev.type == "cuda"
        self.quick = quick
        self.deadline = time.monotonic() + budget_s
        self.check_timeout = check_timeout
        self.copy_bw = 0.0  # bytes/s, measured
        self.mm_flops = 0.0  # flop/s, measured bf16 matmul
        self.gen = torch.Generator(device=dev).manual_seed(int(time.time()))
        self.shapes: Any = None  # REAL or TINY, for the checks of tools/gpu_check_quant.py

    def time_ms(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=5 if self.quick else 20, rep=20 if self.quick else 100))
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def bw(self, nbytes: float, ms: float) -> str:
        r = nbytes / (ms * 1e-3)
        pct = f" ({100 * r / self.copy_bw:.0f}% of copy)" if self.copy_bw else ""
        return f"{r / 1e9:.0f} GB/s{pct}"

    def flops(self, n: float, ms: float) -> str:
        r = n / (ms * 1e-3)
        pct = f" ({100 * r / self.mm_flops:.0f}% of mm)" if self.mm_flops else ""
        return f"{r / 1e12:.1f} TFLOP/s{pct}"


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def status(err: float, tol: float, y) -> str:
    return "ok" if err <= tol and not y.isnan().any() else "FAIL"


# ---- ceilings ---------------------------------------------------------------------------------


def check_ceilings(c: Ctx, S) -> list[Row]:
    torch = c.torch
    n = (1 << 28) if c.cuda else (1 << 22)  # 1 GiB of fp32 on a GPU
    a = torch.empty(n, dtype=torch.float32, device=c.dev)
    b = torch.empty_like(a)
    ms = c.time_ms(lambda: b.copy_(a))
    c.copy_bw = 2 * a.nbytes / (ms * 1e-3)
    m = 8192 if c.cuda else 256
    x = torch.randn(m, m, device=c.dev, dtype=torch.bfloat16, generator=c.gen)
    ms2 = c.time_ms(lambda: x @ x)
    c.mm_flops = 2 * m**3 / (ms2 * 1e-3)
    return [
        Row("ceiling: copy", f"{a.nbytes >> 20} MiB", "info", ms=ms, rate=f"{c.copy_bw / 1e9:.0f} GB/s"),
        Row("ceiling: bf16 mm", f"{m}^3", "info", ms=ms2, rate=f"{c.mm_flops / 1e12:.0f} TFLOP/s"),
    ]


# ---- attention ----------------------------------------------------------------------------------


def _attn_setup(c: Ctx, S, q_lens: list[int], prefix_lens: list[int]):
    """A KVPool of one sliding and one full layer at S's shapes, random K/V everywhere, shuffled pages."""
    torch = c.torch
    from swaserve.engine.attention.base import AttentionMetadata
    from swaserve.engine.attention.kv_pool import KVPool

    cfg = _shape_cfg(S, ("sliding", "full"))
    P = S.page_size
    seq = [p + q for p, q in zip(prefix_lens, q_lens)]
    npg = [-(-s // P) for s in seq]
    total = sum(npg) + 4
    pool = KVPool(cfg, total, total, P, torch.bfloat16, c.dev)
    for t in (pool.swa_k, pool.swa_v, pool.full_k, pool.full_v):
        t.normal_(0.0, t.shape[-1] ** -0.25, generator=c.gen)  # q.k ~ N(0, 1) at scale 1.0
    perm = torch.randperm(total, device="cpu")
    pt = torch.full((len(seq), max(npg)), -1, dtype=torch.int64)
    o = 0
    for b, n in enumerate(npg):
        pt[b, :n] = perm[o : o + n]
        o += n
    pos = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix_lens, q_lens)])
    bof = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(q_lens))
    slots = pt[bof, pos // P] * P + pos % P
    meta = AttentionMetadata(P, S.window, q_lens, prefix_lens, pos, slots, slots, pt, pt).to(c.dev)
    return cfg, pool, meta


def _attn_rows(c: Ctx, S, name: str, q_lens: list[int], prefix_lens: list[int]) -> list[Row]:
    torch = c.torch
    from swaserve.engine.attention.torch_backend import TorchAttentionBackend
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend

    cfg, pool, meta = _attn_setup(c, S, q_lens, prefix_lens)
    tri, ref = TritonAttentionBackend(), TorchAttentionBackend()
    T = sum(q_lens)
    rows = []
    for layer, kind in ((0, "sliding"), (1, "full")):
        kvh, D = S.kv_heads[layer], S.head_dims[layer]
        q = torch.randn(T, S.num_heads, D, device=c.dev, dtype=torch.bfloat16, generator=c.gen) * D**-0.25
        k = torch.randn(T, kvh, D, device=c.dev, dtype=torch.bfloat16, generator=c.gen) * D**-0.25
        v = torch.randn(T, kvh, D, device=c.dev, dtype=torch.bfloat16, generator=c.gen)
        y = tri.forward(layer, q, k, v, meta, pool)
        r = ref.forward(layer, q, k, v, meta, pool)
        err = rel_err(y, r)
        kc, vc = pool.kv(layer)
        pt = meta.swa_page_table if kind == "sliding" else meta.full_page_table
        sliding = kind == "sliding"
        ms = c.time_ms(lambda q=q, kc=kc, vc=vc, pt=pt, sl=sliding: tri.attend(q, kc, vc, pt, meta, sl))
        ref_ms = c.time_ms(lambda li=layer, q=q, k=k, v=v: ref.forward(li, q, k, v, meta, pool))
        W = S.window if kind == "sliding" else 10**12
        if all(n == 1 for n in q_lens):  # decode: each visible K and V row (bf16) is read once
            rate = c.bw(sum(min(p + 1, W) for p in prefix_lens) * kvh * D * 2 * 2, ms)
        else:  # prefill: 4 * D flops per (query head, visible key) pair
            pairs = sum(min(p + i + 1, W) for p, n in zip(prefix_lens, q_lens) for i in range(n))
            rate = c.flops(4 * S.num_heads * D * pairs, ms)
        rows.append(
            Row(
                f"attn {name} {kind}",
                f"H{S.num_heads}/KVH{kvh} D{D} T{T}",
                status(err, 3e-2, y),
                err,
                ms,
                ref_ms,
                rate,
                "torch = gather + SDPA",
            )
        )
    return rows


def check_attn_prefill(c: Ctx, S) -> list[Row]:
    return _attn_rows(c, S, f"prefill {S.prefill}", [S.prefill], [0])


def check_attn_prefill_prefix(c: Ctx, S) -> list[Row]:
    half = S.prefill // 2
    return _attn_rows(c, S, f"prefill {half}+{half} cached", [half], [half])


def check_attn_decode(c: Ctx, S, B: int) -> list[Row]:
    return _attn_rows(c, S, f"decode {B}x{S.context}", [1] * B, [S.context - 1] * B)


# ---- Q4_0 linear --------------------------------------------------------------------------------


def rand_q4(c: Ctx, shape: tuple[int, ...]):
    """Random Q4_0 stored weight on the device; weights of std ~ 1/sqrt(K)."""
    torch = c.torch
    from swaserve.engine.quant.base import QWeight

    *lead, n, k = shape
    nb = k // 32
    d = torch.full((*lead, n, nb, 1), 1.0 / (4.6 * math.sqrt(k)), device=c.dev)
    d = (d * (0.5 + torch.rand(d.shape, device=c.dev, generator=c.gen))).half().view(torch.uint8)
    qs = torch.randint(0, 256, (*lead, n, nb, 16), device=c.dev, dtype=torch.uint8, generator=c.gen)
    return QWeight("Q4_0", tuple(shape), torch.cat([d, qs], -1).reshape(*lead, n, nb * 18), "rand")


def check_q4(c: Ctx, S, name: str, N: int, K: int, M: int) -> list[Row]:
    torch = c.torch
    import torch.nn.functional as F

    from swaserve.engine.quant.dequant import dequantize
    from swaserve.engine.quant.triton_q4 import q4_0_linear

    w = rand_q4(c, (N, K))
    wd = dequantize(w)  # [N, K] fp32
    x = torch.randn(M, K, device=c.dev, dtype=torch.bfloat16, generator=c.gen)
    y = q4_0_linear(x, w)
    err = rel_err(y, x.float() @ wd.T)
    wb = wd.to(torch.bfloat16)
    del wd
    ms = c.time_ms(lambda: q4_0_linear(x, w))
    ref_ms = c.time_ms(lambda: F.linear(x, wb))
    nbytes = w.data.nbytes + x.nbytes + M * N * 2
    rate = c.bw(nbytes, ms) if M <= 64 else c.flops(2 * M * N * K, ms)
    kind = "GEMV" if M <= 4 else "GEMM"
    return [
        Row(
            f"q4_0 {kind} {name}",
            f"M{M} N{N} K{K}",
            status(err, 2e-2, y),
            err,
            ms,
            ref_ms,
            rate,
            "torch = bf16 mm on dequantized W",
        )
    ]


# ---- MoE ----------------------------------------------------------------------------------------


def _moe_layers(c: Ctx, S, n: int):
    from swaserve.engine.moe.base import ExpertWeights

    return [
        ExpertWeights(
            gate_up=rand_q4(c, (S.experts, 2 * S.expert_intermediate, S.hidden)),
            down=rand_q4(c, (S.experts, S.hidden, S.expert_intermediate)),
        )
        for _ in range(n)
    ]


def _shape_cfg(S, layer_types: tuple[str, ...]):
    """A ModelConfig with S's attention and MoE shapes and the given layers."""
    from swaserve.engine.config import ModelConfig

    return ModelConfig(
        vocab_size=32,
        hidden_size=S.hidden,
        num_layers=len(layer_types),
        num_heads=S.num_heads,
        layer_types=layer_types,
        head_dim_swa=S.head_dims[0],
        head_dim_full=S.head_dims[1],
        num_kv_heads_swa=S.kv_heads[0],
        num_kv_heads_full=S.kv_heads[1],
        sliding_window=S.window,
        intermediate_size=S.intermediate,
        moe_intermediate_size=S.expert_intermediate,
        num_experts=S.experts,
        top_k_experts=S.top_k,
    )


def _moe_cfg(S, layers: int):
    return _shape_cfg(S, ("full",) * layers)


def _routing(c: Ctx, S, T: int):
    torch = c.torch
    scores = torch.rand(T, S.experts, device=c.dev, generator=c.gen)
    w, ids = torch.topk(scores, S.top_k, dim=-1)  # distinct experts per token
    return ids, (w / w.sum(-1, keepdim=True)).float()


def _moe_ref(x, gu, dn, ids, w, inter: int):
    """bf16 torch loop over the used experts on dequantized weights ([E, 2I, H], [E, H, I] bf16)."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[tok], gu[e])
        h = F.gelu(h[:, :inter], approximate="tanh") * h[:, inter:]
        out.index_add_(0, tok, F.linear(h, dn[e]).float() * w[tok, slot, None])
    return out.to(x.dtype)


def check_moe(c: Ctx, S, T: int, state: dict) -> list[Row]:
    torch = c.torch
    from swaserve.engine.moe.triton_backend import TritonMoE
    from swaserve.engine.quant.dequant import dequantize

    if "moe" not in state:
        layers = _moe_layers(c, S, 1)
        state["moe"] = (
            layers,
            dequantize(layers[0].gate_up).to(torch.bfloat16),
            dequantize(layers[0].down).to(torch.bfloat16),
        )
    layers, gu, dn = state["moe"]
    moe = TritonMoE(_moe_cfg(S, 1), layers, c.dev)
    x = torch.randn(T, S.hidden, device=c.dev, dtype=torch.bfloat16, generator=c.gen)
    ids, w = _routing(c, S, T)
    y = moe.forward(0, x, ids, w)
    err = rel_err(y, _moe_ref(x, gu, dn, ids, w, S.expert_intermediate))
    ms = c.time_ms(lambda: moe.forward(0, x, ids, w))
    ref_ms = c.time_ms(lambda: _moe_ref(x, gu, dn, ids, w, S.expert_intermediate))
    per_expert = layers[0].gate_up.data[0].nbytes + layers[0].down.data[0].nbytes
    used = int(torch.unique(ids).numel())
    rate = (
        c.bw(used * per_expert + 2 * x.nbytes, ms)
        if T <= 64
        else c.flops(2 * T * S.top_k * 3 * S.expert_intermediate * S.hidden, ms)
    )
    return [
        Row(
            f"moe fused T={T}",
            f"E{S.experts} top{S.top_k} H{S.hidden} I{S.expert_intermediate}",
            status(err, 3e-2, y),
            err,
            ms,
            ref_ms,
            rate,
            f"{used} experts used",
        )
    ]


def check_offload(c: Ctx, S, state: dict) -> list[Row]:
    torch = c.torch
    from swaserve.engine.moe.offload_backend import OffloadMoE
    from swaserve.engine.moe.triton_backend import TritonMoE

    layers = _moe_layers(c, S, 2)
    cfg = _moe_cfg(S, 2)
    resident = TritonMoE(cfg, layers, c.dev)
    off = OffloadMoE(
        cfg,
        layers,
        c.dev,
        cache_size=S.top_k * 4,
        emulate_device=not c.cuda,
        stream_min_tokens=64 if c.cuda else 8,
    )
    rows = []
    for name, T in (("decode (cache)", 1), ("prefill (stream)", 512 if c.cuda else 9)):
        x = torch.randn(T, S.hidden, device=c.dev, dtype=torch.bfloat16, generator=c.gen)
        errs, tms = [], []
        for _ in range(3):
            ids, w = _routing(c, S, T)
            for li in (0, 1):
                t0 = time.perf_counter()
                y = off.forward(li, x, ids, w)
                if c.cuda:
                    torch.cuda.synchronize()
                tms.append((time.perf_counter() - t0) * 1e3)
                errs.append(rel_err(y, resident.forward(li, x, ids, w)))
        ms_hit = None
        if T == 1:  # the same routing again: all hits
            ms_hit = c.time_ms(lambda x=x, ids=ids, w=w: off.forward(1, x, ids, w))
        err = max(errs)
        rows.append(
            Row(
                f"offload {name}",
                f"T{T}, 2 layers",
                "ok" if err <= 1e-2 else "FAIL",
                err,
                sum(tms) / len(tms),
                ms_hit,
                "",
                f"mean ms/layer incl. misses; ref_ms = all hits; stats {off.stats}",
            )
        )
    return rows


# ---- end to end ---------------------------------------------------------------------------------


def check_e2e(c: Ctx, S, B: int) -> list[Row]:
    torch = c.torch
    from swaserve.engine.attention.base import AttentionMetadata
    from swaserve.engine.attention.kv_pool import KVPool
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend
    from swaserve.engine.moe.triton_backend import TritonMoE
    from swaserve.models.gemma4 import Gemma4Model

    cfg = _e2e_config(S)
    weights = _random_weights(c, cfg)
    model = Gemma4Model(
        cfg,
        weights,
        TritonAttentionBackend(),
        TritonMoE(cfg, weights.experts, c.dev),
        c.dev,
        dtype=torch.bfloat16,
    )
    P, L0, steps = S.page_size, S.e2e_prompt, S.e2e_steps
    per_seq = -(-(L0 + steps + 1) // P)
    pool = KVPool(cfg, B * per_seq, B * per_seq, P, torch.bfloat16, c.dev)
    pt = torch.arange(B * per_seq).view(B, per_seq)  # sequence b owns pages [b * per_seq, ...)

    def meta_for(q_lens: list[int], prefix: list[int]) -> AttentionMetadata:
        pos = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix, q_lens)])
        bof = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
        slots = pt[bof, pos // P] * P + pos % P
        return AttentionMetadata(P, cfg.sliding_window, q_lens, prefix, pos, slots, slots, pt, pt).to(c.dev)

    ids = torch.randint(0, cfg.vocab_size, (B * L0,), device=c.dev, generator=c.gen)
    h = model.forward(ids, meta_for([L0] * B, [0] * B), pool)
    nxt = model.logits(h[torch.arange(1, B + 1, device=c.dev) * L0 - 1]).argmax(-1)  # [B]
    if c.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        h = model.forward(nxt, meta_for([1] * B, [L0 + s] * B), pool)
        nxt = model.logits(h).argmax(-1)
    if c.cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    finite = bool(torch.isfinite(h).all())
    err = _e2e_vs_torch(c, S, cfg, weights, model, ids[: min(64, L0)])
    return [
        Row(
            f"e2e decode B={B}",
            f"{S.preset} ctx {L0}",
            "ok" if finite and err <= 0.1 else "FAIL",
            err,
            dt / steps * 1e3,
            None,
            f"{B * steps / dt:.1f} tok/s",
            "ms = per decode step; random Q4_0; err = last-token logits vs torch backends",
        )
    ]


def _e2e_vs_torch(c: Ctx, S, cfg, weights, model, ids) -> float:
    """Relative max error of a prompt's last-token logits: triton backends vs torch backends."""
    torch = c.torch
    from swaserve.engine.attention.base import AttentionMetadata
    from swaserve.engine.attention.kv_pool import KVPool
    from swaserve.engine.attention.torch_backend import TorchAttentionBackend
    from swaserve.engine.moe.torch_backend import TorchMoE
    from swaserve.models.gemma4 import Gemma4Model

    ref = Gemma4Model(cfg, weights, TorchAttentionBackend(), TorchMoE(cfg, weights.experts, c.dev), c.dev,
                      dtype=torch.bfloat16)
    n, P = ids.numel(), S.page_size
    pages = -(-n // P)
    pt = torch.arange(pages).view(1, pages)
    pos = torch.arange(n)
    slots = pt[0, pos // P] * P + pos % P
    meta = AttentionMetadata(P, cfg.sliding_window, [n], [0], pos, slots, slots, pt, pt).to(c.dev)

    def last_logits(m) -> Any:
        pool = KVPool(cfg, pages, pages, P, torch.bfloat16, c.dev)
        return m.logits(m.forward(ids, meta, pool)[-1:])

    return rel_err(last_logits(model), last_logits(ref))


def _e2e_config(S):
    try:
        from swaserve.models.tiny import preset_config

        return preset_config(S.preset, vocab_size=None if S.preset != "tiny" else 256)
    except ImportError:  # models.tiny needs gguf; the shapes are the same either way
        from swaserve.engine.config import ModelConfig

        return ModelConfig(
            vocab_size=262144,
            hidden_size=2816,
            num_layers=30,
            num_heads=16,
            layer_types=(("sliding",) * 5 + ("full",)) * 5,
            head_dim_swa=256,
            head_dim_full=512,
            num_kv_heads_swa=8,
            num_kv_heads_full=2,
            sliding_window=1024,
            intermediate_size=2112,
            moe_intermediate_size=704,
            num_experts=128,
            top_k_experts=8,
        )


def _random_weights(c: Ctx, cfg):
    """Random Gemma 4 weights in stored form, generated on the device (no GGUF)."""
    torch = c.torch
    from swaserve.engine.moe.base import ExpertWeights
    from swaserve.models.weights import Gemma4Weights, LayerWeights

    H = cfg.hidden_size

    def vec(n: int, base: float = 1.0):
        return base * (0.8 + 0.4 * torch.rand(n, device=c.dev, generator=c.gen))

    layers = []
    for kind in cfg.layer_types:
        D = cfg.head_dim_swa if kind == "sliding" else cfg.head_dim_full
        kvh = cfg.num_kv_heads_swa if kind == "sliding" else cfg.num_kv_heads_full
        E, Ie, Id = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
        layers.append(
            LayerWeights(
                attn_norm=vec(H),
                q_proj=rand_q4(c, (cfg.num_heads * D, H)),
                k_proj=rand_q4(c, (kvh * D, H)),
                v_proj=rand_q4(c, (kvh * D, H)) if kind == "sliding" else None,
                o_proj=rand_q4(c, (H, cfg.num_heads * D)),
                q_norm=vec(D, D**-0.25),
                k_norm=vec(D, D**-0.25),
                post_attention_norm=vec(H),
                ffn_norm=vec(H),
                gate_proj=rand_q4(c, (Id, H)),
                up_proj=rand_q4(c, (Id, H)),
                down_proj=rand_q4(c, (H, Id)),
                post_ffw_norm_1=vec(H),
                router=torch.randn(E, H, device=c.dev, generator=c.gen),
                router_scale=vec(H),
                pre_ffw_norm_2=vec(H),
                experts=ExpertWeights(gate_up=rand_q4(c, (E, 2 * Ie, H)), down=rand_q4(c, (E, H, Ie))),
                per_expert_scale=vec(E),
                post_ffw_norm_2=vec(H),
                post_ffw_norm=vec(H),
                layer_scalar=torch.ones(1, device=c.dev),
            )
        )
    return Gemma4Weights(embed=rand_q4(c, (cfg.vocab_size, H)), final_norm=vec(H), layers=layers)


# ---- driver -------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout("check timed out (--check-timeout)")


def _plan(c: Ctx, S) -> list[tuple[str, Any]]:
    state: dict = {}
    plan: list[tuple[str, Any]] = [
        ("ceilings", lambda: check_ceilings(c, S)),
        ("attn prefill", lambda: check_attn_prefill(c, S)),
        ("attn prefill prefix", lambda: check_attn_prefill_prefix(c, S)),
    ]
    for B in S.batches:
        plan.append((f"attn decode B={B}", lambda B=B: check_attn_decode(c, S, B)))
    proj = S.projections[:3] + S.projections[-1:] if c.quick else S.projections
    for name, N, K in proj:
        for M in (1, 8) if c.quick else (1, 4, 8, 32):
            plan.append((f"q4 {name} M={M}", lambda n=name, N=N, K=K, M=M: check_q4(c, S, n, N, K, M)))
    for name, N, K in S.projections[:2] + S.projections[6:8]:
        rows = S.gemm_rows
        plan.append((f"q4 {name} M={rows}", lambda n=name, N=N, K=K, M=rows: check_q4(c, S, n, N, K, M)))
    for T in S.moe_tokens:
        plan.append((f"moe T={T}", lambda T=T: check_moe(c, S, T, state)))
    plan.append(("offload", lambda: check_offload(c, S, state)))
    for B in S.e2e_batches[:1] if c.quick else S.e2e_batches:
        plan.append((f"e2e B={B}", lambda B=B: check_e2e(c, S, B)))
    return plan + _quant_plan(c, S)


def _quant_plan(c: Ctx, S) -> list[tuple[str, Any]]:
    """The rows of the other GGUF block types (tools/gpu_check_quant.py), after everything else."""
    from tools import gpu_check_quant

    def shape_cfg(S, layer_types, experts: int, hidden: int, inter: int):
        return _shape_cfg(SimpleNamespace(**{**vars(S), "experts": experts, "hidden": hidden,
                                             "expert_intermediate": inter}), layer_types)

    c.shapes = S
    helpers = SimpleNamespace(Row=Row, rel_err=rel_err, status=status, moe_ref=_moe_ref, shape_cfg=shape_cfg)
    return gpu_check_quant.plan(c, helpers)


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(rows: list[Row]) -> str:
    head = ["check", "shape", "status", "max rel err", "triton ms", "torch ms", "speedup", "rate", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sp = f"{r.ref_ms / r.ms:.2f}x" if r.ms and r.ref_ms else ""
        lines.append(
            "| "
            + " | ".join(
                [
                    r.check,
                    r.shape,
                    r.status,
                    _fmt(r.err, ".1e"),
                    _fmt(r.ms, ".3f"),
                    _fmt(r.ref_ms, ".3f"),
                    sp,
                    r.rate,
                    r.note,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--budget-s", type=float, default=480.0, help="total time budget; later checks SKIP")
    p.add_argument("--check-timeout", type=float, default=150.0, help="seconds per check before it FAILs")
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU in the Triton interpreter")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing was run. "
            "The kernels are tested on CPU by pytest under TRITON_INTERPRET=1; --cpu-smoke runs this "
            "script's checks at tiny shapes in the interpreter."
        )
        return 0
    dev = torch.device("cuda" if not args.cpu_smoke else "cpu")
    c = Ctx(dev, args.quick or args.cpu_smoke, args.budget_s, args.check_timeout)
    S = TINY if args.cpu_smoke else REAL
    if c.cuda:
        print(f"gpu_check on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    rows: list[Row] = []
    use_alarm = hasattr(signal, "SIGALRM")
    if use_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
    for name, fn in _plan(c, S):
        if time.monotonic() > c.deadline:
            rows.append(Row(name, "", "SKIP", note="time budget spent"))
            continue
        t0 = time.monotonic()
        try:
            if use_alarm:
                signal.alarm(max(1, int(min(c.check_timeout, c.deadline - t0 + 5))))
            new = fn()
        except Exception as e:  # one check's failure must not stop the others
            traceback.print_exc()
            msg = str(e).splitlines()[0][:150] if str(e) else ""
            new = [Row(name, "", "FAIL", note=f"{type(e).__name__}: {msg}")]
        finally:
            if use_alarm:
                signal.alarm(0)
            if c.cuda:
                torch.cuda.empty_cache()
        for r in new:
            print(
                f"{r.status:5s} {r.check:34s} {r.shape:28s} err={_fmt(r.err, '.1e'):8s} "
                f"ms={_fmt(r.ms, '.3f'):9s} torch={_fmt(r.ref_ms, '.3f'):9s} {r.rate} "
                f"[{time.monotonic() - t0:.1f}s]",
                flush=True,
            )
        rows.extend(new)
    out = table(rows)
    print("\n" + out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(out + "\n")
    failed = [r.check for r in rows if r.status == "FAIL"]
    print(f"\n{len(rows)} rows, {len(failed)} FAIL, {sum(r.status == 'SKIP' for r in rows)} SKIP")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
