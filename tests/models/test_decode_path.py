"""models/gemma4_decode.py: the flat decode loop, and the same loop in one native call
(models/gemma4_step.py), give the general layer body's bits (hidden rows of every decode step compared
bit for bit, the same KV slots written twice), over the pool types they take."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.core import SamplingParams
from swaserve.engine.quant import native, native_step
from swaserve.llm import LLM

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


@pytest.mark.parametrize("loop", ["flat", "native"])
@pytest.mark.parametrize("kv", ["auto", "fp16", "bf16", "fp32"])  # auto: q8_0 on CPU
def test_decode_loop_equals_the_layer_body(kv: str, loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(None, cpu_matmul="native", device="cpu", cpu_threads=1, kv_cache_dtype=kv)
    model = llm.engine.runner.model
    path, forward, takes = model._decode, model.forward, model._decode.takes
    assert path.native.ok  # the demo's weights: Q4_0 linears and experts
    path.native.enabled = loop == "native"
    native_calls = []
    native_run = native_step.run
    monkeypatch.setattr(native_step, "run", lambda *a: (native_calls.append(1), native_run(*a))[1])
    seen = {"flat": 0, "general": 0}

    def both(ids: torch.Tensor, meta, pool):  # type: ignore[no-untyped-def]
        if not takes(meta, pool):
            seen["general"] += 1
            return forward(ids, meta, pool)
        seen["flat"] += 1
        path.takes = lambda m, p: False  # the general body first, then the loop over the same slots
        ref = forward(ids, meta, pool)
        path.takes = takes
        out = forward(ids, meta, pool)
        assert torch.equal(out, ref), (out - ref).abs().max().item()
        return out

    model.forward = both
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 70, 17)):  # 70 > the demo's 64-token window: sliding layers drop keys
        llm.engine.add_request(f"r{i}", [2] + [300 + (7 * j + i) % 900 for j in range(n - 1)], params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seen["flat"] >= 4 and seen["general"] >= 1, seen  # batched decodes took the loop, prefills not
    assert len(native_calls) == (seen["flat"] if loop == "native" else 0), (len(native_calls), seen)


def test_the_native_step_needs_q4_0_experts_in_host_memory() -> None:
    llm = LLM(None, cpu_matmul="native", device="cpu", cpu_threads=1, moe_backend="torch")
    path = llm.engine.runner.model._decode
    assert not path.native.ok  # torch MoE: the flat loop runs
    calls = []
    path.native.forward = lambda *a: calls.append(a)  # type: ignore[method-assign]
    llm.engine.add_request("r", [2, 300, 301, 302], SamplingParams(max_tokens=4, temperature=0.0))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert not calls


def test_the_loop_is_off_without_the_native_glue() -> None:
    llm = LLM(None, cpu_matmul="exact", device="cpu", cpu_threads=1)
    model = llm.engine.runner.model
    calls = []
    model._decode.forward = lambda *a: calls.append(a)  # type: ignore[method-assign]
    llm.engine.add_request("r", [2, 300, 301, 302], SamplingParams(max_tokens=3, temperature=0.0))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert not calls
