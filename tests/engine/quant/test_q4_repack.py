"""Q4_0 repacked for the GPU kernels (engine/quant/q4_repack.py): lossless against the GGUF bytes (gguf's
own quantizer writes them), and the Triton linears/MoE reading the repacked rows agree with the fp32
oracle (the interpreter on CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize, dequantize_rows
from swaserve.engine.quant.linear import linear
from swaserve.engine.quant.q4_repack import (
    Q4_0_PAIRS,
    repack_q4_0,
    repack_weight,
    repacked_row_bytes,
    unpack_q4_0,
)
from tests.engine.moe.moe_cases import make_cfg

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must set TRITON_INTERPRET=1"

import swaserve.engine.quant.triton_q4 as tq  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gguf_q4_0(shape: tuple[int, ...], seed: int) -> tuple[QWeight, np.ndarray]:
    """A Q4_0 weight whose bytes gguf.quants wrote, and gguf's dequantized float64 values."""
    vals = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    raw = quants.quantize(vals, GGMLQuantizationType.Q4_0)  # uint8 [..., N, K / 32 * 18]
    ref = quants.dequantize(raw, GGMLQuantizationType.Q4_0).astype(np.float64)
    return QWeight("Q4_0", shape, torch.from_numpy(np.ascontiguousarray(raw)), "test.q4_0"), ref


@pytest.mark.parametrize("k", [32, 96, 704, 2816])
def test_repack_is_lossless_and_aligned(k: int) -> None:
    w, ref = gguf_q4_0((2, 3, k), seed=k)
    packed = repack_q4_0(w.data, k)
    row = repacked_row_bytes(k)
    assert packed.shape == (2, 3, row) and row % 16 == 0 and row - (k // 2 + k // 16) < 16
    assert torch.equal(unpack_q4_0(packed, k), w.data)  # the GGUF bytes back, exactly
    # the repacked fields themselves: code pairs in element order, then the fp16 scales of the file
    codes = torch.stack([packed[..., : k // 2] & 0xF, packed[..., : k // 2] >> 4], -1).reshape(2, 3, k)
    d = packed[..., k // 2 : k // 2 + k // 16].contiguous().view(torch.float16).float()  # [2, 3, K / 32]
    vals = (codes.double() - 8) * d.double().repeat_interleave(32, dim=-1)
    np.testing.assert_array_equal(vals.numpy(), ref)
    assert not packed[..., k // 2 + k // 16 :].any()  # zero padding


def test_repacked_weight_decodes_like_the_file() -> None:
    w, ref = gguf_q4_0((40, 96), seed=1)
    r = repack_weight(w)
    assert r.layout == Q4_0_PAIRS and repack_weight(r) is r
    assert torch.equal(dequantize(r), dequantize(w))
    ids = torch.tensor([5, 0, 39, 5])
    assert torch.equal(dequantize_rows(r, ids), dequantize_rows(w, ids))
    x = torch.randn(3, 96)
    assert torch.equal(linear(x, r, "exact"), linear(x, w, "exact"))  # CPU: decoded back to GGUF bytes
    with pytest.raises(ValueError, match="not Q4_0 rows"):
        repack_q4_0(w.data[:, :17], 96)


@pytest.mark.parametrize("m", [1, 3, 20])
def test_triton_linear_reads_the_repacked_rows(m: int) -> None:
    n, k = 24, 160  # K not a multiple of any BLOCK_K
    w, ref = gguf_q4_0((n, k), seed=m)
    r = repack_weight(QWeight(w.qtype, w.shape, w.data.to(DEV), w.name))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = tq.quant_linear(x.to(DEV), r)
    want = x.double().numpy() @ ref.T
    err = np.abs(y.double().cpu().numpy() - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    assert torch.allclose(y, tq.quant_linear(x.to(DEV), QWeight(w.qtype, w.shape, w.data.to(DEV))), atol=1e-5)


def test_resident_moe_experts_are_repacked() -> None:
    """TritonMoE keeps Q4_0 experts repacked (tests/engine/moe/test_triton_moe.py checks its numbers
    against the dense oracle); the fused MoE over repacked and GGUF-layout experts agrees."""
    from swaserve.engine.moe.base import ExpertWeights
    from swaserve.engine.moe.triton_backend import TritonMoE, fused_moe, stacked_views
    from swaserve.engine.quant.triton_blocks import FMT_Q4_0, FMT_Q4_0_PAIRS

    e, hid, inter = 4, 64, 32
    gu, _ = gguf_q4_0((e, 2 * inter, hid), seed=7)
    dn, _ = gguf_q4_0((e, hid, inter), seed=8)
    cfg = make_cfg(e, 2, hid, inter)
    tri = TritonMoE(cfg, [ExpertWeights(gate_up=gu, down=dn)], DEV)
    assert tri.gate_up[0][2] == FMT_Q4_0_PAIRS and tri.down[0][2] == FMT_Q4_0_PAIRS
    g = torch.Generator().manual_seed(3)
    x = (0.1 * torch.randn(5, hid, generator=g)).to(DEV)
    ids = torch.randint(0, e, (5, 2), generator=g).to(DEV)
    w = torch.rand(5, 2, generator=g).to(DEV)
    plain = fused_moe(x, stacked_views(gu, DEV), stacked_views(dn, DEV), ids, w, inter)
    assert stacked_views(gu, DEV)[2] == FMT_Q4_0
    assert torch.allclose(tri.forward(0, x, ids, w), plain, atol=1e-5)
