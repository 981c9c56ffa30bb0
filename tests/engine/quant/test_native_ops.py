"""engine/quant/native_ops: the decoder layer's native glue against the torch ops it replaces
(models/gemma4_ops.py's rms_norm / apply_rope and the layer tail), to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.quant import native, native_ops
from swaserve.models.gemma4_ops import apply_rope, rms_norm

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
EPS = 1e-6


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-6) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert (a - b).abs().max().item() <= rel * b.abs().max().item(), (a - b).abs().max().item()


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_and_norm_add(with_weight: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1024, generator=g) * 30
    w = torch.randn(1024, generator=g) if with_weight else None
    _close(native_ops.rms_norm(x, w, EPS), rms_norm(x, w, EPS))
    h = torch.randn(5, 1024, generator=g)
    ref = h + rms_norm(x, w, EPS)
    assert native_ops.rms_norm_add_(h, x, w, EPS) is h
    _close(h, ref)


@pytest.mark.parametrize(("d", "n", "half"), [(128, 64, 64), (256, 32, 128), (64, 0, 32)])
def test_norm_rope_in_place(d: int, n: int, half: int) -> None:
    """Full rotation (n == half), partial ("proportional": only the first n pairs rotate), and none."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, 4, d, generator=g)
    w = torch.randn(d, generator=g)
    pos = torch.tensor([0.0, 7.0, 1000.0])[:, None]
    ang = pos * torch.rand(max(n, 1), generator=g)[None, :n]
    cos, sin = ang.cos(), ang.sin()
    ref = apply_rope(rms_norm(x, w, EPS), cos, sin, half) if n else rms_norm(x, w, EPS)
    out = native_ops.norm_rope_(x, w, EPS, cos if n else None, sin if n else None, half)
    assert out.data_ptr() == x.data_ptr()
    _close(out, ref, 1e-5)


def test_ffn_tail() -> None:
    g = torch.Generator().manual_seed(1)
    m1, m2, h = (torch.randn(4, 256, generator=g) * s for s in (3.0, 0.2, 1.0))
    w1, w2, w = (torch.randn(256, generator=g) for _ in range(3))
    ref = (h + rms_norm(rms_norm(m1, w1, EPS) + rms_norm(m2, w2, EPS), w, EPS)) * 0.75
    _close(native_ops.ffn_tail_(h, m1.clone(), m2.clone(), w1, w2, w, EPS, 0.75), ref)


def test_fits() -> None:
    assert native_ops.fits(torch.zeros(2, 8), None)
    assert not native_ops.fits(torch.zeros(2, 12))  # not a multiple of 8
    assert not native_ops.fits(torch.zeros(8, 8).t())  # not contiguous
    assert not native_ops.fits(torch.zeros(2, 8, dtype=torch.float64))


def test_router_matches_the_torch_route() -> None:
    """ids equal (no near-ties in these draws), weights to fp32 rounding; the reference is Gemma4Model's
    torch route: rms_norm * router_scale * H^-0.5, softmax, top-k, renormalise, * per_expert_scale."""
    g = torch.Generator().manual_seed(2)
    t, h, e, k = 9, 256, 32, 4
    x = torch.randn(t, h, generator=g) * 4
    scale, w = torch.rand(h, generator=g) + 0.5, torch.randn(e, h, generator=g)
    pes = torch.rand(e, generator=g)
    probs = torch.softmax(rms_norm(x, None, EPS) * scale * h**-0.5 @ w.T, dim=-1)
    ref_w, ref_ids = torch.topk(probs, k, dim=-1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * pes[ref_ids]
    ids, wts = native_ops.router(x, (scale * h**-0.5).contiguous(), EPS, w, k, pes)
    assert torch.equal(ids, ref_ids)
    _close(wts, ref_w, 1e-5)


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "q8_0"])
def test_decode_attn_grouped_heads_equal_each_head_alone(kv: str) -> None:
    """8 query heads per KV head (K / V rows converted to fp32 once for the group) give the same bits as
    each query head attending alone (one head per KV head: rows read straight from the pool)."""
    from swaserve.engine.quant.kv_quant import quantize_q8_0

    g = torch.Generator().manual_seed(3)
    slots_total, kvh, group, d, b = 64, 2, 8, 64, 3
    k = torch.randn(slots_total, kvh, d, generator=g)
    v = torch.randn(slots_total, kvh, d, generator=g)
    if kv == "q8_0":
        k, v = quantize_q8_0(k), quantize_q8_0(v)  # uint8 [S, KVH, D / 32 * 34]
    elif kv != "fp32":
        k, v = k.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[kv])), v.to(k.dtype)
    q = torch.randn(b, kvh * group, d, generator=g)
    counts = torch.tensor([37, 5, 50])  # more keys than the score tile (4) and the value block (16)
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:50] for _ in range(b)]).contiguous()
    rows = torch.arange(b)
    out = torch.empty_like(q)
    native_ops.decode_attn(q, rows, k, v, slots, counts, out)
    for j in range(group):  # query heads j, group + j, ...: head j of each KV head
        heads = torch.arange(kvh) * group + j
        alone = torch.empty(b, kvh, d)
        native_ops.decode_attn(q[:, heads].contiguous(), rows, k, v, slots, counts, alone)
        assert torch.equal(out[:, heads], alone), j
