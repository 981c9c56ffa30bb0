"""Scheduler + KV bookkeeping with a checking fake model (every KV read verified) over the real
prefix cache (engine/kvcache) and a simple reference cache."""

from __future__ import annotations

import random

import pytest

from swaserve.engine.config import SchedulerConfig
from swaserve.engine.core import RequestError, SamplingParams
from swaserve.engine.kvcache import NaiveCache, PageAllocator, SWARadixCache
from swaserve.engine.scheduler import KVManager, Scheduler, make_reqs
from tests.engine.scheduler.fakes import CheckingModel, FakeAllocator, RefCache, next_token

CACHES = ["ref", "real"]


def build(kind: str, P: int = 4, W: int = 16, full: int = 2000, swa: int = 2000, max_running: int = 8,
          chunk: int = 32, enabled: bool = True, context: int = 4096, policy: str = "lazy",
          admission: str = "fcfs", admission_max_wait: int | None = None):
    if not enabled:  # --cache-type naive, the same for both kinds
        fa, sa = PageAllocator(full), PageAllocator(swa)
        cache = NaiveCache(P, fa, sa)
    elif kind == "real":
        fa, sa = PageAllocator(full), PageAllocator(swa)
        cache = SWARadixCache(P, W, fa, sa, swa_retain_tokens=8, policy=policy)
    else:
        fa, sa = FakeAllocator(full), FakeAllocator(swa)
        cache = RefCache(P, W, fa, sa)
    kv = KVManager(cache, fa, sa, P, W)
    cfg = SchedulerConfig(max_running_requests=max_running, chunked_prefill_size=chunk,
                          admission_policy=admission, admission_max_wait=admission_max_wait)
    sched = Scheduler(cfg, kv, context)
    return sched, CheckingModel(P, W)


def reqs_for(rid: str, prompt: list[int], max_tokens: int, n: int = 1, anchors=(), stop_ids=(), context=4096):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n, stop_token_ids=tuple(stop_ids))
    return make_reqs(rid, prompt, params, context_length=context, eos_ids=(), seed=0, anchors=anchors)


def run(sched: Scheduler, model: CheckingModel, reqs, max_steps: int = 100000, on_step=None):
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work():
        batch, _ = sched.schedule()
        assert batch is not None, "scheduler stalled with work left"
        assert batch.num_tokens <= sched.cfg.chunked_prefill_size
        assert len(sched.running) <= sched.cfg.max_running_requests
        sched.update(batch, model(batch))
        sched.check_integrity()
        steps += 1
        if on_step is not None:
            on_step(steps)
        assert steps < max_steps
    return {r.rid: r.output_ids for r in reqs}


def assert_all_returned(sched: Scheduler) -> None:
    kv = sched.kv
    assert not sched.running and not sched.waiting
    sched.check_integrity()  # used == 0: free + cached == total
    kv.cache.check_integrity(used_full=0, used_swa=0)


def expected(prompt: list[int], max_tokens: int, vocab: int = 97) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(next_token(ids, vocab))
    return ids[len(prompt):]


def mixed_prompts(rng: random.Random, n: int, W: int, chunk: int) -> list[list[int]]:
    lens = [rng.choice([1, 3, 7, W - 1, W + 5, 2 * W + 3, chunk + 9, 3 * chunk + 1]) for _ in range(n)]
    return [[rng.randrange(97) for _ in range(L)] for L in lens]


