"""engine/quant/native: the Q4_0 x Q8_0 kernels against independent torch references.

Oracles: gguf's dequantization of the stored blocks (weights), a torch re-implementation of ggml's Q8_0
activation quantization (codes compared exactly), float64 matmuls (results to fp32 rounding), and the
exact path (`linear(..., "exact")`) within the bound the 8-bit activations allow (stated below).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from swaserve.engine.quant import native, native_k
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize
from swaserve.engine.quant.linear import linear

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def _q4(rng: np.random.Generator, n: int, k: int, lead: tuple[int, ...] = ()) -> QWeight:
    w = (rng.standard_normal((*lead, n, k)) * rng.uniform(0.01, 0.2, (*lead, n, 1))).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q4_0)
    return QWeight("Q4_0", (*lead, n, k), torch.from_numpy(raw))


def _q8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's Q8_0 of x [M, K]: d = fp16(amax / 127), q = round_half_even(x * 127 / amax)."""
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)  # [M, K/32, 1]
    d = (amax / 127).half().float()
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).to(torch.int8)
    return q.view_as(x), d.squeeze(-1)


def _q8_dequant(x: torch.Tensor) -> torch.Tensor:
    q, d = _q8_ref(x)
    return (q.view(x.shape[0], -1, 32).double() * d.double().unsqueeze(-1)).view_as(x)


@pytest.mark.parametrize(("n", "k"), [(4, 32), (7, 64), (64, 96), (130, 256), (1408, 704)])
def test_repack_is_lossless(n: int, k: int) -> None:
    qw = _q4(np.random.default_rng(n), n, k)
    packed = native.repack(qw.data, n, k)
    assert packed.numel() == native.packed_bytes(n, k) == -(-n // 8) * 8 * (k // 32) * 18
    assert torch.equal(native.unpack(packed, n, k), qw.data)  # same bytes, back in GGUF order
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(native.rows(packed, n, k, ids), dequantize(qw)[ids])  # exact dequantized rows


def test_q8_quant_matches_ggml_recipe() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g) * torch.rand(5, 1, generator=g) * 10
    x[2, :32] = 0  # an all-zero block: d = 0, codes 0
    q, d = native.q8_quant(x)
    q_ref, d_ref = _q8_ref(x)
    assert torch.equal(d, d_ref)
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize(("n", "k"), [(7, 64), (64, 96), (130, 256), (256, 2816)])
def test_mm_matches_q8_reference(m: int, n: int, k: int) -> None:
    """Against float64 dequant(W) @ dequant(Q8_0(x)): equal up to fp32 accumulation (integer dots exact)."""
    rng = np.random.default_rng(m * 7 + n)
    qw = _q4(rng, n, k)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = native.mm(x, native.repack(qw.data, n, k), n)
    wd = dequantize(qw).double()  # [N, K], gguf-exact
    ref = _q8_dequant(x) @ wd.T
    scale = (_q8_dequant(x).abs() @ wd.abs().T).max().item()
    assert y.shape == (m, n)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("m", [1, 6])
