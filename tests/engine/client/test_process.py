"""The engine in its own process (EngineProcessClient): the same outputs as the in-process engine, errors
before any output, aborts, flush, a failed load, and a dead engine that fails its streams instead of
hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from swaserve.engine.args import engine_config_from_kwargs
from swaserve.engine.client.process import EngineDied, EngineProcessClient
from swaserve.engine.client.restart import RestartPolicy
from swaserve.engine.config import EngineConfig
from swaserve.engine.core import RequestError, SamplingParams
from swaserve.llm import LLM

KW = {"chunked_prefill_size": 96, "max_running_requests": 8, "device": "cpu", "cpu_threads": 1}


def build_demo_engine(cfg: EngineConfig):
    """The engine factory run in the child (module level: the spawned process imports it by name)."""
    from swaserve.engine.engine import Engine
    from swaserve.models.architectures import load_model

    return Engine(cfg, load_model(cfg, progress=False))


def build_engine_marking_close(cfg: EngineConfig):
    """build_demo_engine whose close() writes engine.closed and the tier's writer state to $CLOSE_MARK."""
    eng = build_demo_engine(cfg)
    close = eng.close

    def marked() -> None:
        close()
        thread = eng.tier.io.thread
        with open(os.environ["CLOSE_MARK"], "w") as f:
            f.write(f"{eng.closed} {thread.is_alive()} {eng.tier.stats()['pending_writes']}")

    eng.close = marked
    return eng


def fail_to_load(cfg: EngineConfig):
    raise ValueError("--model broken.gguf: not a GGUF file")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def client():
    c = EngineProcessClient(build_demo_engine, engine_config_from_kwargs(None, **KW), start_timeout=600)
    yield c
    c.shutdown()


async def _collect(client: EngineProcessClient, rid: str, ids: list[int], params: SamplingParams) -> list:
    return [out async for out in client.generate(rid, ids, params)]


