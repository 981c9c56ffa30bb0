"""Cache-aware admission (--admission-policy cache-aware, issue 28 item 2; engine/scheduler/admission.py):
while other requests run, a waiting request whose pages would have to come from a cached window predicted
to be reused soon waits, no longer than recomputing that reuse would cost by the measured step times
(capped by --admission-max-wait), and later requests that fit go first. The scheduling rule with the page
counts stubbed (who waits, for how long, in which order), the cost bound, the hot-window count on the
real cache, and the rows of the issue's traces that strict arrival order leaves below 0.9 of their
one-at-a-time reuse."""

from __future__ import annotations

import pytest

from swaserve.bench.cache_sim import KEEP_EVERYTHING, Geometry, simulate
from swaserve.bench.cache_traces import make_trace
from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from swaserve.engine.scheduler.admission import StepCosts
from tests.engine.scheduler.test_scheduler import build, expected, reqs_for


def stubbed(wait: int | None, cold: int = 100, policy: str = "cache-aware", hot_tokens: int = 4096):
    """A scheduler whose requests named m* need more SWA pages than the pools hold cold (a miss that would
    evict a hot window reusing hot_tokens) and the others one page (a hit). Costs unmeasured."""
    sched, model = build("real", max_running=4, admission=policy, admission_max_wait=wait)
    sched.kv.swa_need = lambda req, chunk: 10**6 if req.rid.startswith("m") else 1
    sched.kv.cold_room = lambda hot_pages: cold
    sched.kv.cache.hot_windows = lambda: (0, hot_tokens)
    return sched, model


def step(sched, model) -> None:
    batch, _ = sched.schedule()
    assert batch is not None
    sched.update(batch, model(batch))
    sched.check_integrity()


def steps_waited(sched, model) -> int:
    """Run a long request, then a miss behind it: the steps from the miss's first wait to its admission."""
    (long,) = reqs_for("long", [1, 2, 3, 4, 5], 40)
    (miss,) = reqs_for("miss", [9] * 30, 3)
    sched.add(long)
    step(sched, model)
    sched.add(miss)
    step(sched, model)
    first = miss.deferred_at
    assert first is not None
    while miss in sched.waiting:
        step(sched, model)
    return sched.steps - first


def test_a_miss_waits_behind_a_hit_for_at_most_n_steps() -> None:
    sched, model = stubbed(wait=5)
    (long,) = reqs_for("long", [1, 2, 3, 4, 5], 40)
    (miss,) = reqs_for("miss", [9] * 30, 3)
    (hit,) = reqs_for("hit", [7] * 6, 3)
    sched.add(long)
    step(sched, model)  # nothing ran: the first request is admitted whatever it needs
    assert long in sched.running
    sched.add(miss)
    sched.add(hit)
    step(sched, model)
    assert hit in sched.running and miss in sched.waiting and miss.deferred_at is not None
    assert sched.admission.stats()["waited_requests"] == 1
    first = miss.deferred_at
    while miss in sched.waiting:
        assert sched.steps - first < 5 + 1, "waited past --admission-max-wait"
        step(sched, model)
    assert sched.steps - first == 5 and long in sched.running  # admitted at the bound, not before
    while sched.has_work():
        step(sched, model)
    assert miss.output_ids == expected([9] * 30, 3) and hit.output_ids == expected([7] * 6, 3)


@pytest.mark.parametrize("policy,wait", [("fcfs", 5), ("cache-aware", None)])
def test_strict_arrival_order(policy: str, wait: int | None) -> None:
    """fcfs whatever the cap; cache-aware with nothing measured and no cap: nothing waits yet."""
    sched, model = stubbed(wait=wait, policy=policy)
    (long,) = reqs_for("long", [1, 2, 3, 4, 5], 40)
    (miss,) = reqs_for("miss", [9] * 30, 3)
    (hit,) = reqs_for("hit", [7] * 6, 3)
    sched.add(long)
    step(sched, model)
    sched.add(miss)
    sched.add(hit)
    step(sched, model)
    assert miss in sched.running and miss.deferred_at is None


def test_a_miss_goes_as_soon_as_nothing_runs_or_it_fits_cold() -> None:
    sched, model = stubbed(wait=1000)
    (short,) = reqs_for("short", [1, 2, 3], 2)
    (miss,) = reqs_for("miss", [9] * 30, 2)
    sched.add(short)
    step(sched, model)
    sched.add(miss)
    steps = 0
    while miss in sched.waiting:
        step(sched, model)
        steps += 1
    assert short.finished and steps <= 3  # admitted once the running request finished
    sched2, model2 = stubbed(wait=1000, cold=10**7)  # enough cold pages: no wait at all
    (short2,) = reqs_for("short", [1, 2, 3], 2)
    (miss2,) = reqs_for("miss", [9] * 30, 2)
    sched2.add(short2)
    step(sched2, model2)
    sched2.add(miss2)
    step(sched2, model2)
    assert miss2 in sched2.running and miss2.deferred_at is None


