"""The retention rules (engine/kvcache/radix/retention.py), one scenario each: redundant windows first, the
finished sequence end outliving the older anchors of its conversation, a stable subset under
round-robin pressure, reuse history carried by ghosts and by a conversation's next turn, branch points
remembered after their siblings are evicted. The property tests check the same rules against the
brute-force reference on random interleavings."""

from __future__ import annotations

import random

from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from tests.engine.kvcache.sim import Sim, SimReq, random_tokens


def mk(P: int = 4, W: int = 8, budget: int = 0, swa: int = 64) -> SWARadixCache:
    return SWARadixCache(P, W, PageAllocator(256), PageAllocator(swa), swa_retain_tokens=budget)


def put(c: SWARadixCache, ids: list[int], **kw):
    n = len(ids) // c.page_size
    r = c.insert(ids, c.full_alloc.alloc(n), c.swa_alloc.alloc(n), **kw)
    c.check_integrity(0, 0)
    return r


def anchors(c: SWARadixCache) -> dict[int, object]:
    """page -> Anchor over the whole tree (paths in these tests have distinct depths)."""
    return {hi: an for nd in c._nodes for hi, an in nd.anchors.items()}


def test_redundant_window_goes_first() -> None:
    c = mk()
    conv, other = list(range(100, 140)), list(range(300, 340))
    put(c, conv[:24], prompt_len=24)  # turn 1's prompt end at page 6
    put(c, conv, prompt_len=24, finished=True)  # its finished sequence end at page 10: page 6 is redundant
    put(c, other, prompt_len=40)  # an unrelated, older-looking window would be next in LRU order
    c.match(conv + [1])  # `conv` is now the most recently used
    assert c.evict_swa(6 + 8) == 14  # the unprotected pages of both paths (windows: 2 pages each)
    red, rest = c.anchors_in_order()
    assert [hi for _, hi in red] == [6] and sorted(hi for _, hi in rest) == [10, 10]
    assert c.evict_swa(1) == 1  # page 6's window goes first, although `other` is the less recent path
    assert set(anchors(c)) == {10}  # both remaining anchors end at page 10 (one per path)
    assert c.match(conv + [1]).reused_len == 40 and c.match(other + [1]).reused_len == 40
    c.check_integrity(0, 0)


def test_branch_point_is_never_redundant_even_after_its_sibling_is_gone() -> None:
    c = mk(swa=128)
    system = list(range(100, 120))
    put(c, system + [7] * 8, anchors=(20,), finished=True)  # first sibling: page 5 shadowed by page 7
    red, _ = c.anchors_in_order()
    assert [hi for _, hi in red] == [5]  # one request alone looks like a conversation
    put(c, system + [9] * 8, anchors=(20,), finished=True)  # a second sibling diverges at page 5
    red, rest = c.anchors_in_order()
    assert not red and anchors(c)[5].branched
    c.check_integrity(0, 0)
    # the same, when the first sibling's KV is gone by the time the second one comes
    c = mk(swa=128)
    put(c, system + [7] * 8, anchors=(20,), finished=True)
    assert c.match(system + [1]).reused_len == 20  # (splits the path at page 5)
    assert c.evict_full(2) == 2  # the leaf [5, 7) goes; page 5 remembers its lost continuation
    (sys_node,) = c.root.children.values()
    assert not sys_node.children and sys_node.lost_keys == {(7, 7, 7, 7)} and not anchors(c)[5].branched
    put(c, system + [7] * 8, anchors=(20,), finished=True)  # the same continuation again: no branch
    assert not anchors(c)[5].branched and [hi for _, hi in c.anchors_in_order()[0]] == [5]
    assert c.evict_full(2) == 2
    put(c, system + [9] * 8, anchors=(20,), finished=True)  # another one: a divergence at page 5
    assert anchors(c)[5].branched and not c.anchors_in_order()[0]
    c.check_integrity(0, 0)


def test_finished_end_outlives_older_anchors_and_inherits_the_rhythm() -> None:
    c = mk(swa=128)
    conv = list(range(100, 160))
    put(c, conv[:20], prompt_len=20, finished=True)  # turn 1 ends at page 5
    assert c.match(conv[:28]).reused_len == 20  # turn 2 reuses through page 5's window ...
    assert anchors(c)[5].interval == 1
    put(c, conv[:28], anchors=(20,), prompt_len=28)  # ... and anchors its prompt end at page 7
    put(c, conv[:32], anchors=(20,), prompt_len=28, finished=True)
    an = anchors(c)
    assert an[7].interval == an[8].interval == 1  # the next turn keeps the conversation's rhythm
    red, rest = c.anchors_in_order()
    assert [hi for _, hi in rest] == [8] and {hi for _, hi in red} == {5, 7}
    c.check_integrity(0, 0)


def test_ghost_restores_the_interval_of_a_recomputed_window() -> None:
    c = mk(swa=64)
    a = list(range(100, 120))
    put(c, a, anchors=(20,))
    c.match(list(range(500, 540)))  # other traffic: the clock moves
    c.match(list(range(600, 640)))
    assert c.evict_swa(64) == 5  # everything, the anchor of `a` included
    assert not anchors(c)
    put(c, a, anchors=(20,))  # recomputed: the anchor comes back with the reuse interval it missed
    assert anchors(c)[5].interval == 2 and anchors(c)[5].last_use == 2
    c.check_integrity(0, 0)


def _round_robin(policy_anchors: bool) -> list[list[int]]:
    """Eight prefixes of 512 tokens served round-robin, five rounds, with room for about four windows."""
    P, W, rng = 16, 256, random.Random(3)
    prefixes = [random_tokens(rng, 512) for _ in range(8)]
    running = W // P + 512 // P + 4
    sim = Sim(P, W, full_pages=4096, swa_pages=4 * (W // P) + running, budget=0, chunk=512, check=True)
    sim.cache.use_anchors = policy_anchors
    rounds = []
    for _ in range(5):
        reqs = [SimReq(p + random_tokens(rng, 16), random_tokens(rng, 4), anchors=(512,)) for p in prefixes]
        rounds.append(sim.run(reqs))
    sim.verify()
    return rounds


def test_round_robin_keeps_a_stable_subset_instead_of_thrashing() -> None:
    rounds = _round_robin(policy_anchors=True)
    hits = [sum(r == 512 for r in rnd) for rnd in rounds]
    # round 1 is cold; in round 2 nothing has a reuse history yet (LRU among never-reused windows, which
    # thrashes); from round 3 on the recomputed windows know their interval (ghosts) and the prefixes
    # whose next use is furthest away give way: most prefixes hit in every round (Belady's choice in a
    # cycle: the victim is the window used last, so the two that miss rotate)
    assert hits[:2] == [0, 0] and all(h >= 5 for h in hits[2:]), hits
    # plain LRU over pages (no anchors) evicts every prefix just before it comes back
    assert all(r == 0 for rnd in _round_robin(policy_anchors=False) for r in rnd)
