"""The encoder's share of a step (engine/scheduler/encoder_budget.py): new images past the budget wait for a
later step, the first new image of a step always runs, cached, started and repeated images cost nothing
more."""

from __future__ import annotations

from swaserve.engine.core import ImageInput, Req, SamplingParams
from swaserve.engine.scheduler.encoder_budget import EncoderBudget


def _req(spans: list[tuple[int, int, int]], length: int = 200) -> Req:
    ims = tuple(ImageInput(off, n, key, None, None) for off, n, key in spans)
    return Req("r", "r", 0, list(range(length)), length, SamplingParams(), images=ims)


def test_images_past_the_budget_wait() -> None:
    cached: set[int] = set()
    b = EncoderBudget(50, lambda im: im.key in cached)
    r = _req([(10, 30, 1), (50, 30, 2), (90, 30, 3)])
    b.begin()
    assert b.fit(r, 0, 150) == 50  # image 1 (30) fits, image 2 (30 > 20 left) waits: cut at its offset
    assert b.planned == {1} and b.left == 20
    cached.add(1)
    b.begin()
    assert b.fit(r, 50, 100) == 40  # image 2 runs, image 3 waits
    cached.add(2)
    b.begin()
    assert b.fit(r, 90, 60) == 60  # image 3


def test_first_new_image_always_runs_and_a_chunk_may_not_start() -> None:
    b = EncoderBudget(10, lambda im: False)
    big, other = _req([(0, 64, 7)]), _req([(5, 8, 8)])
    b.begin()
    assert b.fit(big, 0, 100) == 100  # larger than the budget, but the step's first new image
    assert b.fit(other, 0, 100) == 5  # the second request stops before its image
    assert b.fit(_req([(0, 8, 9)]), 0, 100) == 0  # one that starts at its image is not scheduled


def test_repeated_cached_and_started_images_cost_nothing_more() -> None:
    b = EncoderBudget(40, lambda im: im.key == 5)
    b.begin()
    assert b.fit(_req([(0, 30, 1)]), 0, 50) == 50
    assert b.fit(_req([(10, 30, 1)]), 0, 50) == 50  # the same content in another request: charged once
    assert b.fit(_req([(0, 30, 5)]), 0, 50) == 50  # cached
    assert b.left == 10
    assert b.fit(_req([(0, 30, 6)]), 10, 50) == 50  # started in an earlier step (rows evicted): always taken
    assert b.left == -20
    assert b.fit(_req([(0, 30, 1), (35, 30, 2)]), 0, 100) == 35
