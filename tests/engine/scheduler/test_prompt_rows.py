"""Prompt logprob rows through the scheduler (a checking fake model, the real and the reference prefix
cache): every prompt position's row is produced exactly once, in order, through chunking, a cached
prefix, preemption mid-prefill (re-admission reuses no position past the rows it has) and n > 1; a
max_tokens 0 request finishes once its prompt is in, without a token, and leaves its prompt in the cache."""

from __future__ import annotations

import random

import pytest

from swaserve.engine.core import Req, SamplingParams, TokenLogprob
from swaserve.engine.runner.prompt_logprobs import plan_rows
from swaserve.engine.scheduler import Scheduler, make_reqs
from tests.engine.scheduler.fakes import CheckingModel
from tests.engine.scheduler.test_scheduler import CACHES, assert_all_returned, build, expected


def run_rows(sched: Scheduler, model: CheckingModel, reqs: list[Req]) -> dict[str, list]:
    """Drive the scheduler as the engine does: each step's planned prompt rows are appended (logprob =
    the row's position, so order and gaps show), handed out with the choice's first output."""
    taken: dict[str, list] = {}
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work():
        batch, _ = sched.schedule()
        assert batch is not None, "scheduler stalled with work left"
        for pr in plan_rows(batch):
            assert pr.start == len(pr.req.prompt_logprobs)
            pr.req.prompt_logprobs.extend(TokenLogprob(pr.req.token_ids[pos + 1], float(pos))
                                          for pos in range(pr.start, pr.end))
        for so in sched.update(batch, model(batch)):
            if so.token_id is not None or so.finished:
                got = so.req.take_prompt_logprobs()
                if got is not None:
                    assert so.req.rid not in taken, "handed out twice"
                    taken[so.req.rid] = got
        sched.check_integrity()
        steps += 1
        assert steps < 100000
    return taken


def params(max_tokens: int, k: int | None, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n, prompt_logprobs=k)


def assert_rows(got: list | None, prompt: list[int]) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    assert [lp.logprob for lp in got[1:]] == [float(i) for i in range(len(prompt) - 1)]
    assert [lp.token_id for lp in got[1:]] == prompt[1:]


@pytest.mark.parametrize("kind", CACHES)
def test_rows_once_each_through_cache_and_preemption(kind):
    P, W = 4, 16
    rng = random.Random(3)
    base = [rng.randrange(97) for _ in range(70)]
    prompts = [base[:rng.choice([1, 2, 9, 40, 70])] + [rng.randrange(97) for _ in range(rng.randrange(0, 90))]
               for _ in range(14)]
    prompts = [p or [1] for p in prompts]
    # 50 full pages (200 tokens) for 14 requests of up to 172 tokens: preemption, 4 of them mid-prefill
    sched, model = build(kind, P=P, W=W, full=50, swa=200, max_running=14, chunk=24)
    warm = make_reqs("warm", base, params(3, None), context_length=4096, eos_ids=(), seed=0)
    run_rows(sched, model, warm)  # the shared prefix is in the cache
    mid_prefill: list[str] = []
    preempt = sched._preempt

    def recording(req: Req) -> None:
        if req.prompt_rows_needed and req.prompt_logprobs:
            mid_prefill.append(req.rid)
        preempt(req)

    sched._preempt = recording  # type: ignore[method-assign]
    ks = [None if i % 4 == 3 else i % 3 for i in range(len(prompts))]
    max_tokens = [0 if i % 5 == 0 else 12 for i in range(len(prompts))]
    reqs = [r for i, p in enumerate(prompts)
            for r in make_reqs(f"r{i}", p, params(max_tokens[i], ks[i], n=1 + (i == 4)), context_length=4096,
                               eos_ids=(), seed=0)]
    taken = run_rows(sched, model, reqs)
    assert sched.num_preemptions > 0 and mid_prefill, (sched.num_preemptions, mid_prefill)
    for r in reqs:
        i = int(r.request_id[1:])
        assert r.output_ids == expected(prompts[i], max_tokens[i]), r.rid
        assert r.finish_reason == "length"
        if ks[i] is None:
            assert r.rid not in taken
        else:
            assert_rows(taken.get(r.rid), prompts[i])
    assert_all_returned(sched)


@pytest.mark.parametrize("kind", CACHES)
def test_prompt_logprob_request_reuses_nothing_and_leaves_its_prompt(kind):
    P = 4
    sched, model = build(kind, P=P, W=16, chunk=16)
    prompt = list(range(3, 50))
    run_rows(sched, model, make_reqs("a", prompt, params(2, None), context_length=4096, eos_ids=(), seed=0))
    (b,) = make_reqs("b", prompt, params(0, 1), context_length=4096, eos_ids=(), seed=0)
    taken = run_rows(sched, model, [b])
    assert b.cached_tokens == 0 and b.output_ids == [] and b.finish_reason == "length"
    assert_rows(taken["b"], prompt)
    longer = prompt + [7, 8, 9, 10, 11]
    (c,) = make_reqs("c", longer, params(1, None), context_length=4096, eos_ids=(), seed=0)
    run_rows(sched, model, [c])
    assert c.cached_tokens == len(prompt) // P * P  # b's whole pages are in the cache
    assert_all_returned(sched)
