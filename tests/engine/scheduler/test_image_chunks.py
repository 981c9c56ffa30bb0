"""The chunk rule of bidirectional image attention (Req.chunk_end): a prefill chunk never ends inside an
image span; it stops before the image or runs to its end (past the budget when the image is longer than
what is left of it); a prefix hit inside an image (page granularity) is kept and the image's rest goes in
one chunk. The checking fake model verifies every KV read, over the real radix cache."""

from __future__ import annotations

import numpy as np
import pytest

from swaserve.engine.core import ImageInput, Req, SamplingParams, image_blocks
from swaserve.engine.scheduler import Scheduler, make_reqs
from tests.engine.scheduler.test_scheduler import build, expected

VOCAB = 97


def image(offset: int, length: int, key: int) -> ImageInput:
    return ImageInput(offset, length, key, np.zeros((1, 1), np.float32), np.zeros((1, 2), np.int64))


def reqs(rid: str, prompt: list[int], images: list[ImageInput], bidirectional: bool = True) -> list[Req]:
    return make_reqs(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0), context_length=4096,
                     eos_ids=(), seed=0, images=images, vocab=VOCAB, bidirectional_images=bidirectional)


def run(sched: Scheduler, model, todo: list[Req]) -> list[tuple[Req, int, int]]:
    """Runs to the end; returns every prefill chunk (req, start, end) scheduled."""
    for r in todo:
        sched.add(r)
    chunks = []
    while sched.has_work():
        batch, _ = sched.schedule()
        assert batch is not None
        for r, p, q in zip(batch.reqs, batch.prefix_lens, batch.q_lens):
            if p + q <= r.prompt_len:
                chunks.append((r, p, p + q))
        sched.update(batch, model(batch))
        sched.check_integrity()
    return chunks


def test_image_blocks_and_chunk_end() -> None:
    assert image_blocks([image(3, 5, 1), image(8, 4, 2), image(20, 6, 3)]) == ((3, 12), (20, 26))  # touching
    r = Req("r", "r", 0, [0] * 40, 40, SamplingParams(), attn_blocks=((10, 20),))
    assert r.chunk_end(0, 15) == 10  # stops before the image
    assert r.chunk_end(10, 15) == 20 and r.chunk_end(14, 16) == 20  # runs to the image's end
    assert r.chunk_end(0, 10) == 10 and r.chunk_end(0, 20) == 20 and r.chunk_end(0, 25) == 25
    assert Req("t", "t", 0, [0] * 40, 40, SamplingParams()).chunk_end(0, 15) == 15  # causal: unchanged


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunks_never_split_an_image(chunk: int) -> None:
    sched, model = build("real", P=4, W=16, chunk=chunk)
    prompts = [list(range(1, 60)), list(range(2, 50)), list(range(3, 70))]
    ims = [[image(7, 20, 11)], [image(3, 4, 12), image(30, 9, 13)], [image(10, 24, 14), image(34, 3, 15)]]
    todo = [r for i, (p, im) in enumerate(zip(prompts, ims)) for r in reqs(f"r{i}", p, im)]
    chunks = run(sched, model, todo)
    longest = max(hi - lo for r in todo for lo, hi in r.attn_blocks)
    for r, start, end in chunks:
        assert not any(lo < end < hi for lo, hi in r.attn_blocks), (r.rid, start, end)
        assert end - start <= max(chunk, longest)
    if chunk < longest:  # an image longer than the budget had a chunk of its own, past the budget
        assert any(end - start > chunk for _, start, end in chunks)
    for r in todo:
        assert r.output_ids == expected(r.token_ids[:r.prompt_len], 4, VOCAB)


def test_causal_chunks_unchanged() -> None:
    """The setting off: chunks split images as before (the budget alone)."""
    sched, model = build("real", P=4, W=16, chunk=5)
    (r,) = reqs("c", list(range(1, 40)), [image(7, 20, 21)], bidirectional=False)
    assert r.attn_blocks == ()
    chunks = run(sched, model, [r])
    assert [e - s for _, s, e in chunks] == [5] * 7 + [4]


def test_prefix_hit_inside_an_image_is_kept_and_the_rest_is_one_chunk() -> None:
    sched, model = build("real", P=4, W=16, chunk=2)
    head = list(range(1, 6))
    first = reqs("a", head + [0] * 30 + [50, 51, 52], [image(5, 30, 31)])
    run(sched, model, first)
    second = reqs("b", head + [0] * 30 + [60, 61, 62, 63], [image(5, 30, 31)])
    chunks = run(sched, model, second)
    (b,) = second
    assert b.cached_tokens == 32  # page-aligned, inside the image [5, 35)
    assert (chunks[0][1], chunks[0][2]) == (32, 35)  # the image's rest in one chunk, past the budget of 2
    assert b.output_ids == expected(b.token_ids[:b.prompt_len], 4, VOCAB)
