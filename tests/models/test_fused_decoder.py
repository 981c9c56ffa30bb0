"""The fused device path (models/gemma4_fused.py, engine/fused's kernels in the Triton interpreter
here) against the model's reference path.

Same model, same batch (a prefill chunk and decodes, sliding and full layers), same pool: the
hidden states after the final norm must agree to fp32 rounding, and the KV the fused store
kernel wrote must equal the reference's. The router and the device-side alignment are checked
against their torch formulations too.
"""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.fused import moe_kernels
from swaserve.engine.fused.ops import device_kernels
from swaserve.engine.moe.triton_backend import moe_align
from swaserve.engine.runner.model_runner import build_metadata
from swaserve.engine.runner.peak_step import peak_batch
from swaserve.llm import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    # exact CPU matmuls: the Triton linears take fp32 activations, native would quantize them to 8 bits;
    # fp32 KV (not the fp16 default): the two paths' last-bit-different K/V would round to different halves
    return LLM(attention_backend="triton", moe_backend="triton", chunked_prefill_size=48, cpu_matmul="exact",
               kv_cache_dtype="fp32")


def test_fused_forward_matches_reference(llm):
    engine = llm.engine
    model, pool = engine.runner.model, engine.pool
    page = engine.config.cache.page_size
    batch, _ = peak_batch(chunk=40, decodes=3, page_size=page)
    meta = build_metadata(batch, page, model.cfg.sliding_window)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (batch.num_tokens,), generator=g)
    pools = pool.tensors()  # the KV arena's buffer (or the split pools' four tensors)
    for t in pools:
        t.fill_(0)
    ref = model.forward(ids, meta, pool)
    ref_kv = [t.clone() for t in pools]
    for t in pools:
        t.fill_(0)
    with device_kernels():
        got = model.forward(ids, meta, pool)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)
    for want, t in zip(ref_kv, pools):
        torch.testing.assert_close(t, want, rtol=2e-4, atol=2e-4)  # later layers: fp32 sum order


def test_router_kernel_matches_torch():
    g = torch.Generator().manual_seed(1)
    T, H, E, K = 5, 96, 16, 4
    x, w = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g)
    pes = torch.rand(E, generator=g) + 0.5
    ids = torch.empty(T, K, dtype=torch.int64)
    wt = torch.empty(T, K)
    moe_kernels.router_kernel[(T,)](x, w, pes, ids, wt, H, E=E, K=K, BLOCK_H=32)
    probs = torch.softmax(x @ w.t(), dim=-1)
    rw, rid = torch.topk(probs, K, dim=-1)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(wt, rw / rw.sum(-1, keepdim=True) * pes[rid], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,K,E,bm", [(1, 8, 128, 16), (9, 8, 128, 16), (64, 8, 128, 16), (3, 2, 4, 16)])
def test_device_alignment_equals_torch_alignment(T, K, E, bm):
    g = torch.Generator().manual_seed(T * 31 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    nb = T * K // bm + min(E, T * K) + 1
    dev = moe_kernels.align_on_device(ids, E, bm, nb)
    assert dev is not None
    flat = ids.reshape(-1)  # the torch formulation, written out
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + bm - 1) // bm * bm
    pad_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e = flat[order]
    dest = (pad_end - padded)[e] + torch.arange(T * K) - (torch.cumsum(counts, 0) - counts)[e]
    want = torch.full((nb * bm,), T * K, dtype=torch.int32)
    want[dest] = order.to(torch.int32)
    block_e = torch.searchsorted(pad_end, torch.arange(nb) * bm, right=True)
    assert torch.equal(dev[0], want)
    assert torch.equal(dev[1], torch.where(block_e < E, block_e, -1).to(torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(moe_align(ids, E, bm), dev))


def test_alignment_falls_back_above_the_one_program_limit():
    ids = torch.zeros(moe_kernels.ALIGN_MAX_ASSIGNMENTS + 1, 1, dtype=torch.int64)
    assert moe_kernels.align_on_device(ids, 128, 16, 10) is None
    assert moe_kernels.align_on_device(torch.zeros(4, 2, dtype=torch.int64), 6, 16, 4) is None  # E not 2^n
    sorted_ids, block_e = moe_align(ids, 128, 16)  # the torch path still answers
    assert sorted_ids.numel() == block_e.numel() * 16
