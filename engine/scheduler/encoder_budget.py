"""The image encoder's share of a step (pure Python: no torch).

The rule: the images a step's chunks reach that the encoder cache does not hold cost their soft tokens
(ImageInput.length) against a per-step budget (--image-encoder-budget, default --chunked-prefill-size,
vLLM's encoder compute budget). A chunk that would reach a new image past the budget ends just before it
(the image waits for a later step); a chunk that cannot even start is not scheduled. The first new image
of a step always fits (an image larger than the budget still runs, alone), an image already started (a
chunk before it was computed, its rows evicted since) is always taken, and one image reached by several
requests in a step costs once. The runner encodes each distinct image once (engine/runner/images.py).
"""

from __future__ import annotations

from collections.abc import Callable

from swaserve.engine.core import ImageInput, Req


class EncoderBudget:
    """Soft tokens of uncached images one step may start encoding; `begin()` at each step's start."""

    def __init__(self, tokens: int, cached: Callable[[ImageInput], bool]):
        assert tokens > 0
        self.tokens = tokens
        self.cached = cached  # the runner's ImageEmbedder.has
        self.left = tokens
        self.planned: set[int] = set()  # image keys this step encodes

    def begin(self) -> None:
        self.left = self.tokens
        self.planned = set()

    def fit(self, req: Req, start: int, q: int) -> int:
        """The chunk length (<= q) of req's positions [start, start + q) the budget allows, charging the
        new images the result covers."""
        for im in req.images:  # ordered by offset
            lo, hi = im.offset, im.offset + im.length
            if hi <= start:
                continue
            if lo >= start + q:
                break
            if im.key in self.planned or self.cached(im):
                continue
            if lo >= start and self.planned and im.length > self.left:
                return lo - start  # up to the image; it starts in a later step
            self.left -= im.length
            self.planned.add(im.key)
        return q
