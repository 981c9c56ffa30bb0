"""Images in a chat prompt (in the worker process, with the rendering): each image part decoded and
checked (server/media.py), prepared for the encoder (models/gemma4_image.py), and its placeholder in
the rendered prompt expanded to the image's soft tokens, wrapped in the begin / end-of-image tokens as
transformers' Gemma4Processor does. The engine keys the soft tokens by the image's content hash."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from swaserve.engine.config import VisionSpec
from swaserve.engine.core import ImageInput
from swaserve.server.errors import bad_request
from swaserve.server.media import MediaError, MediaPolicy, check_image_count, image_from_part

PLACEHOLDER = "<|image|>"  # Gemma 4's image token: the template's text holds one per image part
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# a part's path in the request when it is not messages[i].content[j] (the Responses API's input[i]...)
PARAM_KEY = "x_swaserve_param"


@dataclass(frozen=True)
class VisionSetup:
    """What the worker needs to prepare a request's images: the encoder's shapes and the operator's limits."""

    spec: VisionSpec
    policy: MediaPolicy = field(default_factory=MediaPolicy)


@dataclass
class ImageParts:
    """The image parts of a request's messages, in prompt order (message_dicts fills it)."""

    parts: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # (part, its path for errors)


def prepare_all(found: ImageParts, setup: VisionSetup) -> list[Any]:
    """Decode, check and prepare every image part (400 naming the part)."""
    from swaserve.models.gemma4_image import prepare_image

    try:
        check_image_count(len(found.parts), setup.policy)
        out = []
        for part, where in found.parts:
            img = image_from_part(part, where, setup.policy)
            out.append(prepare_image(img, patch_size=setup.spec.patch_size,
                                     pooling_kernel_size=setup.spec.pooling_kernel_size,
                                     max_soft_tokens=setup.spec.max_soft_tokens))
        return out
    except MediaError as e:
        raise bad_request(str(e), e.param) from None


def expand(ids: list[int], starts: list[int], prepared: list[Any],
           spec: VisionSpec) -> tuple[list[int], list[int], list[ImageInput]]:
    """Each image token of the rendered prompt -> [boi] + soft tokens + [eoi]; message starts shifted.
    A 400 when the template did not keep one placeholder per image."""
    from swaserve.models.gemma4_image import content_hash

    at = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(at) != len(prepared):
        raise bad_request(f"the prompt holds {len(at)} image placeholders for {len(prepared)} images (the "
                          f"chat template dropped an image part, or the text contains {PLACEHOLDER})",
                          "messages")
    out: list[int] = []
    images: list[ImageInput] = []
    moved: list[tuple[int, int]] = []  # (old position, shift after it)
    prev = 0
    for pos, p in zip(at, prepared):
        out.extend(ids[prev:pos])
        if spec.boi_token_id is not None:
            out.append(spec.boi_token_id)
        images.append(ImageInput(len(out), p.num_soft_tokens, content_hash(p), p.pixel_values,
                                 p.position_ids))
        out.extend([spec.image_token_id] * p.num_soft_tokens)
        if spec.eoi_token_id is not None:
            out.append(spec.eoi_token_id)
        moved.append((pos, len(out) - pos - 1))
        prev = pos + 1
    out.extend(ids[prev:])
    olds = [m[0] for m in moved]
    new_starts = []
    for s in starts:
        k = bisect.bisect_left(olds, s)  # placeholders before this start
        new_starts.append(s + (moved[k - 1][1] if k else 0))
    return out, new_starts, images