def test_mm_within_activation_quantization_bound_of_exact(m: int) -> None:
    """|native - exact| <= sum over blocks of sum|w| * (d_x / 2 + amax_x * 2^-11) (+ fp32 rounding): the
    rounding of x to its Q8_0 code (half a step) and of the step d_x to fp16 (|q| <= 127 steps)."""
    rng = np.random.default_rng(m)
    n, k = 96, 512
    qw = _q4(rng, n, k)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    exact = linear(x, qw, "exact")
    y = linear(x, qw, "native")
    wd = dequantize(qw).double().view(n, k // 32, 32).abs().sum(-1)  # [N, K/32] sum |w| per block
    xb = x.double().view(m, k // 32, 32)
    amax = xb.abs().amax(-1)  # [M, K/32]
    step = amax / 127
    bound = (step / 2 + amax * 2.0**-11) @ wd.T  # [M, N]
    err = (y.double() - exact.double()).abs()
    assert (err <= bound * 1.001 + 1e-5).all()
    assert err.max() > 0  # it is the quantized path, not the exact one


def test_linear_native_q8_0_goes_to_native_k() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    qw = QWeight("Q8_0", w.shape, torch.from_numpy(quants.quantize(w, GGMLQuantizationType.Q8_0)))
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    assert torch.equal(linear(x, qw, "native"), native_k.mm("Q8_0", x, qw.data, 40))  # engine/quant/native_k


def _moe_ref(x: torch.Tensor, gu: QWeight, dn: QWeight, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-expert float64 reference with the kernel's numerics: each linear sees Q8_0-rounded inputs."""
    inter = gu.shape[1] // 2
    gud, dnd = dequantize(gu).double(), dequantize(dn).double()  # [E, 2I, H], [E, H, I]
    out = torch.zeros(x.shape, dtype=torch.float64)
    xq = _q8_dequant(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = (gud[e] @ xq[t]).float()  # [2I] (the kernel's fp32 output)
            act = torch.nn.functional.gelu(h[:inter], approximate="tanh") * h[inter:]  # [I]
            out[t] += float(w[t, j]) * (dnd[e] @ _q8_dequant(act[None])[0])
    return out


@pytest.mark.parametrize(("t", "e", "topk"), [(1, 8, 2), (5, 8, 3), (17, 16, 4)])
def test_moe_equals_per_expert_reference(t: int, e: int, topk: int) -> None:
    rng = np.random.default_rng(t)
    h, inter = 96, 64
    gu, dn = _q4(rng, 2 * inter, h, (e,)), _q4(rng, h, inter, (e,))
    x = torch.from_numpy(rng.standard_normal((t, h)).astype(np.float32))
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])  # [T, k] distinct per token
    w = torch.rand(t, topk, generator=g)
    y = native.moe(x, native.repack(gu.data, 2 * inter, h), native.repack(dn.data, h, inter), inter, ids, w)
    ref = _moe_ref(x, gu, dn, ids, w)
    assert (y.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_moe_rejects_bad_expert_ids() -> None:
    rng = np.random.default_rng(0)
    gu, dn = _q4(rng, 64, 64, (2,)), _q4(rng, 64, 32, (2,))
    x = torch.zeros(1, 64)
    with pytest.raises(IndexError):
        native.moe(x, native.repack(gu.data, 64, 64), native.repack(dn.data, 64, 32), 32,
                   torch.tensor([[2]]), torch.ones(1, 1))


def _blockwise_fp32(x: torch.Tensor, qw: QWeight) -> torch.Tensor:
    """The documented per-output recipe, computed independently: integer dots from gguf's decoded codes
    and the reference Q8_0 codes, scales fp32(d_w * d_x), fp32 accumulation with one rounding per block
    (an fma: the product is exact in float64 and rounded once with the sum)."""
    n, k = qw.shape
    q, d = _q8_ref(x)  # [M, K] int8, [M, K/32]
    wd = dequantize(qw).view(n, k // 32, 32)  # (c - 8) * d_w, exact in fp32
    dw = torch.from_numpy(np.frombuffer(qw.data.view(n, k // 32, 18)[:, :, :2].contiguous().numpy().tobytes(),
                                        dtype=np.float16).astype(np.float32)).view(n, k // 32)
    codes = torch.where(dw[..., None] != 0, wd / dw[..., None], torch.zeros_like(wd)).round().long()
    dots = torch.einsum("mbj,nbj->mnb", q.view(x.shape[0], -1, 32).long(), codes)  # [M, N, K/32] exact
    scale = (dw[None] * d[:, None]).float()  # [M, N, K/32] fp32 products, as the kernel rounds them
    acc = torch.zeros(x.shape[0], n, dtype=torch.float32)
    for b in range(k // 32):
        acc = (acc.double() + dots[..., b].double() * scale[..., b].double()).float()  # fma: one rounding
    return acc


@pytest.mark.parametrize("n", [8, 13, 40, 72])
def test_tiles_equal_blockwise_recipe_at_every_m(n: int) -> None:
    """M = 1..40 (full 4-row tiles and every ragged tail, N with and without a partial 8-row group):
    bit-equal to the per-output recipe computed independently in torch, and within fp32 accumulation of
    the float64 product of the dequantized operands."""
    k = 96
    rng = np.random.default_rng(n)
    qw = _q4(rng, n, k)
    packed = native.repack(qw.data, n, k)
    wd = dequantize(qw).double()
    x_all = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32)) * 3
    for m in range(1, 41):
        x = x_all[:m]
        y = native.mm(x, packed, n)
        assert torch.equal(y, _blockwise_fp32(x, qw)), m
        ref = _q8_dequant(x) @ wd.T
        scale = (_q8_dequant(x).abs() @ wd.abs().T).max().item()
        assert (y.double() - ref).abs().max().item() <= 1e-6 * scale


def test_row_results_do_not_depend_on_the_batch() -> None:
    """A row's output is the same bits alone (M = 1), in a full tile, or in any tail position."""
    rng = np.random.default_rng(5)
    n, k = 37, 256
    qw = _q4(rng, n, k)
    packed = native.repack(qw.data, n, k)
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    alone = torch.cat([native.mm(x[i:i + 1], packed, n) for i in range(11)])
    for m in (2, 3, 4, 5, 7, 11):
        assert torch.equal(native.mm(x[:m], packed, n), alone[:m])
    assert torch.equal(native.mm(x, packed, n, threads=2), alone)


def test_vnni_and_maddubs_builds_give_the_same_bits() -> None:
    """The two integer-dot paths (vpdpbusd where the build host has it, maddubs + madd otherwise) must
    produce identical outputs; on a machine without VNNI both builds are the maddubs path."""
    plain = native.build_variant(("-mno-avxvnni", "-mno-avx512vnni"))
    assert plain.swa_q4_vnni() == 0
    rng = np.random.default_rng(9)
    n, k, inter, e = 40, 128, 64, 6  # 5 groups: the single-row 4-group tile and one group after it
    qw = _q4(rng, n, k)
    packed = native.repack(qw.data, n, k)
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    assert torch.equal(native.mm(x, packed, n), native.mm(x, packed, n, lib=plain))
    gu, dn = _q4(rng, 2 * inter, k, (e,)), _q4(rng, k, inter, (e,))
    gup, dnp = native.repack(gu.data, 2 * inter, k), native.repack(dn.data, k, inter)
    ids = torch.tensor([[0, 3], [3, 5], [0, 3], [1, 2], [3, 0], [4, 5], [3, 1], [0, 2], [5, 3]])
    w = torch.rand(9, 2, generator=torch.Generator().manual_seed(1))
    ref = native.moe(x, gup, dnp, inter, ids, w)
    assert torch.equal(native.moe(x, gup, dnp, inter, ids, w, lib=plain), ref)
