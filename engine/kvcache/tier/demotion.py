"""What an eviction writes to the second tier: `Demoter`, a part of SWARadixCache (pure Python).

A later request can resume from the tier at a point X only if it finds the full KV of [0, X) and the
SWA KV of the window before X (the reuse rule of engine/kvcache/radix/cache.py). Full pages are
therefore written whenever they leave the tree (every one of them is needed by every resume point after
it), but an SWA page is useful only within one window before a point a later request can resume from.
The points written for are the ones retention keeps in the tree (engine/kvcache/radix/retention.py):
  * the anchors (message starts, prompt ends, finished-sequence ends, branch points), also after
    retention has given their windows up (Node.anchored remembers which pages an anchor protected), and
  * the node's end where a request can resume there: a radix branch point, or a leaf that ends a
    sequence (not one a running request is still extending chunk by chunk, nor one whose continuation
    was evicted: that continuation went to the tier); not the end of a prefill chunk that one
    continuation passes through,
each with the window before it and the divergence slack (--swa-retain-budget tokens) before that,
i.e. the pages [align_down(end) - window - swa_retain_tokens, end). An SWA page outside every such
range (the front of a long prompt, whose window no request can ever resume at) is dropped, not
written. Pages the tier already holds (promoted back earlier, or written by an earlier eviction of
the same prefix) are not written again (KVTier.save only refreshes their recency).

The eager policy's finish-time trims (engine/kvcache/radix/eviction.py `trim_head`) go through the same
filter, so the tier serves eager caches as well.
"""

from __future__ import annotations

from swaserve.engine.kvcache.radix.node import Node
from swaserve.engine.kvcache.tier.index import KVTier


class Demoter:
    """Which pages an eviction writes to the second tier (module docstring). The evictor hands it every SWA
    page it frees (save_swa) and every node range it drops (protected_mask, then save_pages) before their
    ids are freed. Reads those nodes (pages, keys, protect_counts, anchored, children, locks, lost keys);
    changes nothing of the tree. Without a tier it does nothing."""

    def __init__(self, page_size: int, window: int, retain_tokens: int):
        self.page_size = page_size
        self.window = window
        self.retain_tokens = retain_tokens  # the cache's swa_retain_tokens (the divergence slack)
        self.tier: KVTier | None = None  # the cache's tier (SWARadixCache.set_tier sets both)
        self.saved_swa = 0  # SWA pages handed to the tier on eviction / trim
        self.skipped_swa = 0  # evicted SWA pages no resume point needs (not written)

    def _tier_lo(self, end_page: int) -> int:
        """First page of the window + divergence slack before page boundary end_page (an anchor's lo)."""
        P = self.page_size
        return max(0, end_page * P - self.window - self.retain_tokens) // P

    @staticmethod
    def _resumable_end(nd: Node) -> bool:
        """Whether a later request can resume at nd's end: a branch point, or a leaf that ends a sequence
        (no running request is extending it chunk by chunk, and it did not become a leaf by losing its
        continuation to eviction: that continuation's full pages went to the tier, so the path goes on
        there). Not the end of a prefill chunk that one continuation passes through."""
        if nd.children:
            return len(nd.children) > 1
        return not nd.handle_locks and not nd.lost_keys

    def _swa_worth_saving(self, nd: Node, i: int, protected: bool) -> bool:
        """Whether SWA page i of nd, being evicted, can serve a later request: an anchor protects it or
        did at some time (protected: as it was before the eviction dropped that anchor; Node.anchored),
        or it lies in the window + slack before nd's end and a request can resume there."""
        return (protected or bool(nd.anchored[i])
                or (nd.start_page + i >= self._tier_lo(nd.end_page) and self._resumable_end(nd)))

    def save_swa(self, nd: Node, i: int, page: int, protected: bool) -> None:
        """Write an evicted SWA page to the second tier (before its id is freed) if it is worth it."""
        if self.tier is None:
            return
        if self._swa_worth_saving(nd, i, protected):
            self.tier.save("swa", nd.keys[i], page)
            self.saved_swa += 1
        else:
            self.skipped_swa += 1

    def protected_mask(self, nd: Node, a: int) -> list[bool] | None:
        """Per page of [a, end) of nd: protected by an anchor (call before nd's anchors are dropped);
        None without a tier."""
        if self.tier is None:
            return None
        return [q > 0 for q in nd.protect_counts[a:]]

    def save_pages(self, nd: Node, a: int, protected: list[bool] | None) -> None:
        """Write the pages [a, ...) of nd (being dropped) to the second tier: every full page, and the SWA
        pages a resume point needs (protected: protected_mask's answer)."""
        if self.tier is None:
            return
        assert protected is not None
        for i in range(a, len(nd.full_pages)):
            self.tier.save("full", nd.keys[i], nd.full_pages[i])
            s = nd.swa_pages[i]
            if s is not None:
                self.save_swa(nd, i, s, protected[i - a])
