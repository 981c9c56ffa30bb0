"""Whatever one request's data breaks inside the engine loop fails that request alone (issue 24, item 1):
its add (any exception, not only RequestError), its text in a step's output path (detokenizing, stop
strings), the flush of its held-back text when it finishes or is aborted. The loop lives on, a
neighbour's stream finishes with the same tokens as alone, every page comes back and the request's id
is free again.

The faults are injected with a TextStream that raises for marked stop strings (the engine builds one
per choice), so the tests hold whatever the real stop automaton does."""

from __future__ import annotations

import asyncio

import pytest

from swaserve.engine import engine as engine_module
from swaserve.engine.client.in_process import AsyncEngine
from swaserve.engine.core import RequestFailed, SamplingParams
from swaserve.engine.text.text_stream import TextStream
from swaserve.llm import LLM

KW = {"chunked_prefill_size": 96, "max_running_requests": 8, "device": "cpu", "cpu_threads": 1}
PROMPT = [2] + [(7 * j) % 800 + 3 for j in range(30)]
LONG = 600  # the neighbour's tokens: it is still running when the broken request fails


class TrappedTextStream(TextStream):
    """Raises where a stop string says: BOOM-ADD (built), BOOM-PUSH (third token), BOOM-FINISH (flush)."""

    def __init__(self, tokenizer, stop, *args, **kw):
        if "BOOM-ADD" in stop:
            raise RecursionError("maximum recursion depth exceeded")
        super().__init__(tokenizer, stop, *args, **kw)
        self.pushed = 0

    def push(self, token_id: int):
        self.pushed += 1
        if "BOOM-PUSH" in self.stop and self.pushed == 3:
            raise IndexError("the stop automaton walked off its table")
        return super().push(token_id)

    def finish(self):
        if "BOOM-FINISH" in self.stop:
            raise KeyError("held-back text")
        return super().finish()


@pytest.fixture(scope="module")
def engine():
    mp = pytest.MonkeyPatch()
    mp.setattr(engine_module, "TextStream", TrappedTextStream)
    llm = LLM(None, **KW)
    eng = AsyncEngine(llm.engine)
    eng.start()
    yield eng
    eng.close()
    mp.undo()


def params(n: int, *stop: str) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=list(stop))


async def collect(eng: AsyncEngine, rid: str, p: SamplingParams) -> list[int]:
    return [t async for out in eng.generate(rid, PROMPT, p) for t in out.token_ids]


def settle(eng: AsyncEngine) -> None:
    for _ in range(400):
        s = eng.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["full_pool"]["used"] == 0:
            return
        asyncio.run(asyncio.sleep(0.05))
    raise AssertionError(f"pages still held: {eng.stats()}")


@pytest.fixture(scope="module")
def alone(engine) -> list[int]:
    return asyncio.run(collect(engine, "alone", params(LONG)))


@pytest.mark.parametrize("trap", ["BOOM-ADD", "BOOM-PUSH", "BOOM-FINISH"])
def test_a_request_that_breaks_the_loop_fails_alone(engine, alone, trap):
    async def main():
        neighbour = asyncio.create_task(collect(engine, f"n-{trap}", params(LONG)))
        await asyncio.sleep(0.05)  # the neighbour is running
        with pytest.raises(RequestFailed, match=f"request b-{trap} failed in the engine"):
            await collect(engine, f"b-{trap}", params(6, trap))
        assert not neighbour.done()  # it shared the failing steps
        return await neighbour

    assert asyncio.run(asyncio.wait_for(main(), timeout=120)) == alone
    settle(engine)
    assert engine.core._open == {} and engine.core._texts == {}
    again = asyncio.run(asyncio.wait_for(collect(engine, f"b-{trap}", params(4)), timeout=120))  # id free
    assert len(again) == 4
    engine.check_available()


def test_an_aborted_request_whose_flush_breaks_fails_alone(engine, alone):
    """Aborted: its held-back text is flushed at the next step's start; that raising must not fail the
    step (every request in it) but only the aborted one."""

    async def main():
        neighbour = asyncio.create_task(collect(engine, "n-abort", params(LONG)))
        agen = engine.generate("b-abort", PROMPT, params(200, "BOOM-FINISH"))
        await agen.__anext__()
        await agen.aclose()  # abort: Engine.step finishes it with a flush, which raises
        await asyncio.sleep(0.2)
        assert not neighbour.done()  # it shared the step that flushed the aborted request
        return await neighbour

    assert asyncio.run(asyncio.wait_for(main(), timeout=120)) == alone
    settle(engine)
    assert engine.core._open == {}