def test_the_wait_bound_is_what_the_saved_recompute_costs() -> None:
    costs = StepCosts()
    assert costs.steps_worth(4096) is None
    costs.record(0, 0.1)  # a decode step: 100 ms
    costs.record(2048, 0.1 + 2048 / 40)  # a chunk: 40 prompt tok/s on top
    assert costs.steps_worth(4096) is not None and abs(costs.steps_worth(4096) - 1024) <= 1
    first = StepCosts()  # a prefill step before any decode-only step counts once a step's cost is known
    first.record(1000, 0.1 + 1000 / 40)
    assert first.token_s is None
    first.record(0, 0.1)
    assert first.token_s is not None and abs(first.token_s - 1 / 40) < 1e-9
    sched, model = stubbed(wait=None, hot_tokens=40)  # a hot hit saves 1 s: 10 steps of 100 ms
    sched.admission.costs = costs
    assert steps_waited(sched, model) == 10
    sched, model = stubbed(wait=3, hot_tokens=40)  # the cap is lower than the measured bound
    sched.admission.costs = costs
    assert steps_waited(sched, model) == 3


def test_hot_windows_are_those_with_a_reuse_due() -> None:
    P, W = 4, 16
    fa, sa = PageAllocator(200), PageAllocator(200)
    cache = SWARadixCache(P, W, fa, sa, swa_retain_tokens=0)
    ids = list(range(100, 164))  # 16 pages; its prompt end anchors the window of pages [12, 16)
    full, swa = fa.alloc(16), sa.alloc(16)
    res = cache.insert(ids, full, swa, prompt_len=len(ids))
    assert cache.hot_windows() == (0, 0)  # never reused: nothing predicted
    probe = ids + [5, 6, 7, 8, 9]
    for _ in range(2):  # two reuses through the anchor: an interval of one match
        m = cache.match(probe)
        assert m.reused_len == len(ids)
    assert cache.hot_windows() == (W // P, len(ids))  # the window, unlocked, is due again next match
    cache.lock(res.handle)
    assert cache.hot_windows() == (0, len(ids))  # locked pages are not evictable, hot or not
    cache.unlock(res.handle)
    for _ in range(3):
        cache.match([1] * 20)  # other prompts: the window is overdue
    assert cache.hot_windows() == (0, 0)


@pytest.mark.parametrize("workload,windows", [("mixed-rr", 4), ("fanout-rr", 4)])
def test_waiting_keeps_nine_tenths_of_sequential_reuse(workload: str, windows: int) -> None:
    """Split pools at 4 windows, 4 in flight: strict arrival order keeps 0.80 (mixed-rr) / 0.95 (fan-out)
    of one-at-a-time reuse; cache-aware admission on the modelled CPU step times keeps more than one at a
    time gets, in less modelled time."""
    trace = make_trace(workload)
    upper = simulate(workload, trace, KEEP_EVERYTHING, windows, Geometry()).reused_tokens
    one = simulate(workload, trace, "lazy", windows, Geometry()).reused_tokens / upper
    strict = simulate(workload, trace, "lazy", windows, Geometry(concurrency=4))
    fcfs = strict.reused_tokens / upper
    row = simulate(workload, trace, "lazy", windows, Geometry(concurrency=4, admission="cache-aware"))
    assert one > 0.2
    ratio = row.reused_tokens / upper
    assert ratio >= 0.9 * one and ratio >= fcfs + 0.1, (one, fcfs, ratio)
    assert row.modelled_s < strict.modelled_s, (row.modelled_s, strict.modelled_s)


@pytest.mark.parametrize("flag,want", [("auto", "cache-aware"), ("fcfs", "fcfs"),
                                       ("cache-aware", "cache-aware")])
def test_auto_is_cache_aware_on_cpu(flag: str, want: str) -> None:
    """The engine builder resolves --admission-policy auto by device: cache-aware on CPU (fcfs on CUDA),
    and the engine feeds the scheduler its measured step costs."""
    from swaserve.engine.core import SamplingParams
    from swaserve.llm import LLM

    llm = LLM(None, admission_policy=flag, device="cpu", progress=False, cpu_threads=1)
    try:
        sched = llm.engine.scheduler
        assert sched.cfg.admission_policy == want and sched.admission.enabled == (want == "cache-aware")
        llm.generate([[2] + list(range(300, 400))], SamplingParams(max_tokens=4, temperature=0.0))
        assert sched.admission.costs.step_s is not None and sched.admission.costs.token_s is not None
        st = llm.engine.stats()["admission"]
        assert st["policy"] == want and st["waited_requests"] == 0 and st["step_ms"] > 0
    finally:
        llm.close()