def test_outputs_match_the_in_process_engine(client):
    """The same greedy tokens as the in-process engine. Requests reach the engine process at other times, so
    the batches differ (prefill chunks and decode rows mixed otherwise) and the logits move by ~1e-3: where a
    sequence diverges, the in-process run must show a near-tie there (its top two within 0.02 nats, the
    process's token one of them; prompt 4's last token has a 0.0106 gap and flipped once in CI), and the rest
    of that sequence is not compared."""
    prompts = [[2] + [(7 * i + 3 * j) % 900 + 3 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    expected = LLM(None, **KW).generate(prompts, params)

    async def main():
        return await asyncio.gather(*[_collect(client, f"r{i}", p, params) for i, p in enumerate(prompts)])

    exact = 0
    for outs, exp in zip(asyncio.run(main()), expected):
        got = [t for o in outs for t in o.token_ids]
        assert len(got) == len(exp.token_ids) == 6
        diverged = next((i for i, (a, b) in enumerate(zip(got, exp.token_ids)) if a != b), None)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        if diverged is None:
            exact += 1
            assert "".join(o.text for o in outs) == exp.text
            continue
        (t1, l1), (t2, l2) = exp.logprobs[diverged].top[:2]
        assert abs(l1 - l2) < 0.02 and got[diverged] in (t1, t2), (diverged, got, exp.token_ids, exp.logprobs)
    assert exact >= 4, exact
    assert client.tokenizer.decode(expected[0].token_ids) is not None
    s = client.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["full_pool"]["used"] == 0


def test_errors_come_before_any_output(client):
    async def first(ids, params):
        async for out in client.generate("bad", ids, params):
            return out

    with pytest.raises(RequestError, match="max_tokens") as e:
        asyncio.run(first([5] * 10, greedy(client.context_length)))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="outside the vocabulary"):
        asyncio.run(first([client.model_config.vocab_size + 5], greedy(1)))
    with pytest.raises(RequestError, match="temperature"):
        asyncio.run(first([5] * 10, SamplingParams(temperature=5.0)))


def test_abort_frees_pages_and_flush(client):
    async def main():
        agen = client.generate("long", [2] + [11] * 200, greedy(400))
        n = 0
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        for _ in range(200):  # the abort is applied on the engine's next step
            await asyncio.sleep(0.05)
            if client.stats()["running"] == 0:
                break
        return await client.flush_cache()

    assert asyncio.run(main()) is True
    s = client.stats()
    assert s["running"] == 0 and s["full_pool"]["used"] == 0 and s["full_pool"]["cached"] == 0


def test_a_failed_load_raises_its_error():
    with pytest.raises(ValueError, match="not a GGUF file"):
        EngineProcessClient(fail_to_load, engine_config_from_kwargs(None, **KW), start_timeout=600)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_dead_engine_fails_streams_instead_of_hanging():
    c = EngineProcessClient(build_demo_engine, engine_config_from_kwargs(None, **KW), start_timeout=600,
                            policy=RestartPolicy(restarts=0))
    try:
        async def main():
            agen = c.generate("doomed", [2] + [13] * 50, greedy(2000))
            await agen.__anext__()  # the request is running
            os.kill(c._process.pid, signal.SIGKILL)
            with pytest.raises(EngineDied):
                async for _ in agen:
                    pass
            with pytest.raises(EngineDied):
                await _collect(c, "after", [2, 3, 4], greedy(1))

        asyncio.run(asyncio.wait_for(main(), timeout=120))
        assert not c.is_alive()
    finally:
        c.shutdown()


def test_cache_state_over_the_pipe(client):
    """GET /v1/cache/state's engine call: walked in the engine process between steps, even while a
    request runs; totals agree with the pool stats, the recent requests carry their reuse reasons."""
    shared = [2] + [(5 * j) % 700 + 3 for j in range(70)]

    async def main():
        await client.flush_cache()
        await _collect(client, "s0", shared + list(range(11, 31)), greedy(2))  # whole pages past `shared`
        agen = _collect(client, "s1", shared + [21, 22, 23, 24], greedy(30))
        task = asyncio.create_task(agen)
        await asyncio.sleep(0.05)
        during = await client.cache_state(4)  # sliced between the steps of s1
        await task
        return during, await client.cache_state(64)

    during, st = asyncio.run(main())
    assert during["tree"] and len(during["nodes"]) <= 4 and during["slices"] >= 1
    s = client.stats()
    assert st["totals"]["full_pages"] == s["full_pool"]["cached"]
    assert st["totals"]["swa_live_pages"] == s["swa_pool"]["cached"]
    assert st["consistent"] and st["pools"]["full_pool"]["cached"] == s["full_pool"]["cached"]
    recent = {r["request_id"]: r for r in st["recent_requests"]}
    page = st["page_size"]
    assert recent["s0"]["cached_tokens"] == 0 and recent["s0"]["reason"] == "no_match"
    assert recent["s1"]["matched_tokens"] == len(shared)
    assert recent["s1"]["cached_tokens"] == len(shared) // page * page
    assert recent["s1"]["reason"] == ("page_alignment" if len(shared) % page else "no_match")
    assert st["pool_history"] and set(st["pool_history"][-1]) == {"time", "full_pool", "swa_pool"}


def test_the_engine_process_closes_its_engine_at_shutdown(tmp_path, monkeypatch):
    """The engine process closes its Engine when it stops (the KV tier's writes sealed, its thread joined);
    a new engine on the same directory promotes the prompt from the records it wrote."""
    mark = tmp_path / "closed"
    monkeypatch.setenv("CLOSE_MARK", str(mark))
    kw = dict(KW, kv_offload_dir=str(tmp_path / "tier"), kv_offload_gb=0.05, max_total_tokens=512,
              max_running_requests=2,
              swa_tokens=256, cpu_matmul="exact")
    prompt = [2] + [(11 * j) % 900 + 3 for j in range(120)]
    c = EngineProcessClient(build_engine_marking_close, engine_config_from_kwargs(None, **kw),
                            start_timeout=600)
    try:
        first = asyncio.run(_collect(c, "a", prompt, greedy(3)))
        for i in range(3):  # other prompts push the first one out of the arena: into the tier
            big = [2] + [(13 * j + i) % 900 + 5 for j in range(600)]
            asyncio.run(_collect(c, f"b{i}", big, greedy(1)))
    finally:
        c.shutdown()
    assert mark.read_text() == "True False 0"
    with LLM(None, **kw) as llm:
        assert llm.engine.tier.reopened > 0
        (o,) = llm.generate([prompt], greedy(3))
    assert o.cached_tokens > 0 and o.token_ids == [t for x in first for t in x.token_ids]
