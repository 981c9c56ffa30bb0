"""TorchMoE vs a dense per-token loop on the dequantized expert weights (F32, F16 and Q4_0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from swaserve.engine.config import ModelConfig
from swaserve.engine.moe import get_moe_backend
from swaserve.engine.moe.base import ExpertWeights
from swaserve.engine.moe.torch_backend import TorchMoE
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize

E, TOPK, HID, INTER = 6, 2, 64, 32


def _cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=16, hidden_size=HID, num_layers=1, num_heads=2, layer_types=("full",),
        head_dim_swa=16, head_dim_full=16, num_kv_heads_swa=1, num_kv_heads_full=1, sliding_window=4,
        intermediate_size=8, moe_intermediate_size=INTER, num_experts=E, top_k_experts=TOPK,
    )


def _qweight(a: np.ndarray, qtype: str) -> QWeight:
    if qtype == "F32":
        return QWeight("F32", a.shape, torch.from_numpy(a.copy()))
    if qtype == "F16":
        return QWeight("F16", a.shape, torch.from_numpy(a.astype(np.float16)))
    raw = quantize(a, GGMLQuantizationType.Q4_0)  # uint8 [..., N, K / 32 * 18]
    return QWeight("Q4_0", a.shape, torch.from_numpy(np.ascontiguousarray(raw)))


def _layer(qtype: str, seed: int) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((E, 2 * INTER, HID)) * 0.2).astype(np.float32)
    down = (rng.standard_normal((E, HID, INTER)) * 0.2).astype(np.float32)
    return ExpertWeights(gate_up=_qweight(gu, qtype), down=_qweight(down, qtype))


def _dense(layer: ExpertWeights, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gu_all = dequantize(layer.gate_up).double()  # [E, 2I, H]
    down_all = dequantize(layer.down).double()  # [E, H, I]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = gu_all[e] @ x[t].double()
            h = F.gelu(gu[:INTER], approximate="tanh") * gu[INTER:]
            out[t] += w[t, j].double() * (down_all[e] @ h)
    return out


def _route(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, HID, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)])  # distinct per token
    w = torch.rand(T, TOPK, generator=g) + 0.1
    return x, ids, w


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_0"])
@pytest.mark.parametrize("T", [1, 3, 37])
def test_moe_matches_dense_loop(qtype: str, T: int) -> None:
    layers = [_layer(qtype, 0), _layer(qtype, 1)]
    moe = TorchMoE(_cfg(), layers, "cpu")
    x, ids, w = _route(T, seed=T)
    for li in range(2):
        got = moe.forward(li, x, ids, w)
        ref = _dense(layers[li], x, ids, w)
        err = (got.double() - ref).abs().max().item()
        assert err < 1e-4 * max(1.0, ref.abs().max().item()), (qtype, T, li, err)


def test_unused_experts_and_skewed_routing() -> None:
    layers = [_layer("Q4_0", 2)]
    moe = TorchMoE(_cfg(), layers, "cpu")
    x, _, w = _route(9, seed=5)
    ids = torch.tensor([[4, 1]] * 9)  # every token to experts 4 and 1; others idle
    ref = _dense(layers[0], x, ids, w)
    assert (moe.forward(0, x, ids, w).double() - ref).abs().max().item() < 1e-4


def test_registry() -> None:
    experts = [_layer("F32", 0)]
    assert isinstance(get_moe_backend("auto", _cfg(), experts, "cpu"), TorchMoE)
    assert isinstance(get_moe_backend("torch", _cfg(), experts, torch.device("cpu")), TorchMoE)
    with pytest.raises(ValueError, match="unknown MoE backend"):
        get_moe_backend("nope", _cfg(), experts, "cpu")
