"""Engine on the tiny demo model (CPU): batching, prefix reuse, preemption, aborts, seeds, stop strings."""

from __future__ import annotations

import asyncio
import random

import pytest

from swaserve.engine.client.in_process import AsyncEngine
from swaserve.engine.core import RequestError, SamplingParams
from swaserve.llm import LLM

W = 64  # the tiny preset's window
CHUNK = 96


def greedy(n_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens, temperature=0.0, **kw)


def assert_pages_returned(engine) -> None:
    s = engine.stats()
    for pool in ("full_pool", "swa_pool"):
        assert s[pool]["used"] == 0, s
        assert s[pool]["cached"] + s[pool]["free"] == s[pool]["total"], s
    a = s["arena"]
    assert a["blocks_free"] + a["blocks_full"] + a["blocks_swa"] == a["blocks_total"], a
    assert s["swa_pool"]["total"] == a["blocks_swa"]
    assert s["full_pool"]["total"] == a["blocks_full"] * a["full_per_block"]
    engine.scheduler.check_integrity()
    engine.cache.check_integrity(used_full=0, used_swa=0)


@pytest.fixture(scope="module")
def naive() -> LLM:
    return LLM(cache_type="naive", chunked_prefill_size=CHUNK, max_running_requests=16)


@pytest.fixture(scope="module")
def radix() -> LLM:
    return LLM(cache_type="radix", chunked_prefill_size=CHUNK, max_running_requests=16)


@pytest.fixture(scope="module")
def prompts(naive) -> list[list[int]]:
    rng = random.Random(0)
    V = naive.tokenizer.vocab_size
    lens = [3, 9, 17, 40, 63, 64, 65, 80, 97, 130, 150, 190, 200, 33, 5, 250]  # around W=64 and CHUNK=96
    return [[2] + [rng.randrange(3, V) for _ in range(L - 1)] for L in lens]


@pytest.fixture(scope="module")
def alone(naive, prompts) -> list[list[int]]:
    """Each prompt run by itself (naive cache: nothing reused)."""
    return [naive.generate([p], greedy(6 + i % 5))[0].token_ids for i, p in enumerate(prompts)]


def test_batched_equals_alone(radix, prompts, alone):
    outs = radix.generate(prompts, [greedy(6 + i % 5) for i in range(len(prompts))])
    for i, o in enumerate(outs):
        assert o.token_ids == alone[i], i
        assert o.finish_reason == ("length" if len(o.token_ids) == 6 + i % 5 else "stop")
        assert o.prompt_tokens == len(prompts[i])
    assert_pages_returned(radix.engine)


def test_prefix_hit_fanout_and_append_equal_uncached(radix, naive):
    system = "You are a careful assistant. " + "Follow the routing notes and keep answers short. " * 14
    sys_msg = {"role": "system", "content": system}
    msgs_a = [sys_msg, {"role": "user", "content": "What is the capital of France?"}]
    msgs_b = [sys_msg, {"role": "user", "content": "Name three prime numbers."}]
    ids_a, starts_a = radix.chat_ids(msgs_a)
    ids_b, starts_b = radix.chat_ids(msgs_b)
    assert len(ids_a) > 2 * W
    radix.engine.flush_cache()
    (a,) = radix.generate([ids_a], greedy(8), anchors=[starts_a])
    assert a.cached_tokens == 0
    (b,) = radix.generate([ids_b], greedy(8), anchors=[starts_b])  # fan-out sibling
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    assert b.cached_tokens >= shared - 16 and b.cached_tokens > 0
    assert b.token_ids == naive.generate([ids_b], greedy(8))[0].token_ids
    follow = ids_a + a.token_ids + radix.tokenizer.encode("\nAnd of Spain?")  # append
    (c,) = radix.generate([follow], greedy(8))
    assert c.cached_tokens >= len(ids_a) + len(a.token_ids) - 1 - 16
    assert c.token_ids == naive.generate([follow], greedy(8))[0].token_ids
    assert_pages_returned(radix.engine)


def test_preemption_gives_identical_outputs(naive):
    # the smallest KV arena that holds 8 running windows (57 blocks of 5 full pages): 8 requests of
    # ~200 + 24 tokens decoding together hold 48 blocks of SWA pages (their windows) and need ~23 blocks
    # of full pages, so some are preempted; the reference is the naive cache's batch (batched == alone
    # is test_batched_equals_alone)
    rng = random.Random(1)
    vocab = naive.tokenizer.vocab_size
    long = [[2] + [rng.randrange(3, vocab) for _ in range(rng.randrange(180, 220))] for _ in range(8)]
    params = [greedy(20 + i % 5) for i in range(len(long))]
    # exact CPU matmuls: a re-prefill after preemption recomputes in one chunk the KV that decode steps
    # wrote; native quantizes each call's activations, so only exact gives the same bits at both shapes
    exact = LLM(cache_type="naive", chunked_prefill_size=CHUNK, max_running_requests=16, cpu_matmul="exact")
    reference = [o.token_ids for o in exact.generate(long, params)]
    small = LLM(cache_type="radix", chunked_prefill_size=CHUNK, max_running_requests=8, cpu_matmul="exact",
                full_tokens=160, swa_tokens=8 * (W + 32) + CHUNK + 16)
    assert small.engine.arena.num_blocks == 57
    outs = small.generate(long, params)
    assert small.engine.scheduler.num_preemptions > 0
    for i, o in enumerate(outs):
        assert o.token_ids == reference[i], i
    assert_pages_returned(small.engine)


