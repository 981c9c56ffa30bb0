"""Concurrent schedules through the real Scheduler over the real SWA radix cache (issue 28 item 4): random
interleavings of arrivals (admission, chunked prefill, decode), aborts and finishes for N requests that
share prefixes, in pools small enough to evict and preempt, in strict arrival order and with cache-aware
admission (--admission-policy cache-aware). Every step the checking model reads back every position the
step attends to (reused pages included) and compares its tokens, the cache's and the pools' invariants hold
after every step, greedy outputs of the requests not aborted are the expected ones, and once the cache is
flushed no page is left handed out."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.scheduler.test_scheduler import build, expected, reqs_for

W, CHUNK = 16, 32


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    P = draw(st.sampled_from([1, 2, 4]))
    running = draw(st.sampled_from([2, 4, 8]))
    bases = [draw(st.lists(st.integers(3, 96), min_size=0, max_size=60)) for _ in range(3)]
    reqs = []
    for _ in range(draw(st.integers(2, 9))):
        prompt = draw(st.sampled_from(bases)) + draw(st.lists(st.integers(3, 96), min_size=1, max_size=40))
        anchors = tuple(draw(st.lists(st.integers(1, len(prompt)), max_size=2)))
        reqs.append(dict(prompt=prompt, max_tokens=draw(st.integers(1, 12)), anchors=anchors,
                         arrive=draw(st.integers(0, 24)), abort=draw(st.none() | st.integers(0, 40))))
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in reqs)
    swa = running * (-(-W // P) + 2) + -(-CHUNK // P) + 1 + draw(st.integers(0, 3 * W // P))
    full = -(-longest // P) + 2 + draw(st.integers(0, 40))  # one request always fits alone
    # --admission-policy and --admission-max-wait (cache-aware admission; None: measured costs alone)
    admission = draw(st.sampled_from([("fcfs", None), ("cache-aware", 2), ("cache-aware", 50),
                                      ("cache-aware", None)]))
    return dict(P=P, running=running, swa=swa, full=full, reqs=reqs, admission=admission)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_concurrent_schedules_read_only_correct_kv_and_leak_nothing(s: dict) -> None:
    sched, model = build("real", P=s["P"], W=W, full=s["full"], swa=s["swa"], max_running=s["running"],
                         chunk=CHUNK, admission=s["admission"][0], admission_max_wait=s["admission"][1])
    reqs = [reqs_for(f"q{i}", r["prompt"], r["max_tokens"], anchors=r["anchors"])[0]
            for i, r in enumerate(s["reqs"])]
    step = 0
    while step < 5000:
        for i, r in enumerate(s["reqs"]):
            if r["arrive"] == step:
                sched.add(reqs[i])
            if r["abort"] == step and r["arrive"] <= step:
                sched.abort(reqs[i].request_id)
        if step > 40 and not sched.has_work():
            break
        batch, _ = sched.schedule()
        if batch is not None:
            assert batch.num_tokens <= CHUNK and len(sched.running) <= s["running"]
            sched.update(batch, model(batch))  # the model checks every position the step reads
            prompt = batch.prefill_tokens
            sched.admission.costs.record(prompt, 0.01 + 0.001 * prompt)  # a made-up step time
        sched.check_integrity()
        step += 1
    assert not sched.has_work(), "the scheduler stalled"
    for r, spec in zip(reqs, s["reqs"]):
        assert r.finished
        if r.finish_reason != "abort":
            assert r.output_ids == expected(spec["prompt"], spec["max_tokens"]), r.rid
    kv = sched.kv
    kv.cache.check_integrity(used_full=0, used_swa=0)
    kv.cache.reset()
    assert kv.full_alloc.num_used == kv.swa_alloc.num_used == 0, "pages leaked"
