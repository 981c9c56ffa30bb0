"""models/demo/quant_mix.py (llama.cpp's per-tensor type rules for gemma4) and
models/demo/random_blocks.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from swaserve.engine.quant.formats import dequantize_blocks
from swaserve.models.demo.quant_mix import BLOCK_QTYPES, QTYPE_CHOICES, fit, tensor_types, use_more_bits
from swaserve.models.demo.random_blocks import random_blocks
from swaserve.models.demo.tiny import preset_config
from swaserve.models.gemma4_layout import tensor_shapes

MORE_BITS_30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}  # use_more_bits(i, 30), by hand
MORE_BITS_25 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23, 24}  # over the 25 attn_v tensors


@pytest.fixture(scope="module")
def shapes():
    return tensor_shapes(preset_config("26b-a4b"))


def test_use_more_bits() -> None:
    assert {i for i in range(30) if use_more_bits(i, 30)} == MORE_BITS_30
    assert {i for i in range(25) if use_more_bits(i, 25)} == MORE_BITS_25


def test_fallbacks() -> None:
    assert fit("Q4_K", 2816) == "Q4_K" and fit("Q4_K", 704) == "Q5_0" and fit("Q5_K", 2112) == "Q5_1"
    assert fit("Q6_K", 704) == "Q8_0" and fit("Q2_K", 704) == "Q4_0" and fit("IQ4_XS", 704) == "IQ4_NL"
    assert fit("Q4_0", 48) == "F16" and fit("Q6_K", 48) == "F16" and fit("F32", 7) == "F32"


def test_q4_k_m_on_26b_a4b(shapes) -> None:
    t = tensor_types(shapes, "Q4_K_M")
    assert t["token_embd.weight"] == "Q6_K"
    sliding = [i for i in range(30) if (i + 1) % 6]
    for k, layer in enumerate(sliding):  # attn_v exists on sliding layers only, counted in layer order
        assert t[f"blk.{layer}.attn_v.weight"] == ("Q6_K" if k in MORE_BITS_25 else "Q4_K"), layer
    for layer in range(30):
        p = f"blk.{layer}."
        for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_gate_up_exps"):
            assert t[p + role + ".weight"] == "Q4_K", (layer, role)
        down = "Q8_0" if layer in MORE_BITS_30 else "Q5_0"  # Q6_K / Q4_K fall back: 2112 and 704 columns
        assert t[p + "ffn_down.weight"] == down and t[p + "ffn_down_exps.weight"] == down, layer
        for vec in ("attn_norm.weight", "ffn_gate_inp.weight", "ffn_down_exps.scale",
                    "layer_output_scale.weight"):
            assert t[p + vec] == "F32"
    assert t["rope_freqs.weight"] == "F32" and t["output_norm.weight"] == "F32"


def test_other_mixes_on_26b_a4b(shapes) -> None:
    t = tensor_types(shapes, "Q5_K_M")
    assert t["token_embd.weight"] == "Q6_K" and t["blk.4.attn_q.weight"] == "Q5_K"
    assert t["blk.0.attn_v.weight"] == "Q6_K" and t["blk.3.attn_v.weight"] == "Q5_K"
    assert t["blk.5.ffn_down_exps.weight"] == "Q8_0" and t["blk.4.ffn_down_exps.weight"] == "Q5_1"
    counts = Counter(tensor_types(shapes, "Q6_K").values())
    assert counts["Q8_0"] == 60 and counts["Q6_K"] == 1 + 30 * 7 - 5  # embed + 7 matrices/layer (-5 attn_v)
    assert set(tensor_types(shapes, "Q8_0").values()) == {"Q8_0", "F32"}
    t = tensor_types(shapes, "Q4_0", embed_qtype="Q6_K")
    assert t["token_embd.weight"] == "Q6_K" and set(t.values()) == {"Q4_0", "Q6_K", "F32"}
    with pytest.raises(ValueError, match="--qtype 'Q4_K_S'"):
        tensor_types(shapes, "Q4_K_S")
    with pytest.raises(ValueError, match="--embed-qtype"):
        tensor_types(shapes, "Q4_0", embed_qtype="Q4_K_M")


def test_mixes_at_tiny_geometry_fall_back() -> None:
    shapes = tensor_shapes(preset_config("tiny"))  # hidden 64: no row is a whole 256-weight block ...
    t = tensor_types(shapes, "Q4_K_M")
    assert t["token_embd.weight"] == "Q8_0" and t["blk.0.attn_q.weight"] == "Q5_0"
    assert t["blk.5.attn_output.weight"] == "Q4_K"  # ... except the full layer's o_proj (4 x 64 = 256)
    assert all(q in ("Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32") for q in t.values())


@pytest.mark.parametrize("qtype", BLOCK_QTYPES)
def test_random_blocks_sane(qtype: str) -> None:
    rng = np.random.default_rng(1)
    shape = (3, 16, 512)
    raw = random_blocks(qtype, shape, 0.02, rng)
    assert raw.dtype == np.uint8
    vals = dequantize_blocks(qtype, torch.from_numpy(raw)).numpy()  # exact: tests/engine/quant/test_formats
    assert vals.shape == shape and np.all(np.isfinite(vals))
    assert 0.7 < vals.std() / 0.02 < 1.4, vals.std()
    assert abs(vals.mean()) < 0.15 * vals.std()
    assert len(np.unique(vals)) > 100  # not degenerate
    again = random_blocks(qtype, shape, 0.02, np.random.default_rng(1))
    assert np.array_equal(raw, again)


def test_qtype_choices() -> None:
    want = {"Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "IQ4_NL", "Q2_K", "F16"}
    assert set(QTYPE_CHOICES) >= want