@pytest.mark.parametrize("kind", CACHES)
def test_batched_equals_alone_and_pages_return(kind):
    rng = random.Random(0)
    prompts = mixed_prompts(rng, 16, 16, 32)
    sched, model = build(kind, max_running=16)
    reqs = [r for i, p in enumerate(prompts) for r in reqs_for(f"r{i}", p, 5 + i)]
    out = run(sched, model, reqs)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == expected(p, 5 + i)
        assert reqs[i].finish_reason == "length"
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_prefix_hits_fanout_and_append(kind):
    P, W = 4, 16
    rng = random.Random(1)
    system = [rng.randrange(97) for _ in range(70)]
    sched, model = build(kind, P=P, W=W)
    a = reqs_for("a", system + [1, 2, 3, 4, 5], 6, anchors=(70,))
    run(sched, model, a)
    assert a[0].cached_tokens == 0
    b = reqs_for("b", system + [9, 9, 9], 6, anchors=(70,))  # fan-out sibling
    run(sched, model, b)
    assert b[0].cached_tokens == 68  # page-aligned part of the shared 70 tokens
    assert b[0].output_ids == expected(system + [9, 9, 9], 6)
    follow = a[0].token_ids[:-1] + [7, 7]  # append: previous prompt + its reply + new turn
    c = reqs_for("c", follow, 4)
    run(sched, model, c)
    assert c[0].cached_tokens == (len(a[0].token_ids) - 1) // P * P
    assert c[0].output_ids == expected(follow, 4)
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_naive_cache_has_no_reuse(kind):
    sched, model = build(kind, enabled=False)
    p = list(range(50))
    run(sched, model, reqs_for("a", p, 3))
    b = reqs_for("b", p + [1], 3)
    run(sched, model, b)
    assert b[0].cached_tokens == 0 and b[0].output_ids == expected(p + [1], 3)
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_preemption_keeps_outputs_and_loses_nothing(kind):
    P, W = 4, 16
    rng = random.Random(2)
    prompts = mixed_prompts(rng, 12, W, 32)
    # full pool far too small for 12 running requests of up to ~100 tokens + 40 generated
    sched, model = build(kind, P=P, W=W, full=120, swa=200, max_running=12)
    reqs = [r for i, p in enumerate(prompts) for r in reqs_for(f"r{i}", p, 40)]
    out = run(sched, model, reqs)
    assert sched.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == expected(p, 40), i
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_swa_pool_pressure_and_long_decode(kind):
    # SWA pool holds about 4 windows; decodes run far past the window so request-owned SWA pages
    # must be dropped as they leave it
    P, W = 4, 16
    sched, model = build(kind, P=P, W=W, swa=4 * (W // P + 2) + 32 // P + 1, max_running=4)
    prompts = [[i] * (10 + 7 * i) for i in range(6)]
    reqs = [r for i, p in enumerate(prompts) for r in reqs_for(f"r{i}", p, 60)]
    out = run(sched, model, reqs)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == expected(p, 60)
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_abort_frees_everything(kind):
    sched, model = build(kind)
    rng = random.Random(3)
    prompts = mixed_prompts(rng, 10, 16, 32)
    reqs = [r for i, p in enumerate(prompts) for r in reqs_for(f"r{i}", p, 30)]

    def on_step(step):
        if step == 3:
            sched.abort("r1")
            sched.abort("r7")
        if step == 6:
            sched.abort("r2")

    run(sched, model, reqs, on_step=on_step)
    reasons = {r.rid: r.finish_reason for r in reqs}
    assert reasons["r1"] == reasons["r7"] == reasons["r2"] == "abort"
    assert sum(1 for v in reasons.values() if v == "length") == 7
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_n_choices_share_the_prompt(kind):
    P = 4
    sched, model = build(kind, P=P)
    prompt = list(range(1, 42))
    reqs = reqs_for("x", prompt, 5, n=3)
    run(sched, model, reqs)
    assert [r.cached_tokens for r in reqs] == [0, 40, 40]
    assert all(r.output_ids == expected(prompt, 5) for r in reqs)
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_stop_token_ids_and_budget_respected(kind):
    sched, model = build(kind, chunk=8, max_running=2)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    full = expected(prompt, 20)
    stop = full[4]
    first = full.index(stop)
    r = reqs_for("s", prompt, 20, stop_ids=(stop,))
    others = [x for i in range(4) for x in reqs_for(f"o{i}", [i + 1] * 30, 3)]
    run(sched, model, r + others)
    assert r[0].finish_reason == "stop" and r[0].matched_stop == stop
    assert r[0].output_ids == full[:first + 1]
    assert_all_returned(sched)


def test_context_length_errors():
    p = SamplingParams(max_tokens=10)
    with pytest.raises(RequestError, match="100 tokens.*context length of 100"):
        make_reqs("a", list(range(100)), p, context_length=100, eos_ids=(), seed=0)
    with pytest.raises(RequestError, match="context length is 100 tokens, but 105") as e:
        make_reqs("a", list(range(95)), p, context_length=100, eos_ids=(), seed=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="empty"):
        make_reqs("a", [], p, context_length=100, eos_ids=(), seed=0)
    (r,) = make_reqs("a", list(range(95)), SamplingParams(max_tokens=None), context_length=100,
                     eos_ids=(1,), seed=0)
    assert r.max_len == 100 and r.stop_ids == {1}


@pytest.mark.parametrize("kind", CACHES)
def test_max_tokens_none_runs_to_the_context(kind):
    sched, model = build(kind, context=40)
    (r,) = make_reqs("a", list(range(30)), SamplingParams(max_tokens=None, temperature=0.0),
                     context_length=40, eos_ids=(), seed=0)
    run(sched, model, [r])
    assert r.finish_reason == "length" and len(r.token_ids) == 40


@pytest.mark.parametrize("kind,policy", [("ref", "lazy"), ("real", "lazy"), ("real", "eager")])
def test_random_workloads(kind, policy):
    """Shared prefixes, tight pools (eviction + preemption), aborts, n > 1, page sizes 1..8:
    every KV read is checked, outputs are exact, nothing leaks."""
    preemptions = aborts = hits = 0
    for seed in range(8):
        rng = random.Random(seed)
        P = rng.choice([1, 2, 4, 8])
        W = rng.choice([8, 16, 24])
        chunk = rng.choice([8, 16, 48])
        max_running = rng.choice([2, 4, 8])
        per_req = -(-W // P) + 2
        swa = max_running * per_req + -(-chunk // P) + 1 + rng.choice([0, 5, 40])
        full = rng.choice([60, 120, 400]) // P * P // P + 130 // P  # >= the context (130 tokens)
        sched, model = build(kind, P=P, W=W, full=full, swa=swa, max_running=max_running, chunk=chunk,
                             context=130, policy=policy)
        bases = [[rng.randrange(97) for _ in range(rng.randint(10, 60))] for _ in range(3)]
        reqs, exp = [], {}
        for i in range(14):
            b = rng.choice(bases)
            prompt = b[:rng.randint(1, len(b))] + [rng.randrange(97) for _ in range(rng.randint(0, 20))]
            mt = rng.randint(1, 30)
            rs = reqs_for(f"r{i}", prompt, mt, n=rng.choice([1, 1, 2]), context=130,
                          anchors=(rng.randint(1, len(prompt)),))
            reqs += rs
            for r in rs:
                exp[r.rid] = expected(prompt, mt)
        doomed = {f"r{i}" for i in rng.sample(range(14), 3)}

        def on_step(step, doomed=doomed, sched=sched):
            if step in (2, 5, 9):
                for d in list(doomed)[: step % 3 + 1]:
                    sched.abort(d)

        out = run(sched, model, reqs, on_step=on_step)
        for r in reqs:
            if r.finish_reason == "abort":
                assert r.request_id in doomed
                assert out[r.rid] == exp[r.rid][:len(out[r.rid])]
            else:
                assert out[r.rid] == exp[r.rid], (seed, r.rid)
        assert_all_returned(sched)
        preemptions += sched.num_preemptions
        aborts += sum(r.finish_reason == "abort" for r in reqs)
        hits += sched.prefix_hit_tokens
    assert preemptions > 0 and aborts > 0 and hits > 0, (preemptions, aborts, hits)
