"""NativeAttentionBackend (decode rows from the pool by one native call) vs dense brute-force attention,
with the torch backend's harness: scattered page tables, split and arena pools, fp32 / fp16 / bf16 KV."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.quant import native
from tests.engine.attention.test_torch_backend import _run_case

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def _backend() -> TorchAttentionBackend:
    from swaserve.engine.attention.native_backend import NativeAttentionBackend

    return NativeAttentionBackend()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", ["split", "arena"])
@pytest.mark.parametrize("row_prefill", [False, True], ids=["blocks", "row-prefill"])  # --batch-invariant
def test_mixed_batch_prefill_and_decode(page_size: int, layout: str, row_prefill: bool) -> None:
    # decodes within and beyond the window (sliding) and over every key (full), beside prefills
    be = _backend()
    be.row_prefill = row_prefill  # type: ignore[attr-defined]
    _run_case(page_size, window=8, prefixes=[0, 13, 37, 5, 0, 50, 21, 1], q_lens=[9, 1, 1, 20, 1, 31, 1, 7],
              seed=page_size, layout=layout, kvh_swa=4 if layout == "arena" else 2, be=be)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["split", "arena"])
def test_half_precision_pools(kv_dtype: torch.dtype, layout: str) -> None:
    _run_case(4, window=6, prefixes=[9, 0, 30, 3], q_lens=[1, 11, 1, 1], seed=7, kv_dtype=kv_dtype, tol=1e-4,
              layout=layout, kvh_swa=4, head_dim_full=48, be=_backend())


def test_decode_only_batches_take_the_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode rows must not go through the torch gather + SDPA (which would also pass the oracle)."""
    def fail(*a: object, **k: object) -> None:
        raise AssertionError("torch decode path taken")

    monkeypatch.setattr(TorchAttentionBackend, "_decode", fail)
    _run_case(4, window=5, prefixes=[3, 12, 1], q_lens=[1, 1, 1], seed=11, be=_backend())
