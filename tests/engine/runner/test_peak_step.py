"""The dummy peak step (pool sizing on CUDA) and the load-time weight forms, on the CPU."""

from __future__ import annotations

import torch

from swaserve.engine.fused.weights import float_weight_to, logits_fp32
from swaserve.engine.model_api import ModelBundle
from swaserve.engine.quant.base import QWeight
from swaserve.engine.runner.peak_step import peak_batch, reserve_peak_step, run_peak_step
from swaserve.llm import LLM


def test_peak_batch_shape():
    batch, pages = peak_batch(chunk=100, decodes=3, page_size=16)
    assert batch.q_lens == [100, 1, 1, 1] and batch.prefix_lens == [0, 1, 1, 1]
    assert pages == 7 + 3 and all(batch.sample)
    used = [p for r in batch.reqs for p in r.full_pages]
    assert sorted(used) == list(range(pages))  # private pages, none shared


def test_peak_step_runs_on_the_tiny_model():
    engine = LLM(chunked_prefill_size=96, max_running_requests=8).engine
    bundle = ModelBundle(engine.runner.model, engine.model_config, {}, "tiny", "", engine.device)
    logits, pool_bytes = run_peak_step(bundle, engine.config)
    assert logits.shape == (9, bundle.config.vocab_size) and logits.dtype == torch.float32
    assert bool(torch.isfinite(logits).all()) and pool_bytes > 0
    assert reserve_peak_step(bundle, engine.config) == 0  # CPU: nothing to reserve


def test_float_weight_converted_once():
    w = QWeight("F16", (6, 4), torch.randn(6, 4).half(), "w")
    cpu = torch.device("cpu")
    c = float_weight_to(w, cpu, torch.float32)
    assert c.qtype == "F32" and c.data.dtype == torch.float32 and torch.equal(c.data, w.data.float())
    assert float_weight_to(c, cpu, torch.float32) is c  # already in form: no copy
    assert float_weight_to(w, cpu, None) is w  # None keeps the stored dtype
    q = QWeight("Q4_0", (32, 32), torch.zeros(32, 18, dtype=torch.uint8), "q")
    assert float_weight_to(q, cpu, torch.bfloat16) is q  # block types are left to their kernels


def test_logits_fp32_cpu_matches_a_float64_matmul():
    w = QWeight("F32", (50, 16), torch.randn(50, 16), "embed")
    x = torch.randn(3, 16)
    out = logits_fp32(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ w.data.double().t(), rtol=1e-5, atol=1e-5)


def test_max_chunk_tokens_adds_one_image_when_bidirectional():
    from swaserve.engine.config import EngineConfig, SchedulerConfig, VisionSpec
    from swaserve.engine.runner.peak_step import max_chunk_tokens

    cfg = EngineConfig(scheduler=SchedulerConfig(chunked_prefill_size=512))
    cpu = torch.device("cpu")

    def bundle(bidir: bool | None) -> ModelBundle:
        spec = None if bidir is None else VisionSpec(16, 3, 280, 5, None, None, bidir)
        return ModelBundle(None, None, {}, "m", "", cpu, vision=None if spec is None else object(),
                           vision_spec=spec)

    assert max_chunk_tokens(cfg, bundle(None)) == 512  # text only
    assert max_chunk_tokens(cfg, bundle(False)) == 512  # causal images split anywhere
    assert max_chunk_tokens(cfg, bundle(True)) == 512 + 279  # a chunk may run to an image's end
