"""Reuse that does not change answers (docs/cache.md): on the default CPU path (native matmuls, q8_0 KV) a
prompt's numbers do not depend on where its prefill chunks start. A prefix served from the radix cache,
computed in chunks of one size, then the rest in chunks of another, gives bit-for-bit the greedy tokens and
their logprobs of a scratch prefill of the whole prompt at a third chunk size; prompt logprobs (which reuse
nothing) are bit-equal across chunk sizes. On the tiny demo model (window 64, crossed) and a 2-layer cut of
the `small` preset (one sliding and one full layer, window 1024, crossed). Before torch_backend's absolute
query blocks these differed by up to 0.09 nats (tools/cpu/chunk_invariance.py), and they fail again with
torch_backend.INVARIANT off."""

from __future__ import annotations

import dataclasses
import random

import pytest

from swaserve.engine.attention import torch_backend
from swaserve.engine.core import SamplingParams
from swaserve.llm import LLM
from swaserve.models.demo import tiny

# model -> (prefix lengths of the eight prompts, tail length, the cached engine's chunk, the scratch one's)
CASES = {"tiny": ((70, 100, 128, 150, 190, 200, 230, 256), 40, 64, 256),
         "small-2L": ((1030, 1100), 60, 512, 2048)}


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory) -> tuple[str, str | None]:
    if request.param == "tiny":
        return "tiny", None
    path = tmp_path_factory.mktemp("m") / "small-2L.gguf"
    small = tiny.PRESETS["small"]
    tiny.PRESETS["small-2L"] = dict(small, num_layers=2, layer_types=("sliding", "full"))
    try:
        tiny.make_model("small-2L", str(path), seed=0, progress=False)
    finally:
        del tiny.PRESETS["small-2L"]
    return "small-2L", str(path)


def engine(path: str | None, chunk: int, cache: str, batch_invariant: bool = False) -> LLM:
    return LLM(path, cache_type=cache, chunked_prefill_size=chunk, max_running_requests=1, cpu_threads=1,
               device="cpu", progress=False, batch_invariant=batch_invariant)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 3000) for _ in range(n)]


@dataclasses.dataclass
class Answer:
    tokens: list[int]
    logprobs: list[float]
    cached: int


def greedy(llm: LLM, prompt: list[int]) -> Answer:
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True))
    assert o.logprobs is not None
    return Answer(o.token_ids, [lp.logprob for lp in o.logprobs], o.cached_tokens)


# not strict: whether the old blocks' rounding reaches the compared numbers depends on the machine's torch
# kernels (it did on the round-2 CI machines, not on an AVX512 box of round 3, where these pass)
BEFORE = pytest.mark.xfail(strict=False, reason="blocks from each chunk's first row: the chunk boundary "
                           "enters the rounding (the test can fail; on some machines' kernels it does not)")
INVARIANT = pytest.mark.parametrize("invariant", [True, pytest.param(False, marks=BEFORE)],
                                    ids=["invariant", "before"])


def before(monkeypatch, invariant: bool) -> None:
    if not invariant:  # the old blocks: 256 rows from each chunk's first row
        monkeypatch.setattr(torch_backend, "INVARIANT", False)
        monkeypatch.setattr(torch_backend, "QUERY_BLOCK", 256)


@INVARIANT
def test_cached_prefix_gives_the_scratch_answer(model, invariant: bool, monkeypatch) -> None:
    name, path = model
    lens, tail, cached_chunk, scratch_chunk = CASES[name]
    if name != "tiny" and not invariant:
        # two layers over q8_0 KV: the old rounding differences rarely survive into the decoded tokens'
        # logprobs (they show in the prompt logprobs below)
        pytest.skip("before: only the tiny model's decoded tokens show the difference")
    before(monkeypatch, invariant)
    shared = [2] + ids(1, max(lens) - 1)
    warm = shared + ids(2, tail)
    cached, scratch = engine(path, cached_chunk, "radix"), engine(path, scratch_chunk, "naive")
    try:
        greedy(cached, warm)  # puts `shared` (and more) into the radix cache
        diffs = []
        for i, n in enumerate(lens):
            prompt = shared[:n] + ids(10 + i, tail)
            a, b = greedy(cached, prompt), greedy(scratch, prompt)
            assert 0 < a.cached < len(prompt) and b.cached == 0  # a partial hit vs nothing reused
            diffs.append(max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
            assert a.tokens == b.tokens, (n, a, b)
        assert max(diffs) == 0.0, diffs
    finally:
        cached.close()
        scratch.close()


@INVARIANT
def test_prompt_logprobs_do_not_depend_on_the_chunk_size(model, invariant: bool, monkeypatch) -> None:
    name, path = model
    before(monkeypatch, invariant)
    lens, tail, chunk_a, chunk_b = CASES[name]
    prompt = [2] + ids(3, max(lens) + tail - 1)
    rows = []
    for chunk in (chunk_a, chunk_b, 100):
        llm = engine(path, chunk, "naive")
        try:
            (o,) = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
        finally:
            llm.close()
        assert o.prompt_logprobs is not None
        rows.append([(lp.logprob, lp.top) for lp in o.prompt_logprobs[1:] if lp is not None])
    assert rows[0] == rows[1] == rows[2]


@pytest.mark.parametrize("batch_invariant", [True, pytest.param(False, marks=pytest.mark.xfail(
    strict=True, reason="decode-written KV: the one-row kernel's rounding, a scratch prefill: the blocks'"))],
    ids=["batch-invariant", "default"])
def test_a_generated_turn_reused_gives_the_scratch_answer(batch_invariant: bool) -> None:
    """The next turn's prompt = the last prompt + its greedy output + more: its cached prefix holds KV that
    decode steps wrote. Bit-equal to a scratch prefill only under --batch-invariant (tiny)."""
    cached, scratch = engine(None, 64, "radix", batch_invariant), engine(None, 256, "naive", batch_invariant)
    try:
        for seed in range(4):
            cached.engine.flush_cache()
            first = [2] + ids(100 + seed, 149)
            (o,) = cached.generate([first], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            nxt = first + o.token_ids + ids(200 + seed, 20)
            a, b = greedy(cached, nxt), greedy(scratch, nxt)
            assert a.cached > len(first)  # the hit reaches into the generated turn
            assert a.tokens == b.tokens and a.logprobs == b.logprobs, (seed, a, b)
    finally:
        cached.close()
        scratch.close()


def test_batch_invariant_needs_the_native_path() -> None:
    with pytest.raises(ValueError, match="--batch-invariant"):
        LLM(None, cpu_matmul="exact", batch_invariant=True, device="cpu")
