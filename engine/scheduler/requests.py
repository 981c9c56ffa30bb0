"""Building the scheduler's Req objects from a request (its lengths checked: engine/validation.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from swaserve.engine.core import ImageInput, Req, SamplingParams, image_blocks, image_pad_ids
from swaserve.engine.validation import check_lengths


def choice_seed(base: int, index: int) -> int:
    """Seed of choice `index` of a request whose seed is `base` (choice 0 uses base itself)."""
    if index == 0:
        return base
    return (base * 1_000_003 + index * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF


def make_reqs(request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, context_length: int,
              eos_ids: Iterable[int], seed: int, anchors: Sequence[int] = (),
              share_prompt: bool = True, images: Sequence[ImageInput] = (), vocab: int = 0,
              bidirectional_images: bool = False) -> list[Req]:
    """One Req per choice (n > 1: choices 1.. wait for choice 0's prompt to be cached when
    share_prompt, then reuse its pages through the prefix cache). An image's span carries its pad ids
    (image_pad_ids, from `vocab` on): the prefix cache keys it by the image's content.
    `bidirectional_images`: the images' soft tokens see each other on the sliding layers (Req.attn_blocks)."""
    max_len = check_lengths(len(prompt_ids), params, context_length)
    if images:
        prompt_ids = list(prompt_ids)
        for im in images:
            prompt_ids[im.offset:im.offset + im.length] = image_pad_ids(im.key, im.length, vocab)
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop |= set(eos_ids)
    base = params.seed if params.seed is not None else seed
    reqs: list[Req] = []
    for i in range(params.n):
        reqs.append(Req(
            rid=request_id if params.n == 1 else f"{request_id}#{i}",
            request_id=request_id,
            index=i,
            token_ids=list(prompt_ids),
            prompt_len=len(prompt_ids),
            params=params,
            anchors=tuple(sorted({int(a) for a in anchors if 0 < int(a) < len(prompt_ids)})),
            images=tuple(images),
            attn_blocks=image_blocks(images) if bidirectional_images else (),
            max_len=max_len,
            stop_ids=frozenset(stop),
            seed=choice_seed(base, i),
            parent=reqs[0] if (i > 0 and share_prompt) else None,
        ))
    return reqs
