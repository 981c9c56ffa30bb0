"""One request can hurt no other: a request whose own data fails while it is served (its sampling row,
its grammar, its text) fails alone, and the other requests' outputs are exactly those of a run
without it (issue 14, item 1)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from swaserve.engine.core import Req, SamplingParams
from swaserve.llm import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(cache_type="radix", chunked_prefill_size=96, max_running_requests=16)


class _BrokenText:
    """A text stream that raises on the first token (a detokenizer / stop-matcher failure)."""

    def push(self, token_id: int) -> tuple[str, str | None]:
        raise UnicodeError("poisoned text stream")

    def finish(self) -> tuple[str, str | None]:
        return "", None


def poison(engine, reqs: list[Req], kind: str) -> None:
    """Make already-validated Reqs fail inside the engine step, the way an unchecked field would."""
    for r in reqs:
        if kind == "top_k_overflow":  # the probe's case: top_k = 2**64 beside a row with a small top_k
            r.params = dataclasses.replace(r.params, temperature=1.0, top_k=2 ** 64)
        elif kind == "wrong_type":  # a field of the wrong type, as an unchecked front end would pass it
            r.params = dataclasses.replace(r.params, temperature=1.0, min_p="0.1")
        elif kind == "bias_outside_vocab":
            r.params = dataclasses.replace(r.params, logit_bias=((engine.tokenizer.vocab_size + 7, 1.0),))
        elif kind == "text":
            engine._texts[r] = _BrokenText()


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], bad: int | None = None,
        kind: str = "") -> dict[str, tuple[list[int], str | None, str | None]]:
    """Run the requests together; request `bad` poisoned. -> rid -> (token ids, finish, error)."""
    eng = llm.engine
    assert eng.flush_cache()  # every run starts from the same (empty) cache
    for i, (p, sp) in enumerate(zip(prompts, params)):
        reqs = eng.make_requests(f"r{i}", p, sp)
        eng.add_reqs(reqs)
        if i == bad:
            poison(eng, reqs, kind)
    got: dict[str, tuple[list[int], str | None, str | None]] = {f"r{i}": ([], None, None)
                                                                for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            ids, _, _ = got[o.request_id]
            got[o.request_id] = (ids + o.token_ids, o.finish_reason if o.finished else None, o.error)
    return got


def assert_clean(eng) -> None:
    s = eng.stats()
    assert s["running"] == s["waiting"] == 0
    for pool in ("full_pool", "swa_pool"):
        assert s[pool]["used"] == 0, s
    eng.scheduler.check_integrity()
    assert eng.flush_cache()


request = st.tuples(
    st.lists(st.integers(3, 255), min_size=2, max_size=40),  # prompt ids (the tiny vocabulary is larger)
    st.integers(2, 6),  # max_tokens
    st.one_of(st.none(), st.integers(0, 2 ** 32)),  # None = greedy, else the seed of a sampled request
)


@settings(max_examples=5, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=2, max_size=5), data=st.data(),
       kind=st.sampled_from(["wrong_type", "bias_outside_vocab", "text"]))
def test_one_poisoned_request_leaves_the_others_identical(llm: LLM, reqs, data, kind: str) -> None:
    bad = data.draw(st.integers(0, len(reqs) - 1), label="poisoned index")
    prompts = [[2] + p for p, _, _ in reqs]
    params = [SamplingParams(max_tokens=m, temperature=0.0) if seed is None else
              SamplingParams(max_tokens=m, temperature=0.9, top_k=40, seed=seed) for _, m, seed in reqs]
    with_bad = run(llm, prompts, params, bad, kind)
    assert_clean(llm.engine)
    keep = [i for i in range(len(reqs)) if i != bad]
    without = run(llm, [prompts[i] for i in keep], [params[i] for i in keep])
    assert_clean(llm.engine)
    ids, finish, error = with_bad[f"r{bad}"]
    assert finish == "abort" and error is not None, with_bad[f"r{bad}"]
    for j, i in enumerate(keep):
        assert with_bad[f"r{i}"] == without[f"r{j}"], (i, kind)
        assert with_bad[f"r{i}"][2] is None


def test_top_k_overflow_beside_a_small_top_k_fails_that_request_only(llm: LLM) -> None:
    """The probe's case: top_k = 2**64 in one request while another samples with top_k = 5 overflowed the
    batched top-k and failed every request in flight. (The server now rejects top_k > vocabulary with a
    400; this is the engine's second line of defence.)"""
    prompts = [[2, 11, 12, 13], [2, 21, 22]]
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_k=5, seed=7),
              SamplingParams(max_tokens=8, temperature=0.9, top_k=5, seed=8)]
    with_bad = run(llm, prompts, params, bad=1, kind="top_k_overflow")
    alone = run(llm, prompts[:1], params[:1])
    assert with_bad["r0"] == alone["r0"] and len(alone["r0"][0]) == 8
    # sampled alone after the batched call failed, its huge top_k means "off": it is served too
    assert with_bad["r1"][1] == "length" and with_bad["r1"][2] is None
    assert_clean(llm.engine)


def test_async_engine_raises_request_failed_for_the_poisoned_request_only(llm: LLM) -> None:
    """Through the asynchronous front the failed request raises RequestFailed; the other completes."""
    import asyncio

    from swaserve.engine.client.in_process import AsyncEngine
    from swaserve.engine.core import RequestFailed

    eng = AsyncEngine(llm.engine)

    async def main() -> tuple[object, list[int]]:
        good_ids: list[int] = []

        async def good() -> None:
            async for o in eng.generate("good", [2, 5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0)):
                good_ids.extend(o.token_ids)

        async def bad() -> BaseException | None:
            orig = llm.engine.add_reqs

            def add_poisoned(reqs: list[Req]) -> None:
                orig(reqs)
                if reqs[0].request_id == "bad":
                    poison(llm.engine, reqs, "bias_outside_vocab")

            llm.engine.add_reqs = add_poisoned  # type: ignore[method-assign]
            try:
                async for _ in eng.generate("bad", [2, 9, 9], SamplingParams(max_tokens=6, temperature=0.0)):
                    pass
            except RequestFailed as e:
                return e
            finally:
                del llm.engine.add_reqs
            return None

        res = await asyncio.gather(bad(), good())
        return res[0], good_ids

    try:
        err, good_ids = asyncio.run(main())
    finally:
        eng.shutdown()
    assert isinstance(err, RequestFailed) and "bad" in str(err)
    assert len(good_ids) == 6
    assert_clean(llm.engine)
