"""CpuMoE (`--moe-backend cpu`): the native one-call MoE against TorchMoE (exact) and the auto rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.engine.moe import MOE_BACKENDS, get_moe_backend
from swaserve.engine.moe.base import ExpertWeights
from swaserve.engine.moe.cpu_backend import CpuMoE
from swaserve.engine.quant import native
from swaserve.engine.quant.base import QWeight
from swaserve.models.demo.random_blocks import random_blocks
from tests.engine.moe.moe_cases import make_cfg, make_layers, new_seed, routing

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")

E, TOPK, HID, INTER = 8, 3, 128, 64


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_cpu_moe_matches_torch_exact(tokens: int) -> None:
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    layers = make_layers(g, "Q4_0", 2, E, HID, INTER)
    cfg = make_cfg(E, TOPK, HID, INTER, num_layers=2)
    ref = get_moe_backend("torch", cfg, layers, "cpu", cpu_matmul="exact")
    cpu = get_moe_backend("cpu", cfg, layers, "cpu")
    assert isinstance(cpu, CpuMoE)
    x = torch.randn(tokens, HID, generator=g)
    ids, w = routing(g, tokens, E, TOPK, skew=tokens > 10)
    for layer in range(2):
        want = ref.forward(layer, x, ids, w)
        got = cpu.forward(layer, x, ids, w)
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= 0.05 * scale, (seed, err, scale)  # Q8_0 activations: ~1% relative here
        assert err > 0  # the quantized path, not the exact one
    # the bf16 caller (a GPU model) gets its dtype back
    assert cpu.forward(0, x.bfloat16(), ids, w).dtype == torch.bfloat16


def test_cpu_moe_auto_rule_and_refusals() -> None:
    g = torch.Generator().manual_seed(0)
    q4 = make_layers(g, "Q4_0", 1, E, HID, INTER)
    f16 = make_layers(g, "F16", 1, E, HID, INTER)
    cpu = torch.device("cpu")
    assert MOE_BACKENDS.resolve("auto", q4, cpu, "native") == "cpu"
    assert MOE_BACKENDS.resolve("auto", q4, cpu, "exact") == "torch"
    assert MOE_BACKENDS.resolve("auto", f16, cpu, "native") == "torch"
    with pytest.raises(ValueError, match="no kernel for experts of type F16"):
        get_moe_backend("cpu", make_cfg(E, TOPK, HID, INTER), f16, "cpu")


def test_cpu_moe_releases_nothing_it_reads_and_handles_empty_steps() -> None:
    g = torch.Generator().manual_seed(1)
    layers = make_layers(g, "Q4_0", 1, E, HID, INTER)
    cpu = get_moe_backend("cpu", make_cfg(E, TOPK, HID, INTER), layers, "cpu")
    out = cpu.forward(0, torch.zeros(0, HID), torch.zeros(0, TOPK, dtype=torch.int64), torch.zeros(0, TOPK))
    assert out.shape == (0, HID)
    # the stored bytes are untouched by the repack (not file-backed here: nothing released)
    assert native.unpack(cpu.weights[0][0][3], 2 * INTER, HID).equal(layers[0].gate_up.data[3])


def _stored(rng: np.random.Generator, qtype: str, shape: tuple[int, ...]) -> QWeight:
    return QWeight(qtype, shape, torch.from_numpy(random_blocks(qtype, shape, 0.05, rng)), f"test.{qtype}")


def test_cpu_moe_other_types_per_layer_match_torch_exact() -> None:
    """llama.cpp's Q4_K_M expert pairs (Q4_K gate_up with a Q6_K, Q5_0 or Q8_0 down), a Q5_K / IQ4_XS pair
    and an all-Q4_0 layer in one model: each layer goes to its kernel (native_k on the stored rows, or
    the interleaved Q4_0 one) and matches the exact torch backend."""
    rng = np.random.default_rng(5)
    hid, inter = 256, 256
    pairs = [("Q4_K", "Q6_K"), ("Q4_K", "Q5_0"), ("Q4_K", "Q8_0"), ("Q5_K", "IQ4_XS"), ("Q4_0", "Q4_0")]
    layers = [ExpertWeights(gate_up=_stored(rng, a, (E, 2 * inter, hid)),
                            down=_stored(rng, b, (E, hid, inter))) for a, b in pairs]
    cfg = make_cfg(E, TOPK, hid, inter, num_layers=len(pairs))
    assert MOE_BACKENDS.resolve("auto", layers, torch.device("cpu"), "native") == "cpu"
    ref = get_moe_backend("torch", cfg, layers, "cpu", cpu_matmul="exact")
    cpu = get_moe_backend("cpu", cfg, layers, "cpu")
    assert cpu.kinds == ["k", "k", "k", "k", "q4"]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, hid, generator=g)
    ids, w = routing(g, 6, E, TOPK)
    for layer in range(len(pairs)):
        want, got = ref.forward(layer, x, ids, w), cpu.forward(layer, x, ids, w)
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert 0 < err <= 0.05 * scale, (pairs[layer], err, scale)
