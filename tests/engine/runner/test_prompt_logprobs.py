"""Prompt logprobs (SamplingParams.prompt_logprobs) through the engine on the tiny demo model, against the
exact forward: the same model run once over the whole sequence on a pool of its own, log-softmax in
float64 (forced-sequence logprobs, as tests/models/test_type_parity.py and tools/cpu/accuracy.py score).
Chunk sizes put chunk boundaries inside the prompt (page-aligned and not, the window of 64 crossed), with
and without a cached prefix, with the LM head's row slices smaller than a chunk."""

from __future__ import annotations

import random

import pytest
import torch

from swaserve.engine.core import RequestError, SamplingParams, TokenLogprob
from swaserve.llm import LLM
from tests.models.hf_oracle import PagedRunner

# max |Δlogprob|. The exact fp32 matmuls: a chunk differs from the whole sequence only by the order of
# fp32 sums (measured up to 2.1e-4 on this chaotic random model). The default native path quantizes
# each call's activations, so its results depend on the chunk's shape (a near-tie in the MoE router
# flipped one position by 0.025).
TOL = 5e-4
PROMPT = 100  # longer than the tiny preset's window (64)


def exact_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log p(. | ids[:t + 1]) for every t: [len(ids), V] float64, one forward over the whole sequence."""
    eng = llm.engine
    run = PagedRunner(eng.runner.model, eng.model_config, eng.config.cache.page_size, len(ids) + 16, 1)
    with torch.no_grad():
        return torch.log_softmax(run.step([(0, ids)])[0].double(), dim=-1)


def check(got: list[TokenLogprob | None] | None, ids: list[int], ref: torch.Tensor, k: int) -> float:
    """Assert `got` is the prompt's logprobs (first None; token, logprob, rank, top-k); the max |Δ|."""
    assert got is not None and len(got) == len(ids) and got[0] is None
    err = 0.0
    for t, lp in enumerate(got[1:]):
        row = ref[t]  # position t predicts token t + 1
        assert lp is not None and lp.token_id == ids[t + 1]
        own = row[ids[t + 1]].item()
        err = max(err, abs(lp.logprob - own))
        # rank: tokens at least as likely, itself included (ties within TOL may count either way)
        assert lp.rank is not None and int((row > own + TOL).sum()) < lp.rank <= int((row >= own - TOL).sum())
        # top-k: the oracle's k best values, each the oracle's own value of the id given (near-ties may swap)
        assert len(lp.top) == k
        for (tid, v), best in zip(lp.top, row.topk(k).values.tolist()):
            err = max(err, abs(v - row[tid].item()), abs(v - best))
    assert err <= TOL, err
    return err


def prompt(seed: int, n: int = PROMPT, vocab: int = 3000) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(3, vocab) for _ in range(n - 1)]


@pytest.fixture(scope="module", params=[7, 16, 33, 256], ids=lambda c: f"chunk{c}")
def llm(request) -> LLM:
    """Chunks of 7 (boundaries off the 16-token pages), 16 (on them), 33, and the whole prompt at once;
    the LM head runs over 5 rows at a time, so slices split chunks too."""
    out = LLM(cache_type="radix", chunked_prefill_size=request.param, max_running_requests=4,
              cpu_matmul="exact", cpu_threads=1,  # one thread: many tiny matmuls on a loaded machine
              kv_cache_dtype="fp32")  # the oracle keeps fp32 keys (the CPU default, fp16, is ~1e-3 off)
    out.engine.runner.logprob_rows = 5
    return out


def test_cold_prompt_matches_the_exact_forward(llm: LLM) -> None:
    ids = prompt(1)
    ref = exact_logprobs(llm, ids)
    (o,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=5))
    err = check(o.prompt_logprobs, ids, ref, 5)
    print(f"chunk {llm.engine.config.scheduler.chunked_prefill_size}: max |Δlogprob| {err:.2e}")
    assert o.token_ids == [] and o.finish_reason == "length" and o.text == ""


def test_cached_prefix_is_recomputed_for_prompt_logprobs(llm: LLM) -> None:
    """The prompt (and a prefix of the next one) is in the cache: the request still gets every row, reuses
    nothing, and puts its prompt into the cache for the requests after it."""
    llm.engine.flush_cache()
    a = prompt(2)
    b = a[:80] + prompt(3, 40)[1:]  # shares 80 tokens (5 pages) with a
    llm.generate([a], SamplingParams(max_tokens=2, temperature=0.0))
    (again,) = llm.generate([a], SamplingParams(max_tokens=2, temperature=0.0))
    assert again.cached_tokens > 0  # the prompt is reusable ...
    for ids in (a, b):
        (o,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))
        assert o.cached_tokens == 0  # ... and not reused by a request for prompt logprobs
        check(o.prompt_logprobs, ids, exact_logprobs(llm, ids), 3)
    (after,) = llm.generate([b], SamplingParams(max_tokens=1, temperature=0.0))
    assert after.cached_tokens == 112  # b's whole pages, inserted by the prompt-logprob request
    assert llm.engine.reuse_log.recent()[1]["reason"] == "prompt_logprobs"


def test_generation_after_prompt_logprobs_is_unchanged(llm: LLM) -> None:
    """Greedy tokens and their logprobs are those of a request without prompt logprobs; the first one's
    logprob is the exact forward's last row."""
    ids = prompt(4)
    ref = exact_logprobs(llm, ids)
    plain = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))[0]
    (o,) = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=2))
    assert o.token_ids == plain.token_ids and o.logprobs is not None and plain.logprobs is not None
    assert [lp.token_id for lp in o.logprobs] == o.token_ids
    assert abs(o.logprobs[0].logprob - ref[-1, o.token_ids[0]].item()) <= TOL
    for x, y in zip(o.logprobs, plain.logprobs):
        assert abs(x.logprob - y.logprob) <= TOL
    check(o.prompt_logprobs, ids, ref, 2)


def test_batch_of_different_ks_and_lengths(llm: LLM) -> None:
    prompts = [prompt(10 + i, n) for i, n in enumerate((1, 2, 17, 64, 65, 130))]
    ks = [3, 0, 1, 20, None, 4]
    params = [SamplingParams(max_tokens=1 + i % 2, temperature=0.0, prompt_logprobs=k)
              for i, k in enumerate(ks)]
    outs = llm.generate(prompts, params)
    for ids, k, o in zip(prompts, ks, outs):
        if k is None:
            assert o.prompt_logprobs is None
        else:
            check(o.prompt_logprobs, ids, exact_logprobs(llm, ids), k)


def test_every_choice_gets_them() -> None:
    llm = LLM(cache_type="radix", chunked_prefill_size=32, max_running_requests=4, cpu_matmul="exact",
              cpu_threads=1, kv_cache_dtype="fp32")
    ids = prompt(5, 50)
    outs = llm.generate([ids], SamplingParams(max_tokens=2, n=3, temperature=1.0, seed=1, prompt_logprobs=1))
    ref = exact_logprobs(llm, ids)
    assert len(outs) == 3
    for o in outs:
        check(o.prompt_logprobs, ids, ref, 1)


@pytest.mark.parametrize("field, value", [("prompt_logprobs", -1), ("prompt_logprobs", 21),
                                          ("max_tokens", -1)])
def test_out_of_range_is_a_request_error(field: str, value: int) -> None:
    with pytest.raises(RequestError) as ei:
        SamplingParams(**{field: value}).validate(3000)
    assert ei.value.param == field
