"""engine/quant/native_k: the integer kernels of the non-Q4_0 GGUF types against independent references.

Oracles: gguf.quants.dequantize of the stored blocks (weights), a torch restatement of the activation
quantization (codes, scales and sums compared exactly), float64 matmuls of the two (the kernels must equal
them up to fp32 accumulation: the integer dots are exact), and the exact path (`linear(..., "exact")`)
within the bound the 8-bit activations allow. Both builds (AVX2 "simd" and the plain C fallback) are
checked; the simd one only where the CPU has AVX2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from swaserve.engine.quant import native_k
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.linear import linear

TYPES = list(native_k.TYPES)
VARIANTS = [v for v in ("simd", "scalar") if v == "scalar" or native_k.default_variant() == "simd"]
pytestmark = pytest.mark.skipif(not native_k.available("scalar"),
                                reason=f"native kernels: {native_k.why_unavailable('scalar')}")
# byte offsets of each type's fp16 fields, and the byte ranges of the packed sub-block scales (ggml-common.h)
HALVES = {"Q4_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0],
          "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0], "Q2_K": [80, 82], "Q3_K": [108]}
SCALES = {"Q4_K": (4, 16), "Q5_K": (4, 16), "Q6_K": (192, 208), "IQ4_XS": (2, 8), "Q2_K": (0, 16),
          "Q3_K": (96, 108)}
EXTREME = np.array([65504.0, -65504.0, 6.104e-5, 5.96e-8, -5.96e-8, 0.0, -0.0, 1.0, 1e-3], np.float16)


def _weight(qtype: str, n: int, k: int, rng: np.random.Generator, lead: tuple[int, ...] = (),
            extreme: bool = False) -> QWeight:
    """Random stored blocks: random code bytes, fp16 fields in [1e-3, 0.1] (or, `extreme`, half of them from
    fp16's max / subnormals / zeros), a fifth of the super-blocks with every scale byte 0xFF or 0x00."""
    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    shape = (*lead, n, k // elems)
    raw = rng.integers(0, 256, size=(*shape, nbytes), dtype=np.uint8)
    for off in HALVES[qtype]:
        vals = rng.uniform(1e-3, 0.1, size=shape) * rng.choice([-1, 1], size=shape)
        if extreme:
            vals = np.where(rng.random(shape) < 0.5, rng.choice(EXTREME, size=shape), vals)
        raw[..., off:off + 2] = vals.astype(np.float16)[..., None].view(np.uint8)
    if qtype in SCALES:
        a, b = SCALES[qtype]
        sel = rng.random(shape)
        raw[..., a:b][sel < 0.1] = 0xFF
        raw[..., a:b][(sel >= 0.1) & (sel < 0.2)] = 0x00
    return QWeight(qtype, (*lead, n, k), torch.from_numpy(raw.reshape(*lead, n, -1)))


def _dequant(w: QWeight) -> torch.Tensor:
    """float64 [..., N, K] from gguf.quants (the oracle, not our decoders)."""
    return torch.from_numpy(quants.dequantize(w.data.numpy(), GGMLQuantizationType[w.qtype])).double()


def _act_ref(qtype: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activations the kernel should make: 32-blocks with fp16-rounded d (ggml's Q8_0) or 256-blocks
    with fp32 d; q = round_half_even(x * (127 / amax)); int16 code sums per 32 / per 16."""
    act = native_k.TYPES[qtype][3]
    xb = x.view(x.shape[0], -1, act)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    if act == 32:
        d = d.half().float()
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).to(torch.int8).view_as(x)
    group = 32 if act == 32 else 16
    s = q.view(x.shape[0], -1, group).sum(-1, dtype=torch.int32).to(torch.int16)
    return q, d.squeeze(-1), s


def _x_dequant(qtype: str, x: torch.Tensor) -> torch.Tensor:
    act = native_k.TYPES[qtype][3]
    q, d, _ = _act_ref(qtype, x)
    return (q.view(x.shape[0], -1, act).double() * d.double().unsqueeze(-1)).view_as(x)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])  # one of each activation kind
def test_activation_quantization_matches_recipe(qtype: str, variant: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 512, generator=g) * torch.rand(5, 1, generator=g) * 10
    x[2, :256] = 0  # all-zero blocks: d = 0, codes 0
    x[3, 7] = 1e30  # one huge value: the rest of its block rounds to 0
    got, want = native_k.quant(qtype, x, variant), _act_ref(qtype, x)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("m", "n", "blocks"), [(1, 1, 1), (3, 17, 2), (9, 40, 3), (1, 33, 11)])
def test_mm_matches_float64_reference(qtype: str, variant: str, m: int, n: int, blocks: int) -> None:
    """Ragged shapes (M, N across the 8-row tiles and 16-row chunks; 1-11 blocks per row), ordinary and
    extreme scales: equal to float64 dequant(W) @ dequant(activations) up to fp32 accumulation."""
    elems = native_k.TYPES[qtype][1]
    k = blocks * elems
    for extreme in (False, True):
        rng = np.random.default_rng(m * 100 + n + blocks + extreme)
        w = _weight(qtype, n, k, rng, extreme=extreme)
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        x[0, :elems] *= 1e-3  # blocks of very different ranges
        y = native_k.mm(qtype, x, w.data, n, variant=variant)
        wd, xd = _dequant(w), _x_dequant(qtype, x)
        ref = xd @ wd.T
        scale = xd.abs() @ wd.abs().T  # [M, N]: sum |x||w|, the size fp32 accumulation errors scale with
        assert y.shape == (m, n)
        assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all(), (qtype, extreme)


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != "Q4_0"])  # Q4_0: native.py's kernel first
def test_linear_native_within_activation_bound_of_exact(qtype: str) -> None:
    """|native - exact| <= sum over activation blocks of sum|w| * (d_x / 2 (+ amax * 2^-11 where d_x is
    fp16-rounded)) + fp32 rounding: the only approximation is the activations' 8-bit rounding."""
    if not native_k.available():
        pytest.skip(native_k.why_unavailable())
    rng = np.random.default_rng(1)
    elems, act = native_k.TYPES[qtype][1], native_k.TYPES[qtype][3]
    n, k, m = 24, 2 * max(elems, 256), 3
    w = _weight(qtype, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    exact, y = linear(x, w, "exact"), linear(x, w, "native")
    assert torch.equal(y, native_k.mm(qtype, x, w.data, n))  # linear's native path is this kernel
    wabs = _dequant(w).abs().view(n, k // act, act).sum(-1)  # [N, K / act]
    amax = x.double().view(m, k // act, act).abs().amax(-1)  # [M, K / act]
    step = amax / 127
    bound = (step / 2 + (amax * 2.0**-11 if act == 32 else 0)) @ wabs.T
    err = (y.double() - exact.double()).abs()
    tiny = 1e-5 * (x.double().abs() @ _dequant(w).abs().T)
    assert (err <= bound * 1.001 + tiny).all()
    assert err.max() > 0  # it is the quantized path, not the exact one


def test_types_without_a_kernel_stay_exact() -> None:
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, size=(8, 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 weights
    raw[:, 0:2] = np.array([0.01], np.float16).view(np.uint8)
    w = QWeight("IQ2_XXS", (8, 256), torch.from_numpy(raw))
    x = torch.randn(2, 256)
    assert not native_k.supports("IQ2_XXS", 256)
    assert torch.equal(linear(x, w, "native"), linear(x, w, "exact"))


def _moe_ref(x: torch.Tensor, gu: QWeight, dn: QWeight, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-expert float64 reference with the kernel's numerics: each linear sees its quantized inputs."""
    inter = gu.shape[1] // 2
    gud, dnd = _dequant(gu), _dequant(dn)  # [E, 2I, H], [E, H, I]
    out = torch.zeros(x.shape, dtype=torch.float64)
    xq = _x_dequant(gu.qtype, x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = (gud[e] @ xq[t]).float()  # [2I] (the kernel's fp32 output)
            act = torch.nn.functional.gelu(h[:inter], approximate="tanh") * h[inter:]  # [I]
            out[t] += float(w[t, j]) * (dnd[e] @ _x_dequant(dn.qtype, act[None])[0])
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("gu_type", "dn_type", "t", "e", "topk"),
                         [("Q4_K", "Q6_K", 1, 8, 2), ("Q5_K", "Q5_1", 5, 8, 3), ("Q4_K", "Q5_0", 9, 4, 2),
                          ("IQ4_XS", "Q8_0", 3, 4, 4), ("Q3_K", "Q2_K", 2, 4, 2)])
def test_moe_equals_per_expert_reference(gu_type: str, dn_type: str, t: int, e: int, topk: int,
                                         variant: str) -> None:
    rng = np.random.default_rng(t)
    h, inter = 256, 64 if native_k.TYPES[dn_type][1] == 32 else 256
    gu, dn = _weight(gu_type, 2 * inter, h, rng, (e,)), _weight(dn_type, h, inter, rng, (e,))
    # small inputs: random IQ4_XS weights reach 400, and gelu(gate) * up of O(1e3) outputs would exceed
    # what the fp16 scale of a Q8_0 activation block holds (amax / 127 > 65504: inf, as in ggml)
    x = torch.from_numpy(rng.standard_normal((t, h)).astype(np.float32)) * 0.01
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])  # [T, k] distinct per token
    wt = torch.rand(t, topk, generator=g)
    y = native_k.moe(x, gu_type, gu.data, dn_type, dn.data, inter, ids, wt, variant=variant)
    ref = _moe_ref(x, gu, dn, ids, wt)
    assert (y.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_bad_input_is_refused() -> None:
    rng = np.random.default_rng(0)
    gu, dn = _weight("Q4_K", 64, 256, rng, (2,)), _weight("Q8_0", 256, 32, rng, (2,))
    with pytest.raises(IndexError):
        native_k.moe(torch.zeros(1, 256), "Q4_K", gu.data, "Q8_0", dn.data, 32, torch.tensor([[2]]),
                     torch.ones(1, 1))
    with pytest.raises(ValueError, match="no native kernel for Q4_K with 96"):
        native_k.mm("Q4_K", torch.zeros(1, 96), torch.zeros(4, 54, dtype=torch.uint8), 4)


def test_the_two_builds_are_what_they_say() -> None:
    """The fallback build has no AVX2 body (so the tests above check the plain C code), the simd one has."""
    assert native_k.load("scalar").swa_k_simd() == 0
    if "simd" in VARIANTS:
        assert native_k.load("simd").swa_k_simd() == 1
