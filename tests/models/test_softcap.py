"""The final logit softcap (Gemma: cap 30, logits = 30 * tanh(raw / 30)) at the sizes real logits have:
raw values up to ~±100, where tanh bends (the tiny model's own logits are a few units, where a missing or
wrong softcap changes almost nothing), and a 262,144-token vocabulary. The oracle is computed in float64
from the GGUF's embedding dequantized by gguf-py's quants (not swaserve's dequantizer)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from swaserve.engine.quant.base import QWeight
from swaserve.llm import LLM
from swaserve.models.demo.tiny import demo_model_path


@pytest.fixture(scope="module")
def model():
    return LLM(cpu_matmul="exact").engine.runner.model


def _ref(hidden: torch.Tensor, embed: np.ndarray, cap: float) -> torch.Tensor:
    raw = hidden.double().numpy() @ embed.astype(np.float64).T  # [N, V]
    return torch.from_numpy(cap * np.tanh(raw / cap))


def test_softcap_at_realistic_logit_magnitudes(model) -> None:
    cap = model.cfg.final_logit_softcap
    assert cap == 30.0
    t = next(t for t in gguf.GGUFReader(demo_model_path()).tensors if t.name == "token_embd.weight")
    embed = gguf.quants.dequantize(t.data, t.tensor_type)  # [V, H] float32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, embed.shape[1], generator=g)
    raw = hidden.double().numpy() @ embed.astype(np.float64).T
    hidden *= 100.0 / float(np.abs(raw).max())  # the largest raw logit is 100: tanh well into its bend
    got = model.logits(hidden)
    want = _ref(hidden, embed, cap)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=1e-4)
    assert float(want.abs().max()) < cap and float(want.abs().max()) > 0.9 * cap
    raw_t = torch.from_numpy(hidden.double().numpy() @ embed.astype(np.float64).T)
    assert float((raw_t - want).abs().max()) > 50  # the cap really changed the large logits
    assert torch.equal(got.argmax(-1), raw_t.argmax(-1))  # monotone: the greedy token is the raw argmax


def test_softcap_over_a_full_gemma_vocabulary(model, monkeypatch) -> None:
    V, H = 262_144, model.embed.shape[1]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(V, H, generator=g) * 0.5
    monkeypatch.setattr(model, "embed", QWeight("F32", (V, H), w, name="token_embd.weight"))
    hidden = torch.randn(3, H, generator=g) * 4.0  # raw logits ~N(0, 16^2): max ~ +-80
    got = model.logits(hidden)
    want = _ref(hidden, w.numpy(), model.cfg.final_logit_softcap)
    assert got.shape == (3, V)
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=1e-4)
    assert float(want.abs().max()) > 25
