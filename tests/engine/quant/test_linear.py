"""engine/quant: dequantize against gguf's numpy reference; linear against dequantize + matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize, dequantize_rows
from swaserve.engine.quant.linear import embedding, expert_slice, linear


def _qweight(w: np.ndarray, qtype: str) -> QWeight:
    if qtype == "F32":
        return QWeight("F32", w.shape, torch.from_numpy(w))
    if qtype == "F16":
        return QWeight("F16", w.shape, torch.from_numpy(w.astype(np.float16)))
    if qtype == "BF16":
        return QWeight("BF16", w.shape, torch.from_numpy(w).to(torch.bfloat16))
    raw = quants.quantize(w, GGMLQuantizationType[qtype])
    return QWeight(qtype, w.shape, torch.from_numpy(raw))


def _ref(w: np.ndarray, qtype: str) -> torch.Tensor:
    """Dequantized weight by gguf's own numpy code (an oracle independent of engine/quant)."""
    if qtype in ("F32", "F16", "BF16"):
        return dequantize(_qweight(w, qtype))
    raw = quants.quantize(w, GGMLQuantizationType[qtype])
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16", "BF16", "F32"])
def test_dequantize_matches_gguf(qtype: str) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 40, 96)) * rng.uniform(0.01, 3, (3, 40, 1))).astype(np.float32)
    got = dequantize(_qweight(w, qtype))
    assert got.shape == (3, 40, 96) and got.dtype == torch.float32
    want = _ref(w, qtype)
    assert torch.equal(got, want)
    if qtype == "F32":
        assert torch.equal(got, torch.from_numpy(w))


def _check_linear(y: torch.Tensor, x: torch.Tensor, wd: torch.Tensor) -> None:
    ref = x.double() @ wd.double().T  # [M, N]
    scale = (x.double().abs() @ wd.double().abs().T).max().item()
    err = (y.double() - ref).abs().max().item()
    assert err <= 2e-6 * scale + 1e-6, (err, scale)  # fp32 rounding only: the paths are lossless


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("shape", [(64, 96), (48, 256), (40, 64), (256, 512)])
@pytest.mark.parametrize("rows", [1, 8, 128])
def test_linear_quantized_matches_dequant(qtype: str, shape: tuple[int, int], rows: int) -> None:
    rng = np.random.default_rng(rows * 1000 + shape[0])
    w = rng.standard_normal(shape).astype(np.float32) * 0.1
    qw = _qweight(w, qtype)
    x = torch.from_numpy(rng.standard_normal((rows, shape[1])).astype(np.float32))
    y = linear(x, qw)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    _check_linear(y, x, _ref(w, qtype))
    codes = qw.cache.codes[0]  # the exact path cached its int8 codes ...
    _check_linear(linear(x, qw), x, _ref(w, qtype))
    assert qw.cache.codes[0] is codes  # ... and reuses them


