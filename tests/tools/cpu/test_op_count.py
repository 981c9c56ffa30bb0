"""tools/op_count: the fused decode layer stays within the issue's launch budget (<= 25 per layer)."""

from __future__ import annotations

import os

import pytest

from swaserve.tools.cpu import op_count


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="counts launches through the Triton interpreter (set on machines without CUDA)")
def test_fused_decode_layer_within_budget():
    fused = {k: sum(v.values()) for k, v in op_count.count(1, fused=True).ops.items()}
    assert fused["sliding"] <= 25 and fused["full"] <= 25, fused
    launches = op_count.count(1, fused=True).ops["sliding"]
    assert launches["triton.layer_tail_kernel"] == 1 and launches["triton.moe_align_kernel"] == 1
    reference = {k: sum(v.values()) for k, v in op_count.count(1, fused=False).ops.items()}
    assert reference["sliding"] > 4 * fused["sliding"]  # the count sees the unfused chains
