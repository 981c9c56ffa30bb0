"""Triton dequantize-and-multiply for every GGUF block type (engine/quant/triton_blocks.py), in the
linear kernels and the fused MoE, against the fp32 oracle (gguf's decoding, which engine/quant/dequant
matches bit for bit) at small shapes. On CPU the kernels run in Triton's interpreter.

Random stored blocks (any code and sub-block scale bytes, fp16 scales of random sign and size) each
run (seed in failure messages; SWASERVE_TEST_SEED reproduces it); outputs are poisoned with NaN; N is
not a multiple of the tiles and K not of BLOCK_K.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from swaserve.engine.moe.base import ExpertWeights
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.formats import block_format
from tests.engine.moe.moe_cases import dense_moe, make_cfg, new_seed, rel_err, routing
from tests.engine.quant.test_formats import KERNEL_TYPES, oracle, random_blocks

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must set TRITON_INTERPRET=1"

import swaserve.engine.moe.triton_backend as tmoe  # noqa: E402
import swaserve.engine.quant.triton_q4 as tq  # noqa: E402
from swaserve.engine.quant.linear import linear  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tq, "empty", nan_empty)
    monkeypatch.setattr(tmoe, "empty", nan_empty)


def stored(qtype: str, shape: tuple[int, ...], seed: int, sane: bool = False
           ) -> tuple[QWeight, torch.Tensor]:
    """(random QWeight of `shape` on DEV, its fp32 weights by the oracle). Any bytes (fp16 scales of
    magnitude 1e-4..10, any sub-block scales and codes), or with `sane` the random-model generator's
    blocks (weights of std 0.05)."""
    rng = np.random.default_rng(seed)
    elems = block_format(qtype).block_elems
    if sane:
        from swaserve.models.demo.random_blocks import random_blocks as model_blocks

        raw = model_blocks(qtype, shape, 0.05, rng)
    else:
        raw = random_blocks(qtype, (*shape[:-1], shape[-1] // elems), rng, special=False)
        raw = raw.reshape(*shape[:-1], -1)
    ref = torch.from_numpy(oracle(raw, qtype))
    return QWeight(qtype, shape, torch.from_numpy(raw).to(DEV), f"test.{qtype}"), ref


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("m", [1, 33])
def test_quant_linear_every_type(qtype: str, m: int) -> None:
    seed = new_seed()
    k = 2 * block_format(qtype).block_elems if block_format(qtype).block_elems == 256 else 160
    w, wd = stored(qtype, (40, k), seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ wd.double().T
    y = tq.quant_linear(x.to(DEV), w)
    assert y.shape == (m, 40) and not y.isnan().any(), f"unwritten output (seed {seed})"
    assert rel_err(y, ref) <= TOL[torch.float32], f"{qtype} M={m} seed {seed}"
    if m == 33 and qtype in ("Q4_K", "Q6_K", "IQ4_XS", "Q5_1"):  # fp16: the GPU dot path in the interpreter
        w, wd = stored(qtype, (40, k), seed, sane=True)  # weights of std 0.05: no fp16 overflow
        yh = tq.quant_linear(x.half().to(DEV), w)
        assert yh.dtype == torch.float16
        assert rel_err(yh, x.half().double() @ wd.double().T) <= TOL[torch.float16], seed


def test_linear_dispatches_every_type_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.quant.linear sends any block type on CUDA to the Triton kernels (checked on CPU by
    calling its CUDA branch directly)."""
    from swaserve.engine.quant import linear as lin

    calls = []
    monkeypatch.setattr(tq, "quant_linear", lambda x, w: calls.append(w.qtype) or x.new_zeros(1, w.shape[0]))
    for qtype in KERNEL_TYPES:
        w, _ = stored(qtype, (8, block_format(qtype).block_elems), 0)
        lin._cuda_linear(torch.zeros(1, w.shape[1]), w)
    assert calls == KERNEL_TYPES
    assert linear  # the module under test imports cleanly beside the kernels


# (gate_up type, down type): how llama.cpp mixes pair them on gemma-4-26B-A4B, where the experts' down
# projection has 704 columns (not whole 256-weight blocks) and falls back to a 32-weight type
MOE_PAIRS = [("Q4_K", "Q5_0"), ("Q5_K", "Q5_1"), ("Q6_K", "Q8_0"), ("IQ4_XS", "IQ4_NL"), ("Q2_K", "Q4_0"),
             ("Q3_K", "Q4_1")]


@pytest.mark.parametrize("gate_up_type,down_type", MOE_PAIRS)
def test_fused_moe_every_type(gate_up_type: str, down_type: str) -> None:
    seed = new_seed()
    e, hidden, inter, k, t = 4, 256, 64, 2, 5
    gu, _ = stored(gate_up_type, (e, 2 * inter, hidden), seed, sane=True)
    dn, _ = stored(down_type, (e, hidden, inter), seed + 1, sane=True)
    layer = ExpertWeights(gate_up=gu, down=dn)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    ids, w = routing(g, t, e, k)
    tri = tmoe.TritonMoE(make_cfg(e, k, hidden, inter), [layer], DEV)
    y = tri.forward(0, x.to(DEV), ids.to(DEV), w.to(DEV))
    assert y.shape == (t, hidden) and not y.isnan().any(), f"unwritten rows (seed {seed})"
    cpu_layer = ExpertWeights(gate_up=QWeight(gu.qtype, gu.shape, gu.data.cpu()),
                              down=QWeight(dn.qtype, dn.shape, dn.data.cpu()))
    ref = dense_moe(cpu_layer, x, ids, w, torch.float32)
    assert rel_err(y, ref) <= 1e-4, f"{gate_up_type}/{down_type} seed {seed}"