def _q4_0_blocks(codes: np.ndarray, d: np.ndarray) -> QWeight:
    """Hand-built Q4_0 blocks: fp16 d, then byte j = code j (low nibble) | code j + 16 (high nibble)."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 32).astype(np.uint8)
    qs = c[..., :16] | (c[..., 16:] << 4)  # [n, nb, 16]
    blocks = np.concatenate([d.astype(np.float16)[..., None].view(np.uint8), qs], axis=-1)  # [n, nb, 18]
    return QWeight("Q4_0", (n, k), torch.from_numpy(blocks.reshape(n, -1).copy()))


def test_linear_q4_0_exact_on_representable_weights() -> None:
    """fp32 path: weights that are exactly Q4_0 values and integer inputs give exactly x @ W^T."""
    rng = np.random.default_rng(1)
    n, k = 32, 64
    codes = rng.integers(0, 16, size=(n, k))
    d = rng.uniform(0.01, 0.1, size=(n, k // 32)).astype(np.float16).astype(np.float32)
    w = ((codes - 8) * np.repeat(d, 32, axis=1)).astype(np.float32)
    qw = _q4_0_blocks(codes, d)
    assert torch.equal(dequantize(qw), torch.from_numpy(w))
    x = torch.from_numpy(rng.integers(-3, 4, size=(5, k)).astype(np.float32))  # small integers
    y = linear(x, qw)
    ref = (x.double() @ torch.from_numpy(w).double().T).float()
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-5)


def test_int4_repack_is_lossless() -> None:
    """bf16 path: one-hot inputs read back every weight bit-for-bit (scales chosen bf16-exact)."""
    rng = np.random.default_rng(7)
    n, k = 48, 96
    codes = rng.integers(0, 16, size=(n, k))
    nb = k // 32
    d = (rng.integers(1, 8, size=(n, nb)) * 2.0 ** rng.integers(-9, -3, size=(n, nb))).astype(np.float32)
    qw = _q4_0_blocks(codes, d)
    y = linear(torch.eye(k, dtype=torch.bfloat16), qw)  # [K, N] = W^T
    assert qw.cache.int4 is not None and y.dtype == torch.bfloat16
    assert torch.equal(y.float().T, dequantize(qw))


@pytest.mark.parametrize("shape", [(64, 96), (256, 512), (40, 64)])
@pytest.mark.parametrize("rows", [1, 8, 128])
def test_linear_q4_0_bf16(shape: tuple[int, int], rows: int) -> None:
    """bf16 activations: the int4 kernel (N % 16 == 0) or the chunked path, to bf16 accuracy."""
    rng = np.random.default_rng(rows + shape[0])
    w = rng.standard_normal(shape).astype(np.float32) * 0.1
    qw = _qweight(w, "Q4_0")
    x = torch.from_numpy(rng.standard_normal((rows, shape[1])).astype(np.float32)).bfloat16()
    y = linear(x, qw)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
    assert (qw.cache.int4 is not None) == (shape[0] % 16 == 0)
    ref = x.double() @ _ref(w, "Q4_0").double().T
    scale = (x.double().abs() @ _ref(w, "Q4_0").double().abs().T).max().item()
    assert (y.double() - ref).abs().max().item() <= 1e-2 * scale


def test_cpu_fast_q4_switch() -> None:
    rng = np.random.default_rng(8)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    qw = _qweight(w, "Q4_0")
    y = linear(x, qw, cpu_matmul="fast")
    assert y.dtype == torch.float32 and qw.cache.int4 is not None and qw.cache.codes is None
    ref = x @ _ref(w, "Q4_0").T
    assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    linear(x, qw)
    assert qw.cache.codes is not None  # switched back: the exact path


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "BF16"])
def test_expert_slice(qtype: str) -> None:
    rng = np.random.default_rng(2)
    e, n, k = 4, 48, 64
    w = rng.standard_normal((e, n, k)).astype(np.float32)
    qw = _qweight(w, qtype)
    full = _ref(w, qtype)
    x = torch.from_numpy(rng.standard_normal((8, k)).astype(np.float32))
    for i in range(e):
        sub = expert_slice(qw, i)
        assert sub.shape == (n, k) and sub.qtype == qtype
        assert sub.data.data_ptr() == qw.data[i].data_ptr()  # a view, no copy
        assert expert_slice(qw, i) is sub  # cached (with its repacked form)
        _check_linear(linear(x, sub), x, full[i])


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_linear_float(qtype: str, xdtype: torch.dtype) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    qw = _qweight(w, qtype)
    x = torch.from_numpy(rng.standard_normal((2, 3, 40)).astype(np.float32)).to(xdtype)
    y = linear(x, qw)
    assert y.shape == (2, 3, 24) and y.dtype == xdtype
    ref = x.float() @ dequantize(qw).T
    tol = 1e-5 if xdtype == torch.float32 else 0.1
    assert (y.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16"])
def test_embedding_rows(qtype: str) -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((50, 64)).astype(np.float32)
    qw = _qweight(w, qtype)
    ids = torch.tensor([3, 0, 49, 3])
    want = dequantize(qw)[ids]
    assert torch.equal(embedding(ids, qw), want)
    assert torch.equal(dequantize_rows(qw, ids), want)


def test_linear_rejects_bad_input() -> None:
    qw = _qweight(np.zeros((16, 32), np.float32), "Q4_0")
    with pytest.raises(AssertionError, match="expects 32"):
        linear(torch.zeros(2, 31), qw)
    stacked = _qweight(np.zeros((2, 16, 32), np.float32), "Q4_0")
    with pytest.raises(AssertionError, match="expert_slice"):
        linear(torch.zeros(2, 32), stacked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_linear_cuda_matches_cpu(qtype: str) -> None:
    rng = np.random.default_rng(6)
    w = rng.standard_normal((256, 512)).astype(np.float32) * 0.05
    qw = _qweight(w, qtype)
    gw = QWeight(qtype, qw.shape, qw.data.cuda(), "w")
    for rows in (1, 8, 128):
        x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
        y = linear(x.cuda(), gw).cpu()
        assert y.dtype == torch.float32
        assert torch.allclose(y, linear(x, qw), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                   "IQ4_XS"])
@pytest.mark.parametrize("rows", [1, 8, 70])
def test_linear_every_block_type_exact(qtype: str, rows: int) -> None:
    """The generic exact CPU path (decode row chunks + sgemm) against gguf's dequantization, for a
    2-D weight, expert slices of a stacked one, and fp32 / bf16 inputs; nothing is cached."""
    from tests.engine.quant.test_formats import oracle, random_blocks

    rng = np.random.default_rng(rows)
    elems = 256 if qtype.endswith("_K") or qtype == "IQ4_XS" else 32
    raw = random_blocks(qtype, (3, 40, 512 // elems), rng, special=False).reshape(3, 40, -1)  # [E, N, bytes]
    ref = torch.from_numpy(oracle(raw, qtype))  # [E, N, 512]
    stacked = QWeight(qtype, (3, 40, 512), torch.from_numpy(raw), "w")
    x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
    for e in range(3):
        sub = expert_slice(stacked, e)
        _check_linear(linear(x, sub), x, ref[e])
        xb = x.bfloat16()
        yb = linear(xb, sub)  # exact on the bf16 values, rounded to bf16 at the end
        assert yb.dtype == torch.bfloat16
        assert torch.equal(yb, linear(xb.float(), sub).bfloat16())
        assert sub.cache.codes is None and sub.cache.int4 is None  # stored form only
    ids = torch.tensor([5, 39, 0])
    assert torch.equal(embedding(ids, expert_slice(stacked, 1)), ref[1][ids])
