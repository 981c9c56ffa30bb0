"""Gemma 4 image preprocessing in numpy + PIL (no torch: this runs in the HTTP server's worker processes).

`prepare_image` reproduces transformers' Gemma4ImageProcessor (PIL backend, `image_processing_pil_gemma4.py`):

1. RGB conversion: an image with transparency (an alpha band, or a palette/`transparency` entry) is
   composited onto opaque white; every other mode (L, P, CMYK, I, ...) goes through `convert("RGB")`.
2. Aspect-ratio-preserving resize (PIL bicubic on the uint8 image) to the largest size whose sides are
   multiples of `pooling_kernel_size * patch_size` and whose patch count is at most
   `max_soft_tokens * pooling_kernel_size**2` (`target_size`; an image already at that size is not resized).
3. Rescale by 1/255 (computed in float64, stored as float32). No mean/std normalization: the encoder maps
   [0, 1] to [-1, 1] itself.
4. Patchify into rows of `patch_size * patch_size * 3` values ordered (row in patch, column in patch,
   channel), patches in row-major order, with position ids (x, y) = (patch column, patch row).

Difference from transformers: the processor pads every image to `max_soft_tokens * k**2` patches with
zero pixels and position (-1, -1). Those padding patches are masked out of attention, pooling and the
output, so they never change the encoder's result; `prepare_image` drops them (the arrays hold exactly
the image's patches), which the parity tests in tests/models/test_gemma4_vision.py confirm.

`max_soft_tokens` may be any positive budget (transformers only accepts 70, 140, 280, 560, 1120; the
tiny demo model uses a smaller one).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class PreparedImage:
    """One image, ready for the vision encoder."""

    pixel_values: np.ndarray  # float32 [num_patches, 3 * patch_size**2]
    position_ids: np.ndarray  # int64 [num_patches, 2]: (x, y) patch coordinates
    num_soft_tokens: int  # rows the encoder returns = image placeholder tokens in the prompt


def target_size(
    height: int, width: int, *, patch_size: int = 16, pooling_kernel_size: int = 3, max_soft_tokens: int = 280
) -> tuple[int, int]:
    """The (height, width) transformers resizes an image to (its `get_aspect_ratio_preserving_size`)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has no pixels: {width}x{height}")
    max_patches = max_soft_tokens * pooling_kernel_size**2
    side = pooling_kernel_size * patch_size
    scale = math.sqrt(max_patches * patch_size**2 / (height * width))
    th = int(math.floor(scale * height / side)) * side
    tw = int(math.floor(scale * width / side)) * side
    if th == 0 and tw == 0:
        raise ValueError(f"a {width}x{height} image resizes to 0x0 (side multiple {side})")
    longest = (max_patches // pooling_kernel_size**2) * side
    if th == 0:  # a wide strip: one row of pooling cells
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:  # a tall strip: one column
        tw, th = side, min(int(math.floor(height / width)) * side, longest)
    if th * tw > max_patches * patch_size**2:
        raise ValueError(f"resizing {width}x{height} to {tw}x{th} exceeds {max_patches} patches")
    return th, tw


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def num_soft_tokens_for(
    height: int, width: int, *, patch_size: int = 16, pooling_kernel_size: int = 3, max_soft_tokens: int = 280
) -> int:
    """The placeholder count Gemma4Processor inserts for an image of this size (no pixels needed)."""
    th, tw = target_size(
        height, width, patch_size=patch_size, pooling_kernel_size=pooling_kernel_size,
        max_soft_tokens=max_soft_tokens,
    )
    return (th // patch_size) * (tw // patch_size) // pooling_kernel_size**2


def prepare_image(
    image: Image.Image, *, patch_size: int = 16, pooling_kernel_size: int = 3, max_soft_tokens: int = 280
) -> PreparedImage:
    """Resize, rescale and patchify one PIL image as Gemma4ImageProcessor does (without its padding)."""
    if max_soft_tokens <= 0:
        raise ValueError(f"max_soft_tokens must be positive, got {max_soft_tokens}")
    rgb = to_rgb(image)
    th, tw = target_size(
        rgb.height, rgb.width, patch_size=patch_size, pooling_kernel_size=pooling_kernel_size,
        max_soft_tokens=max_soft_tokens,
    )
    if (rgb.height, rgb.width) != (th, tw):
        rgb = rgb.resize((tw, th), resample=Image.Resampling.BICUBIC)
    pixels = (np.asarray(rgb, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)  # [H, W, 3]
    ph, pw = th // patch_size, tw // patch_size
    patches = pixels.reshape(ph, patch_size, pw, patch_size, 3).transpose(0, 2, 1, 3, 4)  # [ph, pw, p, p, 3]
    patches = np.ascontiguousarray(patches.reshape(ph * pw, patch_size * patch_size * 3))  # [N, 3 p^2]
    ys, xs = np.meshgrid(np.arange(ph, dtype=np.int64), np.arange(pw, dtype=np.int64), indexing="ij")
    positions = np.stack([xs.reshape(-1), ys.reshape(-1)], axis=-1)  # [N, 2] (x, y)
    return PreparedImage(patches, positions, ph * pw // pooling_kernel_size**2)


def content_hash(p: PreparedImage) -> int:
    """A signed 64-bit cache key: sha256 over the shape, the pixel bytes and the position ids.

    Signed so that it fits an int64 (numpy/torch) as well as a Python int."""
    h = hashlib.sha256()
    h.update(np.asarray(p.pixel_values.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(p.pixel_values, dtype=np.float32).tobytes())
    h.update(np.ascontiguousarray(p.position_ids, dtype=np.int64).tobytes())
    h.update(int(p.num_soft_tokens).to_bytes(8, "little"))
    return int.from_bytes(h.digest()[:8], "little", signed=True)
