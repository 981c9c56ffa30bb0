"""KV rows to q8_0 / fp8 and back (engine/quant/kv_quant.py), and the native gather of pool rows.

q8_0 bytes must equal gguf.quants' (llama.cpp's reference quantizer, bit for bit), the codes must be
float64 round-half-away-from-zero of x / d, and the values back must equal gguf's dequantization.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from swaserve.engine.quant import native
from swaserve.engine.quant.kv_quant import FP8_MAX, decode, dequantize_q8_0, encode, quantize_q8_0, roundf


def rows(seed: int, n: int = 48, d: int = 128) -> torch.Tensor:
    """[n, 2, d] values of many magnitudes, with the blocks that test the edges of the quantizer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, d, generator=g) * torch.exp(3 * torch.randn(n, 2, 1, generator=g))
    x[0, 0, :32] = 0  # d = 0: codes 0, scale 0
    ties = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5])
    x[1, 0, :32] = torch.cat([ties.repeat(3), torch.full((8,), 127.0)])  # d = 1: x / d lands on ties
    x[2, 0, :32] = 1e-7 * torch.randn(32, generator=g)  # an fp16-subnormal scale
    x[3, 1, 32:64] = 3e4 * torch.randn(32, generator=g)  # a large one
    x[4, 0, :32] = -7.25  # one value repeated: q = -127 everywhere
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q8_0_bytes_equal_gguf(seed: int) -> None:
    x = rows(seed)
    got = quantize_q8_0(x)  # [n, 2, 136]
    assert got.dtype == torch.uint8 and got.shape == (48, 2, 128 // 32 * 34)
    want = quants.quantize(x.numpy().reshape(-1, 128), GGMLQuantizationType.Q8_0)
    assert np.array_equal(got.reshape(-1).numpy(), want.reshape(-1))


def test_q8_0_values_equal_gguf_and_the_float64_rounding() -> None:
    x = rows(3)
    blocks = quantize_q8_0(x)
    back = dequantize_q8_0(blocks)  # [n, 2, 128] fp32
    want = quants.dequantize(blocks.reshape(-1, 34).numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(back.reshape(-1).numpy(), want.reshape(-1))
    # codes: roundf(x * (1 / d)) with d = amax / 127 in fp32, against float64 half-away-from-zero
    xb = x.reshape(-1, 32).double()
    d32 = (x.reshape(-1, 32).abs().amax(1, keepdim=True) / 127).double()
    inv = torch.where(d32 == 0, 0.0, (1 / d32.float()).double())
    t = xb * inv
    ref = torch.sign(t) * torch.floor(t.abs() + 0.5)
    codes = blocks.reshape(-1, 34)[:, 2:].view(torch.int8).double()
    near_tie = ((t.abs() % 1) - 0.5).abs() < 1e-5  # fp32 products may fall either side there
    assert torch.equal(codes[~near_tie], ref[~near_tie]) and codes.abs().max() <= 127
    ties = (1 * 2 + 0) * 4  # block of x[1, 0, :32]: d = 1, every x / d on a tie, masked above
    assert codes[ties].tolist() == ref[ties].tolist() == [1, -1, 2, -2, 3, -3, 127, -127] * 3 + [127] * 8
    # the error bound: half a step of the fp16 scale, plus the scale's own fp16 rounding
    scale = torch.from_numpy(blocks.reshape(-1, 34)[:, :2].contiguous().view(torch.float16).numpy()).double()
    err = (back.reshape(-1, 32).double() - xb).abs()
    assert (err <= scale / 2 + (scale - d32).abs() * 127 + 1e-30).all()


def test_roundf_is_half_away_from_zero() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, 3.0, -0.0])
    assert roundf(x).tolist() == [1.0, 2.0, 3.0, -1.0, -3.0, 0.0, -0.0, 127.0, 3.0, -0.0]


def test_encode_decode_per_storage_type() -> None:
    x = torch.randn(5, 2, 64) * 3
    assert torch.equal(decode(encode(x, torch.uint8), torch.float32), dequantize_q8_0(quantize_q8_0(x)))
    assert torch.equal(decode(encode(x, torch.float16), torch.float32), x.half().float())
    big = torch.tensor([1e4, -1e4, 500.0, 1.0])
    f8 = encode(big, torch.float8_e4m3fn)
    assert f8.dtype == torch.float8_e4m3fn and decode(f8, torch.float32).tolist() == [FP8_MAX, -FP8_MAX,
                                                                                        FP8_MAX, 1.0]


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
def test_native_gather_equals_torch_dequantization(dtype: torch.dtype) -> None:
    """native_ops.kv_gather reads a strided pool view (here every other head row of a wider buffer)."""
    from swaserve.engine.quant import native_ops

    x = rows(4, n=40, d=64)  # [40, 2, 64]
    stored = encode(x, dtype)  # [40, 2, R]
    wide = torch.zeros(40, 3, stored.shape[2], dtype=dtype)
    wide[:, :2] = stored
    view = wide[:, :2]  # slot stride 3 rows, head stride 1 row
    slots = torch.tensor([7, 0, 39, 7, 12], dtype=torch.int64)
    got = native_ops.kv_gather(view, slots, 64)
    assert torch.equal(got, decode(stored[slots], torch.float32))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_q8_0_store_writes_the_gguf_bytes(seed: int) -> None:
    """native_ops.kv_store_q8 (the CPU write of new K/V rows) into a strided pool view at scattered slots:
    the bytes gguf.quants writes, the rows it does not name untouched."""
    from swaserve.engine.quant import native_ops

    x = rows(seed)  # [48, 2, 128]
    wide = torch.full((64, 3, 128 // 32 * 34), 0xA5, dtype=torch.uint8)
    view = wide[:, 1:]  # slot stride 3 head rows, the first head row of every slot not ours
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:48].contiguous()
    native_ops.kv_store_q8(view, slots, x.contiguous())
    want = quants.quantize(x.numpy().reshape(-1, 128), GGMLQuantizationType.Q8_0).reshape(48, 2, -1)
    assert np.array_equal(view[slots].numpy(), want)
    assert torch.equal(view[slots], quantize_q8_0(x))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert bool((wide[:, 0] == 0xA5).all()) and bool((view[untouched] == 0xA5).all())


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_store_kv_takes_the_native_q8_0_write_with_the_same_bytes() -> None:
    """base.store_kv on a CPU q8_0 pool (native write) == the torch quantizer's rows via index_copy_."""
    from swaserve.engine.attention import base

    k, v = rows(5, n=9), rows(6, n=9) * 3
    kc, vc = (torch.zeros(16, 2, 136, dtype=torch.uint8) for _ in range(2))
    slots = torch.tensor([15, 3, 4, 9, 0, 1, 2, 8, 11])
    assert base._native_q8(kc, k, slots)
    base.store_kv(kc, vc, slots, k.transpose(0, 1).contiguous().transpose(0, 1), v)  # a non-contiguous k
    assert torch.equal(kc[slots], quantize_q8_0(k)) and torch.equal(vc[slots], quantize_q8_0(v))
