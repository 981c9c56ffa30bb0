"""Anchors the cache finds without message starts (a raw-prompt client: /v1/completions, token ids):
ghosts where a prompt leaves a sequence seen before whose KV is gone, the re-creation of an evicted
anchor by the next insert that passes it, with a known reuse interval; and the raw-prompt traces of
bench/cache_sim.py through the real Scheduler against the chat route's figures."""

from __future__ import annotations

import pytest

from swaserve.bench.cache_sim import KEEP_EVERYTHING, NO_ANCHORS, NO_MESSAGE_ANCHORS, Geometry, simulate
from swaserve.bench.cache_traces import TraceShape, make_trace
from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from tests.engine.kvcache.reference import CheckedCache
from tests.engine.kvcache.test_retention import anchors


def mk(P: int = 4, W: int = 8) -> CheckedCache:
    return CheckedCache(SWARadixCache(P, W, PageAllocator(256), PageAllocator(128), swa_retain_tokens=0))


def put(cc: CheckedCache, ids: list[int], **kw) -> None:
    n = len(ids) // cc.P
    cc.insert(ids, cc.c.full_alloc.alloc(n), cc.c.swa_alloc.alloc(n), **kw)
    cc.c.check_integrity(0, 0)


def test_next_turn_re_creates_the_evicted_sequence_end_with_its_interval() -> None:
    cc = mk()
    turn1 = list(range(100, 140))  # prompt 24 + output: the finished sequence ends at page 10
    put(cc, turn1, prompt_len=24, finished=True)
    for _ in range(3):
        cc.match(list(range(500, 520)))  # other traffic: the clock moves
    cc.evict_swa(1000)  # every window gone; the anchors leave ghosts
    assert not anchors(cc.c)
    turn2 = turn1 + list(range(200, 212))
    assert cc.match(turn2).reused_len == 0  # the window at page 10 is gone, its full KV is not
    put(cc, turn2, prompt_len=len(turn2))  # the next turn passes page 10: anchored again, its history kept
    an = anchors(cc.c)[10]
    assert an.interval == 4 and not an.branched


def test_a_prompt_that_leaves_an_evicted_sequence_learns_the_point() -> None:
    cc = mk()
    system = list(range(100, 120))  # page 5
    put(cc, system + list(range(300, 308)), prompt_len=28)
    cc.evict_full(1000)  # the tree is empty: only the page boundaries seen are remembered
    assert not cc.c._nodes
    second = system + list(range(400, 408))
    assert cc.match(second).reused_len == 0
    put(cc, second, prompt_len=28)  # the insert anchors the learned divergence point
    an = anchors(cc.c)[5]
    assert an.branched and an.interval == 1  # the earlier sequence passed page 5 one match before
    # a conversation: its earlier sequence ended at the point, so the next turn extends it (not a branch)
    cc = mk()
    turn1 = list(range(100, 132))
    put(cc, turn1, prompt_len=20, finished=True)
    cc.evict_full(1000)
    turn2 = turn1 + list(range(200, 212))
    cc.match(turn2)
    put(cc, turn2, prompt_len=len(turn2))
    an = anchors(cc.c)[8]
    assert not an.branched and an.interval == 1


def test_no_anchors_at_all_learns_nothing() -> None:
    cc = CheckedCache(SWARadixCache(4, 8, PageAllocator(256), PageAllocator(128), swa_retain_tokens=0,
                                    anchors=False))
    put(cc, list(range(100, 140)), prompt_len=24, finished=True)
    cc.match(list(range(100, 152)))
    assert not anchors(cc.c) and not cc.c.retention.seen and not cc.c.retention.ghosts


@pytest.mark.parametrize("concurrency", [1, 4])
def test_raw_prompt_multiturn_reaches_the_chat_route(concurrency: int) -> None:
    """The full-size multi-turn trace (8 conversations x 6 turns, page 16, window 1024) at 4 windows, the
    size where the cache's own anchors used to reuse nothing: without message anchors it reaches what
    the chat route reaches, and the ablation without any anchor stays below."""
    trace, geo = make_trace("multiturn"), Geometry(concurrency=concurrency)
    upper = simulate("multiturn", trace, KEEP_EVERYTHING, "roomy", geo).reused_tokens
    chat = simulate("multiturn", trace, "lazy", 4, geo).reused_tokens
    raw = simulate("multiturn", trace, NO_MESSAGE_ANCHORS, 4, geo).reused_tokens
    none = simulate("multiturn", trace, NO_ANCHORS, 4, geo).reused_tokens
    assert raw >= chat and raw >= none and raw >= 0.6 * upper, (raw, chat, none, upper)


def test_raw_prompt_round_robin_fanout_keeps_a_stable_subset() -> None:
    """Round-robin fan-out without message anchors on a small trace: the system prompts' ends are
    learned from the siblings that come back after their KV is gone, and reuse is not zero."""
    shape = TraceShape(groups=8, per_group=6, system_len=256, question_len=16, fanout_answer_len=8)
    geo = Geometry(page_size=4, window=64, chunk=128)
    trace = make_trace("fanout-rr", shape)
    raw = simulate("fanout-rr", trace, NO_MESSAGE_ANCHORS, 2, geo, check=True)
    none = simulate("fanout-rr", trace, NO_ANCHORS, 2, geo)
    assert raw.reused_tokens > none.reused_tokens, (raw.reused_tokens, none.reused_tokens)
