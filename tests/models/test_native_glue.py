"""models/gemma4.py on the native CPU path: the native glue (norms, rope, router, layer tail, decode
attention from the pool) against the same model with the torch glue and the torch attention backend,
step by step on a real engine run (prefills and decodes of several requests).

The matmuls run exact here (fp32): with the native Q4_0 x Q8_0 matmuls a last-bit difference in an
activation can flip one of its 8-bit codes, a ~1e-3 change that a random model then amplifies, which
would hide what this test checks (the glue computes the same fp32 function as the torch ops)."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.core import SamplingParams
from swaserve.engine.quant import native
from swaserve.engine.quant.linear import linear
from swaserve.llm import LLM

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def test_native_glue_matches_torch_glue() -> None:
    # fp32 KV (not the fp16 default): both runs write the same slots, and an fp16 pool rounds their
    # last-bit-different K/V to different halves in ~2% of a prefill's values, a 4e-4 step that is the
    # KV type's, not the glue's
    llm = LLM(None, cpu_matmul="native", moe_backend="torch", device="cpu", cpu_threads=1,
              kv_cache_dtype="fp32")
    model = llm.engine.runner.model
    assert model._glue, "the native glue should be on for the demo model with --cpu-matmul native"
    model._linear = lambda x, w: linear(x, w, "exact")  # fp32 matmuls (see above)
    model.moe.cpu_matmul = "exact"
    native_attn = model.attn
    assert type(native_attn).__name__ == "NativeAttentionBackend"
    torch_attn, forward = TorchAttentionBackend(), model.forward
    errs: list[float] = []
    kinds: set[str] = set()

    def both(ids: torch.Tensor, meta, pool):  # type: ignore[no-untyped-def]
        model._glue, model.attn = False, torch_attn  # the reference first (writes the same KV slots)
        ref = forward(ids, meta, pool)
        model._glue, model.attn = True, native_attn
        meta.backend_plans.clear()
        out = forward(ids, meta, pool)
        errs.append(((out - ref).abs().max() / ref.abs().max()).item())
        kinds.add("decode" if max(meta.q_lens) == 1 else "prefill")
        return out

    model.forward = both
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 70, 17)):  # 70 > the demo's 64-token window: sliding layers drop keys
        llm.engine.add_request(f"r{i}", [2] + [300 + (7 * j + i) % 900 for j in range(n - 1)], params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert kinds == {"decode", "prefill"}
    assert max(errs) < 1e-4, errs  # fp32 rounding order only (amplified through 6 random layers)
    assert max(errs) > 0  # the two runs did take different code
