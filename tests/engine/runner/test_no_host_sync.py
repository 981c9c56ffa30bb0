"""The device part of a step (forward + logits) never reads a tensor back to the host.

Tensor.item / tolist / cpu / numpy and the Python conversions (bool, int, float, index) are patched
to raise when called from swaserve's own code (Triton's interpreter copies tensors to the host
internally; those calls come from triton's files and are allowed). The step runs the GPU backends
(triton attention + triton MoE, in the interpreter here) on the tiny model, prefill and decode, on
the model's reference path and on the fused path (engine/fused, what CUDA runs), and its tokens must
equal the torch backends' run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

import swaserve
from swaserve.engine.fused.ops import device_kernels
from swaserve.llm import LLM, SamplingParams

PKG = os.path.dirname(os.path.abspath(swaserve.__file__))
TESTS = os.path.join(PKG, "tests")
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_sync(allow: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """Patch the syncing Tensor methods to raise when swaserve code (not tests) calls them; calls from
    functions named in `allow` are let through and recorded as "allowed <function>"."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}
    seen: list[str] = []

    def make(name: str):
        orig = originals[name]

        def guarded(self, *args, **kwargs):
            frame = sys._getframe(1)
            caller = frame.f_code.co_filename
            if frame.f_code.co_name in allow:
                seen.append(f"allowed {frame.f_code.co_name}")
            elif caller.startswith(PKG) and not caller.startswith(TESTS):
                seen.append(f"{name} at {caller}:{sys._getframe(1).f_lineno}")
                raise HostSync(f"host sync: Tensor.{name} called from {caller}:{sys._getframe(1).f_lineno}")
            return orig(self, *args, **kwargs)

        return guarded

    for name in SYNCING:
        setattr(torch.Tensor, name, make(name))
    try:
        yield seen
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)


def test_guard_catches_a_sync():
    x = torch.ones(3)
    with forbid_host_sync():
        from swaserve.engine.runner.sampling import top_k_mask  # calls bool(on.any()) on its input

        with pytest.raises(HostSync, match="__bool__"):
            top_k_mask(torch.zeros(1, 8), torch.tensor([2]))
        assert x.sum().item() == 3.0  # from a test file: allowed


def _guard_device_part(llm: LLM) -> list[int]:
    """Wrap the model's forward and logits in forbid_host_sync; returns a counter of guarded calls."""
    model = llm.engine.runner.model
    calls = [0]
    fwd, logits = model.forward, model.logits

    def forward(*a, **k):
        calls[0] += 1
        with forbid_host_sync():
            return fwd(*a, **k)

    def guarded_logits(*a, **k):
        with forbid_host_sync():
            return logits(*a, **k)

    model.forward, model.logits = forward, guarded_logits
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["reference-path", "fused-path"])
def test_step_has_no_host_sync(fused: bool):
    prompts = [[2, 5, 9, 13, 40, 41, 7], [2] + list(range(10, 80))]  # 71 tokens > the tiny window (64)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    # exact CPU matmuls on both sides: what runs on a GPU (the native CPU kernels check their row ids on
    # the host, which is no sync on the CPU they run on)
    ref = LLM(attention_backend="torch", moe_backend="torch", chunked_prefill_size=48, cpu_matmul="exact")
    want = [o.token_ids for o in ref.generate(prompts, params)]
    llm = LLM(attention_backend="triton", moe_backend="triton", chunked_prefill_size=48, cpu_matmul="exact")
    calls = _guard_device_part(llm)
    with device_kernels() if fused else contextlib.nullcontext():  # fused: what CUDA runs (engine/fused)
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls[0] >= 4  # prefill chunks and decode steps all ran guarded
    assert got == want


def test_sampler_reads_back_once():
    """engine/runner/sampling.py: per-row parameters staged (no `torch.tensor(..., device=...)`), no sync but
    one read-back of all results (`_read_back`), over penalties, logit_bias, banned ids, a grammar
    bitmask, greedy and sampled rows, top-k/top-p/min-p (candidate and full paths) and logprobs."""
    from swaserve.engine.runner import sampling
    from swaserve.engine.runner.sampling import SampleRow, make_generator, sample

    def p(**kw):
        return sampling.SamplingParams(**kw)

    rows = [
        SampleRow(p(temperature=0.0, logprobs=2), None, [1, 2], [3]),
        SampleRow(p(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.2, logprobs=0),
                  make_generator(1), [4], [5, 5]),
        SampleRow(p(temperature=1.0, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.1,
                    logit_bias=((7, 2.0),)), make_generator(2), [], [6], banned_ids=[0]),
        SampleRow(p(temperature=0.7, top_k=3), make_generator(3)),
    ]
    fresh = [SampleRow(r.params, make_generator(i) if r.generator else None, r.prompt_ids, r.output_ids,
                       r.banned_ids) for i, r in enumerate(rows)]
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
    bitmask = torch.tensor([[0x00FF00FF, 0x0000FFFF]], dtype=torch.int32)
    want = sample(logits, rows, [2], bitmask)
    real_tensor = torch.tensor

    def no_device_tensor(*a, **k):
        caller = sys._getframe(1).f_code.co_filename
        if k.get("device") is not None and caller.startswith(PKG) and not caller.startswith(TESTS):
            raise HostSync(f"torch.tensor(..., device=) from {caller}:{sys._getframe(1).f_lineno}")
        return real_tensor(*a, **k)

    torch.tensor = no_device_tensor
    try:
        # unpack_bitmask reads the grammar's host bitmask with numpy on the CPU (host data, never on
        # the device; on a device it is staged through pinned memory instead)
        with forbid_host_sync(allow=("_read_back", "unpack_bitmask")) as seen:
            got = sample(logits, fresh, [2], bitmask)
    finally:
        torch.tensor = real_tensor
    assert [c for c in seen if c != "allowed unpack_bitmask"] == ["allowed _read_back"]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert got.logprobs[0] is not None and len(got.logprobs[0].top) == 2


def test_offload_cache_path_keeps_router_ids_on_the_device():
    """engine/moe/offload_backend.py's decode path (emulated on CPU tensors): no read-back of the
    router ids; the only host reads are of the used-expert bitmaps already copied to host memory
    (`_host_list`, after their event completed: no wait)."""
    from swaserve.engine.moe.offload_backend import OffloadMoE
    from tests.engine.moe.moe_cases import (
        OFFLOAD_DEV,
        OFFLOAD_EMULATE,
        make_cfg,
        make_layers,
        on_offload_dev,
        routing,
    )

    g = torch.Generator().manual_seed(0)
    layers = make_layers(g, "Q4_0", 2, 8, 64, 32)
    moe = OffloadMoE(make_cfg(8, 2, 64, 32, num_layers=2), layers, OFFLOAD_DEV, cache_size=3,
                     emulate_device=OFFLOAD_EMULATE, stream_min_tokens=8)
    with forbid_host_sync(allow=("_host_list",)) as seen:
        for _ in range(3):
            x = torch.randn(2, 64, generator=g)
            ids, w = routing(g, 2, 8, 2)
            for li in range(2):
                moe.forward(li, *on_offload_dev(x, ids, w))
    assert moe.stats["cache"] == 6 and moe.stats["expert_copies"] > 0
    assert set(seen) == {"allowed _host_list"}
