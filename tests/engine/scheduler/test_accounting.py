"""What the scheduler reports and gives back, checked exactly: `cached_tokens` equals the reuse the model
actually started from (also for requests preempted and re-admitted), a preempted request's KV goes back
into the cache, and no cache lock outlives its request (checked after every finish and abort)."""

from __future__ import annotations

import random

import pytest

from swaserve.engine.core import Batch
from swaserve.engine.scheduler import Scheduler
from tests.engine.scheduler.fakes import CheckingModel
from tests.engine.scheduler.test_scheduler import assert_all_returned, build, reqs_for, run
from tests.engine.scheduler.test_scheduler import expected as expected_tokens
from tests.helpers import lcp


class FirstChunk(CheckingModel):
    """The checking model, recording where each request's first computed chunk started: the prefix the
    model really reused at the request's first admission (an oracle independent of the scheduler's own
    bookkeeping)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.first_start: dict[str, int] = {}

    def __call__(self, batch: Batch):
        for r, start in zip(batch.reqs, batch.prefix_lens):
            self.first_start.setdefault(r.rid, start)
        return super().__call__(batch)


def _handle_locks(cache) -> int:
    return sum(nd.handle_locks for nd in cache._nodes)


def _all_lock_counts(cache) -> tuple[int, int, int, int]:
    nodes = list(cache._nodes)
    return (sum(nd.handle_locks for nd in nodes), sum(nd.full_locks for nd in nodes),
            sum(sum(nd.swa_locks) for nd in nodes), cache.full_locked + cache.swa_locked)


def _watch_locks(sched: Scheduler) -> list[int]:
    """After every release (finish, abort, preemption): the handle locks in the tree == the requests
    holding a handle. Returns the list of checks made (for the caller to assert some were)."""
    kv = sched.kv
    release = kv.release
    checks: list[int] = []

    def checked(req, finished):
        release(req, finished)
        holders = sum(1 for r in list(sched.running) + list(sched.waiting)
                      if r.handle is not None and r.handle is not kv.cache.root)  # the root takes no lock
        assert _handle_locks(kv.cache) == holders, (req.rid, _handle_locks(kv.cache), holders)
        checks.append(holders)

    kv.release = checked
    return checks


@pytest.mark.parametrize("seed", range(4))
def test_cached_tokens_is_the_first_admission_reuse_through_preemption(seed):
    """Tight pools (eviction and preemption), shared prefixes: every request reports as cached exactly
    the prefix the model started from at its first admission, capped at the prompt, page-aligned,
    never more than the longest prefix it shares with a request seen before it; a preempted request's
    re-admission (which reuses its prompt and part of its output) does not change it."""
    rng = random.Random(seed)
    P, W = 4, 16
    sched, _ = build("real", P=P, W=W, full=60, swa=60, max_running=6, chunk=24)
    model = FirstChunk(P, W)
    bases = [[rng.randrange(97) for _ in range(rng.randint(20, 50))] for _ in range(2)]
    reqs, prompts = [], []
    for i in range(12):
        b = rng.choice(bases)
        prompt = b[:rng.randint(8, len(b))] + [rng.randrange(97) for _ in range(rng.randint(1, 12))]
        prompts.append(prompt)
        reqs += reqs_for(f"r{i}", prompt, 30)
    _watch_locks(sched)
    out = run(sched, model, reqs)
    assert sched.num_preemptions > 0
    preempted_partial = 0
    for i, r in enumerate(reqs):
        assert out[r.rid] == expected_tokens(prompts[i], 30)
        first = model.first_start[r.rid]
        assert r.cached_tokens == min(first, r.prompt_len), r.rid
        assert r.cached_tokens % P == 0 and r.cached_tokens < r.prompt_len
        shared = max([lcp(prompts[i], prompts[j]) for j in range(i)], default=0)
        assert r.cached_tokens <= shared, (r.rid, r.cached_tokens, shared)
        if r.num_preemptions and r.cached_tokens < (r.prompt_len - 1) // P * P:
            preempted_partial += 1
    # the case that tells "first admission" from "last admission" apart happened
    assert preempted_partial > 0
    assert sched.prefix_hit_tokens == sum(r.cached_tokens for r in reqs)
    assert_all_returned(sched)


def test_cached_tokens_is_the_page_aligned_shared_prefix():
    """Sequential requests, roomy pools: the reuse is exactly the shared prefix rounded down to a page,
    leaving at least one prompt token to compute."""
    P, W = 4, 16
    sched, model = build("real", P=P, W=W)
    rng = random.Random(7)
    base = [rng.randrange(97) for _ in range(60)]
    run(sched, model, reqs_for("a", base, 3))
    for i, S in enumerate([0, 1, 3, 4, 5, 17, 31, 32, 59]):
        prompt = base[:S] + [97 + i] + [rng.randrange(97) for _ in range(5)]
        (r,) = reqs_for(f"b{i}", prompt, 3)
        run(sched, model, [r])
        assert r.cached_tokens == S // P * P, (S, r.cached_tokens)
    (same,) = reqs_for("same", base, 3)
    run(sched, model, [same])
    assert same.cached_tokens == (len(base) - 1) // P * P
    assert_all_returned(sched)


def test_preempted_request_kv_goes_back_into_the_cache():
    P, W = 4, 16
    sched, model = build("real", P=P, W=W, chunk=16)
    prompt = list(range(1, 50))
    (r,) = reqs_for("p", prompt, 20)
    sched.add(r)
    for _ in range(14):  # 4 prefill chunks (49 tokens by 16), then decodes (not inserted as they go)
        batch, _ = sched.schedule()
        sched.update(batch, model(batch))
    computed = r.num_computed
    assert computed >= len(prompt) + 8
    seq = list(r.token_ids)
    sched._preempt(r)
    assert sched.kv.cache.match(seq).reused_len == min(computed, len(seq) - 1) // P * P
    while sched.has_work():
        batch, _ = sched.schedule()
        sched.update(batch, model(batch))
    assert r.output_ids == expected_tokens(prompt, 20)
    assert r.cached_tokens == 0  # the first admission reused nothing
    assert_all_returned(sched)


@pytest.mark.parametrize("policy", ["lazy", "eager"])
def test_no_lock_outlives_its_request(policy):
    """After every finish, abort and preemption the tree holds exactly one handle lock per request that
    holds a handle; at the end every lock count is zero and the cache resets."""
    rng = random.Random(11)
    P, W = 4, 16
    sched, model = build("real", P=P, W=W, full=40, swa=60, max_running=6, chunk=24, policy=policy)
    base = [rng.randrange(97) for _ in range(40)]
    reqs = []
    for i in range(14):
        prompt = base[:rng.randint(1, 40)] + [rng.randrange(97) for _ in range(rng.randint(0, 15))]
        reqs += reqs_for(f"r{i}", prompt, rng.randint(1, 25), n=rng.choice([1, 2]))
    checks = _watch_locks(sched)

    def on_step(step):
        if step in (2, 4, 7, 11):  # running, waiting and never-admitted requests alike
            sched.abort(f"r{step}")

    run(sched, model, reqs, on_step=on_step)
    assert sum(1 for r in reqs if r.finish_reason == "abort") >= 4
    assert sched.num_preemptions > 0 and len(checks) >= len(reqs)
    assert _all_lock_counts(sched.kv.cache) == (0, 0, 0, 0)
    assert_all_returned(sched)
    sched.kv.cache.reset()
    fa, sa = sched.kv.full_alloc, sched.kv.swa_alloc
    assert fa.num_free == fa.num_total and sa.num_free == sa.num_total
