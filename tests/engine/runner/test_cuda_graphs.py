"""engine/runner/cuda_graphs.py: the static-buffer decode path per batch bucket. On a CPU it runs eagerly
(`capture=False`) through the same buffers and padding a CUDA graph replays; its tokens must equal the
plain path's. The capture itself needs CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

from swaserve.engine.runner.cuda_graphs import DecodeGraphs, bucket_sizes, graphs_supported
from swaserve.llm import LLM, SamplingParams

PROMPTS = [[2, 5, 9, 13, 40, 41, 7], [2] + list(range(10, 80)), [2, 3], [2, 30, 31, 32, 33]]


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 12, 16, 20]


def _attach(llm: LLM, max_batch: int) -> DecodeGraphs:
    r = llm.engine.runner
    pages = -(-4096 // r.page_size)
    r.graphs = DecodeGraphs(r.model, r.pool, r.page_size, r.window, r.device, max_batch, pages, capture=False)
    return r.graphs


def _run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS[:len(params)], params)]


@pytest.mark.parametrize("max_batch", [3, 8])
def test_static_buffers_give_the_plain_tokens(max_batch: int) -> None:
    """3 concurrent decodes in bucket 4 (one padded row) or bucket 3, greedy and seeded sampling,
    sequences crossing the sliding window (the tiny model's 64): the same tokens as without graphs."""
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=5),
              SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)]
    kw = dict(attention_backend="torch", moe_backend="torch", cpu_matmul="exact", device="cpu")
    want = _run(LLM(**kw), params)
    llm = LLM(**kw)
    graphs = _attach(llm, max_batch)
    assert _run(llm, params) == want
    assert graphs.stats["steps"] >= 4
    if max_batch == 8:
        assert graphs.stats["padded_rows"] > 0  # 3 rows ran in bucket 4


@pytest.mark.slow
def test_static_buffers_on_the_fused_triton_path() -> None:
    """The triton attention + MoE backends (interpreter) on the fused decoder, what CUDA captures,
    with the decode split count free of the context length, as during capture."""
    from swaserve.engine.fused.ops import device_kernels

    params = [SamplingParams(max_tokens=3, temperature=0.0)] * 3
    kw = dict(attention_backend="triton", moe_backend="triton", cpu_matmul="exact")
    ref = LLM(attention_backend="torch", moe_backend="torch", cpu_matmul="exact", device="cpu")
    want = _run(ref, params)
    llm = LLM(**kw)
    _attach(llm, 4)
    llm.engine.runner.model.attn.length_free_splits = True
    with device_kernels() if hasattr(llm.engine.runner.model.attn, "attend") else contextlib.nullcontext():
        assert _run(llm, params) == want


def test_graphs_only_where_a_step_can_be_captured() -> None:
    llm = LLM(attention_backend="torch", moe_backend="torch", cpu_matmul="exact", device="cpu")
    assert not graphs_supported(llm.engine.runner.model)  # a CPU model
    assert llm.engine.runner.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_captured_graphs_give_the_eager_tokens() -> None:
    params = [SamplingParams(max_tokens=8, temperature=0.0)] * 3
    want = _run(LLM(no_cuda_graphs=True), params)
    llm = LLM()
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert _run(llm, params) == want
