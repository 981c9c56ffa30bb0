"""Random GGUF blocks of every block type, written directly (no float weights, no quantizer), for the
random models of `swaserve make-model`: random code bytes, and scale fields set so the weights have
about the requested standard deviation and zero mean (the minimum types get a minimum per sub-block
that cancels the codes' mean). Fast enough for the 26B-A4B shapes (one pass of random bytes).

Value statistics used (codes uniform over their range): 4-bit 0..15 std 4.61, 5-bit 0..31 std 9.23,
2-bit 0..3 std 1.12, Q3_K's -4..3 std 2.29, Q6_K's -32..31 std 18.5, int8 std 73.9, and the IQ4
levels std 69.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_IQ4_STD = 69.0
# std of the lattice-codebook types' weights for d = 1 with random bytes (scales, indices, signs)
_GRID_UNIT = {"IQ2_XXS": 53.1, "IQ2_XS": 55.8, "IQ2_S": 56.3, "IQ3_XXS": 142.5, "IQ3_S": 140.7, "IQ1_S": 7.22,
              "IQ1_M": 7.0}


def _put_half(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    """Write fp16 `values` [..., nb] at byte `offset` of each block of blocks [..., nb, B]."""
    blocks[..., offset:offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [..., 8] -> the 12 packed bytes of Q4_K / Q5_K (llama.cpp's layout)."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def _pack_q3_scales(sc: np.ndarray) -> np.ndarray:
    """6-bit Q3_K sub-block scales [..., 16] (stored value = scale + 32) -> its 12 packed bytes."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:8] = (sc[..., 0:8] & 15) | ((sc[..., 8:16] & 15) << 4)
    high = (sc >> 4) & 3  # [..., 16]: sub-block t * 4 + i goes to byte 8 + i, bits 2t
    for t in range(4):
        out[..., 8:12] |= high[..., 4 * t:4 * t + 4] << (2 * t)
    return out


def random_blocks(qtype: str, shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 [*shape[:-1], row bytes]: random `qtype` blocks for a weight of torch shape `shape`
    (shape[-1] a multiple of the block) whose values have about standard deviation `std`."""
    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert shape[-1] % elems == 0, (qtype, shape)
    lead, nb = shape[:-1], shape[-1] // elems
    b = rng.integers(0, 256, size=(*lead, nb, nbytes), dtype=np.uint8)
    spread = rng.uniform(0.5, 1.5, size=(*lead, nb)).astype(np.float32)  # per-block scale variation
    sub = (*lead, nb)

    def uniform_int(lo: int, hi: int, n: int) -> np.ndarray:  # [..., nb, n] in [lo, hi]
        return rng.integers(lo, hi + 1, size=(*sub, n), dtype=np.uint8)

    if qtype in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL"):
        unit = {"Q4_0": 4.61, "Q5_0": 9.23, "Q8_0": 73.9, "IQ4_NL": _IQ4_STD}[qtype]
        _put_half(b, 0, spread * std / unit)
    elif qtype in ("Q4_1", "Q5_1"):
        unit, mean = (4.61, 7.5) if qtype == "Q4_1" else (9.23, 15.5)
        d = (spread * std / unit).astype(np.float16)
        _put_half(b, 0, d)
        _put_half(b, 2, -mean * d.astype(np.float32))  # m: the codes' mean, cancelled
    elif qtype == "Q2_K":  # w = d * sc * q - dmin * m with dmin = 1.5 d and m = sc: zero mean
        sc = uniform_int(8, 15, 16)
        b[..., 0:16] = sc | (sc << 4)
        d = (spread * std / (11.5 * 1.12)).astype(np.float16)
        _put_half(b, 80, d)
        _put_half(b, 82, 1.5 * d.astype(np.float32))
    elif qtype == "Q3_K":  # stored scales 40..63 or 1..24 -> sub-block scales +-(8..31): zero mean
        sc = uniform_int(40, 63, 16)
        b[..., 96:108] = _pack_q3_scales(np.where(rng.random(sc.shape) < 0.5, sc, 64 - sc).astype(np.uint8))
        _put_half(b, 108, spread * std / (19.5 * 2.29))
    elif qtype in ("Q4_K", "Q5_K"):  # w = d * sc * q - d * m with m = round(mean * sc): zero mean
        lo, hi, unit, mean = (4, 8, 4.61, 7.5) if qtype == "Q4_K" else (2, 4, 9.23, 15.5)
        sc = uniform_int(lo, hi, 8)
        mn = np.rint(sc * mean).astype(np.uint8)
        b[..., 4:16] = _pack_k_scales(sc, mn)
        d = (spread * std / ((lo + hi) / 2 * unit)).astype(np.float16)
        _put_half(b, 0, d)
        _put_half(b, 2, d)
    elif qtype == "Q6_K":
        sc = uniform_int(16, 127, 16).view(np.int8)  # int8 sub-block scales, random sign
        b[..., 192:208] = np.where(rng.random(sc.shape) < 0.5, sc, -sc).view(np.uint8)
        _put_half(b, 208, spread * std / (71.5 * 18.5))
    elif qtype == "IQ4_XS":  # stored 40..63 or 1..24 -> +-(8..31): low 4 bits in scales_l, high 2 in scales_h
        sc = uniform_int(40, 63, 8)
        sc = np.where(rng.random(sc.shape) < 0.5, sc, 64 - sc).astype(np.uint8)
        b[..., 4:8] = (sc[..., 0::2] & 15) | ((sc[..., 1::2] & 15) << 4)
        high = ((sc >> 4) & 3).astype(np.uint16) << np.arange(0, 16, 2, dtype=np.uint16)
        b[..., 2:4] = np.bitwise_or.reduce(high, axis=-1)[..., None].view(np.uint8)
        _put_half(b, 0, spread * std / (19.5 * _IQ4_STD))
    elif qtype == "IQ1_M":  # its fp16 d is the top nibbles of the 4 scale words (bytes 48..55)
        d = (spread * std / _GRID_UNIT[qtype]).astype(np.float16).view(np.uint16)
        for t in range(4):
            b[..., 49 + 2 * t] = (b[..., 49 + 2 * t] & 0x0F) | (((d >> (4 * t)) & 0xF) << 4).astype(np.uint8)
    elif qtype in _GRID_UNIT:  # random indices, signs and scales; d first
        _put_half(b, 0, spread * std / _GRID_UNIT[qtype])
    else:
        raise ValueError(f"no random block generator for {qtype}")
    return b.reshape(*lead, nb * nbytes)
