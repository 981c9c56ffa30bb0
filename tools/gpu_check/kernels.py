"""tools/gpu_check/run.py's kernel checks: ceilings, paged attention, Q4_0 linears, fused MoE, offload."""

from __future__ import annotations

import math
import time

from tools.gpu_check.base import Ctx, Row, linear_row, rel_err, status

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
    from swaserve.engine.quant.triton_q4 import q4_0_linear

    w = rand_q4(c, (N, K))
    return [linear_row(c, w, M, q4_0_linear, "q4_0", name, "torch = bf16 mm on dequantized W")]


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
