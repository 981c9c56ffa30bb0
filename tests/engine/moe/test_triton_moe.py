"""Fused Triton MoE vs TorchMoE and a dense float64 loop, over Q4_0 / Q8_0 / float experts.

Fresh random inputs each run (seed in failure messages; SWASERVE_TEST_SEED reproduces it);
intermediate and output buffers are poisoned with NaN. Hidden 64 and expert intermediate 96 are
not multiples of the kernels' 64-wide tiles in the reduction over I.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from swaserve.engine.moe.torch_backend import TorchMoE
from tests.engine.moe.moe_cases import dense_moe, make_cfg, make_layers, new_seed, rel_err, routing

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must set TRITON_INTERPRET=1"

import swaserve.engine.moe.triton_backend as tmoe  # noqa: E402
from swaserve.engine.moe.triton_backend import TritonMoE, moe_align  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, HID, INTER = 8, 64, 96
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tmoe, "empty", nan_empty)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_moe_align_invariants(block_m: int) -> None:
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    t, k, e = random.Random(seed).randint(0, 30), 3, 7
    ids = torch.randint(0, e, (t, k), generator=g)
    sorted_ids, block_e = moe_align(ids, e, block_m)
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < t * k].long()
    assert sorted(real.tolist()) == list(range(t * k)), f"each assignment once (seed {seed})"
    used = int((block_e >= 0).sum())
    assert (block_e[:used] >= 0).all() and (block_e[used:] == -1).all()
    assert (sorted_ids[used * block_m:] == t * k).all(), f"nothing past the used blocks (seed {seed})"
    for b in range(used):
        rows = sorted_ids[b * block_m:(b + 1) * block_m].long()
        rows = rows[rows < t * k]
        assert len(rows) > 0 and (flat[rows] == block_e[b]).all(), f"block {b} mixes experts (seed {seed})"
    counts = torch.bincount(flat, minlength=e)
    assert used == int(((counts + block_m - 1) // block_m).sum())


@pytest.mark.parametrize("t", [1, 5, 40])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16"])
def test_fused_moe_fp32_matches_torch_and_dense(qtype: str, t: int) -> None:
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    k = random.Random(seed).choice([2, 3])
    layers = make_layers(g, qtype, 2, E, HID, INTER)
    cfg = make_cfg(E, k, HID, INTER, num_layers=2)
    tri = TritonMoE(cfg, layers, DEV, block_m=64 if t == 40 and qtype == "Q4_0" else None)
    ref = TorchMoE(cfg, layers, "cpu")
    x = torch.randn(t, HID, generator=g)
    ids, w = routing(g, t, E, k, skew=t == 40)
    for li in range(2):
        y = tri.forward(li, x.to(DEV), ids.to(DEV), w.to(DEV))
        assert y.shape == (t, HID) and y.dtype == torch.float32
        assert not y.isnan().any(), f"unwritten rows (seed {seed})"
        what = f"{qtype} T={t} K={k} layer {li} seed {seed}"
        assert rel_err(y, ref.forward(li, x, ids, w).double()) <= TOL[torch.float32], what
        assert rel_err(y, dense_moe(layers[li], x, ids, w, torch.float32)) <= TOL[torch.float32], what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_half_activations(dtype: torch.dtype) -> None:
    """Half activations (fp16 runs the GPU dot path in the interpreter: operands in fp16)."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    layers = make_layers(g, "Q4_0", 1, E, HID, INTER)
    tri = TritonMoE(make_cfg(E, 2, HID, INTER), layers, DEV)
    x = torch.randn(9, HID, generator=g).to(dtype)
    ids, w = routing(g, 9, E, 2)
    y = tri.forward(0, x.to(DEV), ids.to(DEV), w.to(DEV))
    assert y.dtype == dtype
    ref = dense_moe(layers[0], x.float(), ids, w, dtype)
    assert rel_err(y, ref) <= TOL[dtype], f"{dtype} seed {seed}"


def test_empty_batch_and_unsupported_type() -> None:
    g = torch.Generator().manual_seed(0)
    layers = make_layers(g, "Q4_0", 1, E, HID, INTER)
    tri = TritonMoE(make_cfg(E, 2, HID, INTER), layers, DEV)
    y = tri.forward(0, torch.zeros(0, HID, device=DEV), torch.zeros(0, 2, dtype=torch.int64, device=DEV),
                    torch.zeros(0, 2, device=DEV))
    assert y.shape == (0, HID)
    layers[0].down.qtype = "IQ2_XXS"  # a GGUF type without a kernel format
    with pytest.raises(ValueError, match="IQ2_XXS"):
        TritonMoE(make_cfg(E, 2, HID, INTER), layers, DEV)
