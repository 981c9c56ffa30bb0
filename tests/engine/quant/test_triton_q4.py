"""Triton Q4_0 / Q8_0 linears (dequant in kernel) vs engine.quant.dequant and a bit-level brute force.

Random stored blocks each run (seed in failure messages; SWASERVE_TEST_SEED reproduces); output
and partial buffers are poisoned with NaN; K is never a multiple of the kernels' BLOCK_K.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must set TRITON_INTERPRET=1"

import swaserve.engine.quant.triton_q4 as tq  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # max err / max |ref|


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tq, "empty", nan_empty)


def new_seed() -> int:
    return int(os.environ.get("SWASERVE_TEST_SEED", random.randrange(2**31)))


def random_qweight(g: torch.Generator, qtype: str, shape: tuple[int, ...]) -> QWeight:
    """Random stored blocks: fp16 scales in [1e-3, 2e-2] (sign random), random codes."""
    *lead, n, k = shape
    nb = k // 32
    d = (torch.rand(*lead, n, nb, 1, generator=g) * 0.019 + 0.001)
    d = d * (torch.randint(0, 2, d.shape, generator=g) * 2 - 1)
    d_bytes = d.half().view(torch.uint8)  # [..., nb, 2]
    nq = 16 if qtype == "Q4_0" else 32
    qs = torch.randint(0, 256, (*lead, n, nb, nq), generator=g, dtype=torch.uint8)
    data = torch.cat([d_bytes, qs], dim=-1).reshape(*lead, n, -1).contiguous()
    return QWeight(qtype, tuple(shape), data, f"test.{qtype}")


def brute_dequant(w: QWeight) -> np.ndarray:
    """Element-by-element decode of the GGUF block layout (independent of engine.quant.dequant)."""
    n, k = w.shape
    raw = w.data.cpu().numpy().reshape(n, -1)
    bb = 18 if w.qtype == "Q4_0" else 34
    out = np.zeros((n, k), dtype=np.float64)
    for r in range(n):
        for b in range(k // 32):
            blk = raw[r, b * bb:(b + 1) * bb]
            d = float(blk[:2].view(np.float16)[0])
            for j in range(32):
                if w.qtype == "Q4_0":
                    byte = int(blk[2 + j % 16])
                    q = (byte & 0xF) if j < 16 else (byte >> 4)
                    out[r, b * 32 + j] = (q - 8) * d
                else:
                    out[r, b * 32 + j] = float(blk[2:].view(np.int8)[j]) * d
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_dequant_oracle_agrees_with_brute_force(qtype: str) -> None:
    seed = new_seed()
    w = random_qweight(torch.Generator().manual_seed(seed), qtype, (3, 64))
    assert np.array_equal(dequantize(w).double().numpy(), brute_dequant(w)), f"seed {seed}"


# rows M: GEMV (1, 3) and GEMM (7, 70); N not a multiple of the tiles; K = 5 or 7 blocks of 32.
@pytest.mark.parametrize("m", [1, 3, 7, 70])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_quant_linear_fp32(qtype: str, m: int) -> None:
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n, k = rng.choice([40, 96]), rng.choice([160, 224])
    w = random_qweight(g, qtype, (n, k))
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ dequantize(w).double().T  # [M, N]
    fn = tq.q4_0_linear if qtype == "Q4_0" else tq.q8_0_linear
    w_dev = QWeight(w.qtype, w.shape, w.data.to(DEV), w.name)
    y = fn(x.to(DEV), w_dev)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert not y.isnan().any(), f"unwritten output (seed {seed})"
    assert rel_err(y, ref) <= TOL[torch.float32], f"{qtype} M={m} N={n} K={k} seed {seed}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 33])
def test_quant_linear_half_inputs_and_3d(dtype: torch.dtype, m: int) -> None:
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    w = random_qweight(g, "Q4_0", (48, 96))
    x = torch.randn(1, m, 96, generator=g).to(dtype)  # [1, M, K]: leading dims are kept
    ref = x.double() @ dequantize(w).double().T
    y = tq.q4_0_linear(x.to(DEV), QWeight(w.qtype, w.shape, w.data.to(DEV), w.name))
    assert y.shape == (1, m, 48) and y.dtype == dtype
    assert rel_err(y, ref) <= TOL[dtype], f"{dtype} M={m} seed {seed}"


def test_matches_cpu_linear_on_unaligned_view() -> None:
    """A row-slice view (odd byte offset into a larger buffer) still works, and agrees with
    engine.quant.linear's CPU path."""
    from swaserve.engine.quant.linear import linear

    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    w = random_qweight(g, "Q4_0", (33, 64))
    buf = torch.cat([torch.zeros(1, dtype=torch.uint8), w.data.reshape(-1)])[1:].view(33, -1)
    assert buf.storage_offset() == 1
    wv = QWeight("Q4_0", (33, 64), buf)
    x = torch.randn(5, 64, generator=g)
    y = tq.q4_0_linear(x.to(DEV), QWeight("Q4_0", (33, 64), buf.to(DEV)) if DEV.type == "cuda" else wv)
    assert rel_err(y, linear(x, w).double()) <= 1e-5, f"seed {seed}"
    assert rel_err(y, x.double() @ torch.from_numpy(brute_dequant(w)).T) <= 1e-5, f"seed {seed}"


def test_rejects_unknown_type() -> None:
    w = QWeight("IQ2_XXS", (32, 256), torch.zeros(32, 66, dtype=torch.uint8), "blk.0.x")
    with pytest.raises(ValueError, match="IQ2_XXS"):
        tq.quant_linear(torch.zeros(1, 32), w)
