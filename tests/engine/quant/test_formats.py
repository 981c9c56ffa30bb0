"""engine/quant block formats: every decoder bit-exact to gguf.quants.dequantize (the oracle) in fp32,
over random blocks with ordinary, extreme, subnormal, zero and non-finite fp16 scales, and saturated
or empty sub-block scale / minimum fields of the K types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize, dequantize_data, dequantize_rows, supported
from swaserve.engine.quant.formats import FORMATS, block_format, dequantize_blocks, row_bytes
from swaserve.engine.quant.triton_blocks import WEIGHT_FORMATS

KERNEL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_XS"]  # also decoded by the Triton kernels
GRID_TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]  # CPU decoders only
TYPES = KERNEL_TYPES + GRID_TYPES
# byte offsets of each type's fp16 fields (d, and m / dmin where the type has one), from ggml-common.h
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ1_M": [],  # its fp16 d is spread over the top nibbles of the 4 scale words
}
# byte ranges of the packed sub-block scale (and minimum) fields of the super-block types
SCALE_FIELDS = {"Q2_K": (0, 16), "Q3_K": (96, 108), "Q4_K": (4, 16), "Q5_K": (4, 16), "Q6_K": (192, 208),
                "IQ4_XS": (2, 8)}
# fp16 max, smallest normal, smallest subnormal, other subnormals, signed zeros, ordinary values
SPECIAL_HALVES = np.array([65504.0, -65504.0, 6.104e-5, -6.104e-5, 5.96e-8, -5.96e-8, 3.05e-5, 1e-6, 0.0,
                           -0.0, 1.0, -2.0, 1e-3, 0.5], dtype=np.float16)


def oracle(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return quants.dequantize(raw, GGMLQuantizationType[qtype])


def assert_bit_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite) and np.array_equal(np.isnan(got), np.isnan(want))
    # every finite value bit for bit (+0.0 and -0.0 included), infinities with their sign
    assert np.array_equal(got[~np.isnan(want)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))


def random_blocks(qtype: str, shape: tuple[int, ...], rng: np.random.Generator, special: bool,
                  non_finite: bool = False) -> np.ndarray:
    """uint8 [*shape, block_bytes]: random bytes, fp16 fields ordinary (|x| in [1e-4, 10]) or picked
    from SPECIAL_HALVES (extremes, smallest normal, subnormals, zeros); some super-blocks get their
    sub-block scale / minimum bytes all 0xFF or all 0x00."""
    nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    raw = rng.integers(0, 256, size=(*shape, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        vals = (rng.uniform(1e-4, 10, size=shape) * rng.choice([-1, 1], size=shape)).astype(np.float16)
        if special:
            pick = rng.random(shape) < 0.5
            vals = np.where(pick, rng.choice(SPECIAL_HALVES, size=shape), vals).astype(np.float16)
        if non_finite:
            bad = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float16), size=shape)
            vals = np.where(rng.random(shape) < 0.3, bad, vals).astype(np.float16)
        raw[..., off:off + 2] = vals[..., None].view(np.uint8)
    if qtype in SCALE_FIELDS:
        a, b = SCALE_FIELDS[qtype]
        sel = rng.random(shape)
        raw[..., a:b][sel < 0.15] = 0xFF
        raw[..., a:b][(sel >= 0.15) & (sel < 0.3)] = 0x00
    if qtype == "IQ1_M":
        # every offset sign bit set: the one case where gguf-py 0.19 (every offset negative, see
        # engine/quant/blocks_iq.py) and llama.cpp agree; the other sign is tested by hand below
        raw[..., 32:48] |= 0x88
        d = rng.uniform(1e-3, 1, size=shape).astype(np.float16).view(np.uint16)  # finite, positive d
        for t in range(4):
            word = raw[..., 48 + 2 * t:50 + 2 * t].copy().view(np.uint16)[..., 0]
            word = (word & 0x0FFF) | (((d >> (4 * t)) & 0xF) << 12)
            raw[..., 48 + 2 * t:50 + 2 * t] = word.astype(np.uint16)[..., None].view(np.uint8)
    return raw


def test_registry_matches_gguf_sizes() -> None:
    assert sorted(FORMATS) == sorted(TYPES)
    assert sorted(WEIGHT_FORMATS) == sorted(KERNEL_TYPES + ["F32", "F16", "BF16"])
    for name in TYPES:
        fmt = block_format(name)
        assert (fmt.block_elems, fmt.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert row_bytes(name, 4 * fmt.block_elems) == 4 * fmt.block_bytes
        assert supported(name)
    for bad in ("Q8_K", "I32", "TQ1_0", "MXFP4"):
        assert not supported(bad)
        with pytest.raises(ValueError, match=bad):
            block_format(bad)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("special", [False, True])
def test_dequantize_bit_exact(qtype: str, special: bool) -> None:
    rng = np.random.default_rng(sum(map(ord, qtype)) + special)
    raw = random_blocks(qtype, (5, 3, 4), rng, special)  # 5 x 3 rows of 4 blocks
    want = oracle(raw.reshape(5, 3, -1), qtype)
    got = dequantize_blocks(qtype, torch.from_numpy(raw.reshape(5, 3, -1)))
    assert_bit_exact(got.numpy(), want)
    out = torch.full(want.shape, float("nan"))  # the output buffer path writes every element
    assert dequantize_blocks(qtype, torch.from_numpy(raw.reshape(5, 3, -1)), out=out) is out
    assert_bit_exact(out.numpy(), want)


@pytest.mark.parametrize("qtype", TYPES)
def test_non_finite_scales_propagate_like_gguf(qtype: str) -> None:
    rng = np.random.default_rng(7)
    raw = random_blocks(qtype, (64,), rng, special=True, non_finite=True)
    assert_bit_exact(dequantize_blocks(qtype, torch.from_numpy(raw)).numpy(), oracle(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_strided_rows_and_embedding_rows(qtype: str) -> None:
    """Expert slices and row chunks of a stacked weight, and an embedding lookup of a few rows."""
    rng = np.random.default_rng(3)
    elems = block_format(qtype).block_elems
    raw = random_blocks(qtype, (2, 9, 2), rng, special=True).reshape(2, 9, -1)  # [E, N, bytes]
    full = oracle(raw, qtype)  # [E, N, 2 * elems]
    w = QWeight(qtype, (2, 9, 2 * elems), torch.from_numpy(raw), "w")
    assert_bit_exact(dequantize(w).numpy(), full)
    sub = torch.from_numpy(raw)[1, 2:7]  # a row chunk of expert 1
    assert_bit_exact(dequantize_data(qtype, sub).numpy(), full[1, 2:7])
    w2 = QWeight(qtype, (9, 2 * elems), torch.from_numpy(raw[0]), "embed")
    ids = torch.tensor([8, 0, 3, 8])
    assert_bit_exact(dequantize_rows(w2, ids).numpy(), full[0][ids.numpy()])


def test_known_values() -> None:
    """Hand-built blocks with known weights (a check of the oracle's reading of the layouts too)."""
    # Q4_K: d = 0.5, dmin = 0.25, sub-block 0 scale 3 / min 2, sub-blocks 1..7 scale 1 / min 0, codes = 5
    blk = np.zeros(144, np.uint8)
    blk[0:2] = np.array([0.5], np.float16).view(np.uint8)
    blk[2:4] = np.array([0.25], np.float16).view(np.uint8)
    blk[4:8] = [3, 1, 1, 1]  # scales of sub-blocks 0-3 (low 6 bits)
    blk[8:12] = [2, 0, 0, 0]  # mins of sub-blocks 0-3
    blk[12:16] = [0x01, 0x01, 0x01, 0x01]  # sub-blocks 4-7: scale 1 (low nibble), min 0 (high nibble)
    blk[16:144] = 0x55
    got = dequantize_blocks("Q4_K", torch.from_numpy(blk[None])).numpy()[0]
    assert np.all(got[:32] == 0.5 * 3 * 5 - 0.25 * 2) and np.all(got[32:] == 0.5 * 5)
    # Q6_K: d = 2, scales all -1, ql = 0, qh = 0 -> q = -32 -> w = 2 * -1 * -32 = 64
    blk = np.zeros(210, np.uint8)
    blk[192:208] = np.array([-1] * 16, np.int8).view(np.uint8)
    blk[208:210] = np.array([2.0], np.float16).view(np.uint8)
    assert np.all(dequantize_blocks("Q6_K", torch.from_numpy(blk[None])).numpy() == 64.0)
    got = dequantize_blocks("Q6_K", torch.from_numpy(blk[None])).numpy()
    assert_bit_exact(got, oracle(blk[None], "Q6_K"))


def test_iq1_m_reference_of_the_parity_oracle() -> None:
    """tests/models/hf_oracle.py decodes IQ1_M files with its own numpy code; it agrees with ours."""
    from tests.models.hf_oracle import iq1_m_reference

    raw = np.random.default_rng(4).integers(0, 256, size=(9, 3 * 56), dtype=np.uint8)
    assert_bit_exact(dequantize_blocks("IQ1_M", torch.from_numpy(raw)).numpy(), iq1_m_reference(raw))


def test_iq1_m_offset_sign_follows_llama_cpp() -> None:
    """IQ1_M weight = d * (2 * scale + 1) * (grid value + delta), delta = -1/8 where bit 3 of the
    weight group's qh nibble is set, +1/8 where it is clear (llama.cpp's dequantize_row_iq1_m)."""
    from gguf import quants as gq

    gq.IQ1_M.init_grid()
    grid = gq.IQ1_M.grid.reshape(2048, 8)
    blk = np.zeros(56, np.uint8)
    blk[0:32] = np.arange(32, dtype=np.uint8) * 7  # grid indices (low 8 bits)
    blk[32:48] = np.array([0x08, 0x80, 0x00, 0x88] * 4, np.uint8)  # high bits 0, offset signs mixed
    d = np.array([0.5], np.float16).view(np.uint16)[0]
    words = np.array([(1 | (2 << 3)) | (((d >> (4 * t)) & 0xF) << 12) for t in range(4)], np.uint16)
    blk[48:56] = words.view(np.uint8)  # scales: 1 then 2 in every word's two low fields, 0 above
    got = dequantize_blocks("IQ1_M", torch.from_numpy(blk[None])).numpy()[0].reshape(32, 8)
    for g in range(32):  # group g: nibble g of qh (low nibble of byte g // 2 first)
        nib = (blk[32 + g // 2] >> (4 * (g % 2))) & 0xF
        delta = -0.125 if nib & 8 else 0.125
        sub = g // 2  # 16-weight half sub-block: scale field (sub % 4) of word sub // 4
        s = (int(words[sub // 4]) >> (3 * (sub % 4))) & 7
        want = np.float32(0.5) * np.float32(2 * s + 1) * (grid[blk[g]] + np.float32(delta))
        assert np.array_equal(got[g], want.astype(np.float32)), g