def test_seeds_reproduce(radix, prompts):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=42)
    (solo,) = radix.generate([prompts[3]], p)
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(5)]
    batch = radix.generate(prompts[:3] + [prompts[3]] + prompts[4:6], others[:3] + [p] + others[3:])
    assert batch[3].token_ids == solo.token_ids
    (again,) = radix.generate([prompts[3]], p)
    assert again.token_ids == solo.token_ids
    diff = radix.generate([prompts[3]] * 3, [SamplingParams(max_tokens=12, temperature=1.0, seed=s)
                                              for s in (1, 2, 3)])
    assert len({tuple(o.token_ids) for o in diff + [solo]}) > 1


def test_stop_strings_spanning_tokens(radix):
    prompt = radix.encode("Once upon a time there was a little robot who")
    (full,) = radix.generate([prompt], greedy(24, skip_special_tokens=False))
    tok = radix.tokenizer
    pieces = [tok.decode([t]) for t in full.token_ids]
    # a stop string made of the end of one token's text and the start of the next
    for j in range(2, len(pieces) - 1):
        a, b = pieces[j], pieces[j + 1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            cut = full.text.find(stop)
            if cut >= len("".join(pieces[:j])):
                break
    else:
        pytest.skip("no suitable token pair in this output")
    (o,) = radix.generate([prompt], greedy(24, stop=(stop,), skip_special_tokens=False))
    assert o.finish_reason == "stop" and o.matched_stop == stop
    assert o.text == full.text[:cut]
    assert o.token_ids == full.token_ids[:len(o.token_ids)] and len(o.token_ids) <= j + 2


def test_stream_holds_back_stop_prefix_and_aborts_free_pages(radix, prompts):
    radix.engine.flush_cache()
    eng = AsyncEngine(radix.engine)

    async def main():
        async def consume(i, abort_after=None, params=None):
            pieces = []
            # EOS ignored: every unaborted stream runs to its 30 tokens whatever the KV type's greedy path
            agen = eng.generate(f"s{i}", prompts[i], params or greedy(30, ignore_eos=True))
            n = 0
            async for out in agen:
                pieces.append(out)
                n += 1
                if abort_after is not None and n >= abort_after:
                    await agen.aclose()
                    break
            return pieces

        tasks = [consume(i, abort_after=(3 if i % 3 == 0 else None)) for i in range(9)]
        res = await asyncio.gather(*tasks)
        for _ in range(100):  # aborts are released on the next step
            await asyncio.sleep(0.02)
            s = eng.stats()
            if s["running"] == 0 and s["waiting"] == 0:
                break
        return res

    eng.start()
    try:
        res = asyncio.run(main())
    finally:
        eng.shutdown()
    for i, pieces in enumerate(res):
        if i % 3 == 0:
            assert len(pieces) == 3 and not pieces[-1].finished
        else:
            assert pieces[-1].finished and pieces[-1].finish_reason == "length"
            assert sum(len(p.token_ids) for p in pieces) == 30
    assert_pages_returned(radix.engine)


def test_generate_errors_before_output(radix):
    eng = AsyncEngine(radix.engine)
    ctx = eng.context_length

    async def first(ids, params):
        async for out in eng.generate("e", ids, params):
            return out

    with pytest.raises(RequestError, match=f"{ctx} tokens"):
        asyncio.run(first([5] * ctx, greedy(1)))
    with pytest.raises(RequestError, match="max_tokens") as e:
        asyncio.run(first([5] * 10, greedy(ctx)))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="temperature"):
        asyncio.run(first([5] * 10, SamplingParams(temperature=5.0)))
    with pytest.raises(RequestError, match="empty"):
        radix.generate([[]], greedy(1))


def test_n_choices_logprobs_and_stats(radix, prompts):
    eng = radix.engine
    outs = radix.generate([prompts[9]], greedy(5, n=3, logprobs=2))
    assert [o.index for o in outs] == [0, 1, 2]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[1].cached_tokens > 0 or len(prompts[9]) < 17
    for o in outs:
        assert len(o.logprobs) == 5
        for t, lp in zip(o.token_ids, o.logprobs):
            assert lp.token_id == t and len(lp.top) == 2 and lp.top[0][0] == t  # greedy = top-1
            assert lp.logprob <= 0 and abs(lp.logprob - lp.top[0][1]) < 1e-5
    s = eng.stats()
    for key in ("running", "waiting", "full_pool", "swa_pool", "prefix_cache_query_tokens",
                "prefix_cache_hit_tokens", "prompt_tokens_total", "generation_tokens_total"):
        assert key in s
    assert s["generation_tokens_total"] > 0 and s["prefix_cache_hit_tokens"] > 0
    assert eng.flush_cache()
    s = eng.stats()
    for pool in ("full_pool", "swa_pool"):
        assert s[pool]["total"] == s[pool]["free"] == s[pool]["cached"] == 0  # every block returned
        assert s[pool]["allocatable"] == s[pool]["capacity"]
    assert s["arena"]["blocks_free"] == s["arena"]["blocks_total"]


def test_text_stream_holds_back_and_cuts(radix):
    from swaserve.engine.text.text_stream import TextStream

    tok = radix.tokenizer
    text = "hello world, this is the end of it"
    ids = tok.encode(text)
    ts = TextStream(tok, ["the end", "zzz"], skip_special_tokens=True)
    emitted, matched = "", None
    for i, t in enumerate(ids):
        s, matched = ts.push(t)
        emitted += s
        if matched:
            break
        so_far = tok.decode(ids[:i + 1])
        assert so_far.startswith(emitted) and emitted + ts.held == so_far
        assert len(ts.held) < len("the end")
    assert matched == "the end" and emitted == "hello world, this is "
    ts = TextStream(tok, ["zzz"], skip_special_tokens=True)
    out = "".join(ts.push(t)[0] for t in ids) + ts.finish()[0]
    assert out == text
